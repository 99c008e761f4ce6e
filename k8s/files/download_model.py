"""Downloads the model from the hub into PDCLUSTER_MODEL_DIR: the chart's init container, and the
only place in a pdcluster deployment that downloads anything (every other container runs with
HF_HUB_OFFLINE=1).

Environment: PDCLUSTER_MODEL_REPO, PDCLUSTER_MODEL_REVISION, PDCLUSTER_MODEL_DIR,
PDCLUSTER_MODEL_PATTERNS (comma-separated globs; empty: every file) and
PDCLUSTER_MODEL_ALLOW_UNPINNED. HF_TOKEN and HF_ENDPOINT are read by huggingface_hub itself.

The revision must be a commit (40 hex digits): a branch or tag name moves, so whoever can push
to the repository would choose what the pods run, and two pods started an hour apart could
serve different weights. A name is accepted only with PDCLUSTER_MODEL_ALLOW_UNPINNED=1 (the
chart's `model.hub.acknowledgeUnpinnedRevision`; empty then means `main`): it is resolved to
its commit once, and that commit is what is downloaded. A finished download leaves a marker
beside the model naming what it fetched and the commit, so a restarted pod whose volume
survived skips the download; any other change fetches again.
Exit status: 0 when the folder holds the model, 1 otherwise (the pod does not start).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

MARKER = ".pdcluster-download.json"
COMMIT = re.compile(r"^[0-9a-f]{40}$")


def wanted() -> dict:
    patterns = [p.strip() for p in os.environ.get("PDCLUSTER_MODEL_PATTERNS", "").split(",")]
    return {
        "repo": os.environ["PDCLUSTER_MODEL_REPO"],
        "revision": (os.environ.get("PDCLUSTER_MODEL_REVISION")
                     or ("main" if unpinned_allowed() else "")),
        "patterns": [p for p in patterns if p],
    }


def already_done(target: Path, want: dict) -> bool:
    try:
        done = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(done, dict) and {k: done.get(k) for k in want} == want


def resolve(want: dict) -> str:
    """The commit to download: the revision itself when it is one, else what the name
    points at now."""
    if COMMIT.match(want["revision"]):
        return want["revision"]
    from huggingface_hub import HfApi

    return HfApi().model_info(want["repo"], revision=want["revision"]).sha


def download(target: Path, want: dict, commit: str) -> None:
    from huggingface_hub import snapshot_download

    snapshot_download(
        repo_id=want["repo"],
        revision=commit,
        local_dir=target,
        allow_patterns=want["patterns"] or None,
    )


def unpinned_allowed() -> bool:
    return os.environ.get("PDCLUSTER_MODEL_ALLOW_UNPINNED") == "1"


def check_pinned(want: dict) -> str | None:
    """Why the revision is refused (None: it is a commit, or names are allowed)."""
    if COMMIT.match(want["revision"]) or unpinned_allowed():
        return None
    return (f"download_model: PDCLUSTER_MODEL_REVISION {want['revision']!r} is not a commit "
            "(40 hex digits): a branch or tag moves with whoever pushes to the repository. "
            "Set model.hub.revision to a commit, or model.hub.acknowledgeUnpinnedRevision")


def main() -> int:
    want = wanted()
    if not want["repo"]:
        print("download_model: PDCLUSTER_MODEL_REPO is empty (set model.hub.repo)", file=sys.stderr)
        return 1
    refused = check_pinned(want)
    if refused:
        print(refused, file=sys.stderr)
        return 1
    target = Path(os.environ["PDCLUSTER_MODEL_DIR"])
    if already_done(target, want):
        print(f"download_model: {target} already holds {want['repo']}@{want['revision']}")
        return 0
    commit = resolve(want)
    if commit != want["revision"]:
        print(f"download_model: WARNING: {want['revision']!r} is not pinned; it is commit "
              f"{commit} now (set model.hub.revision to it)", flush=True)
    print(f"download_model: {want['repo']}@{commit} -> {target}", flush=True)
    target.mkdir(parents=True, exist_ok=True)
    download(target, want, commit)
    if not (target / "config.json").is_file():
        print(f"download_model: no config.json in {target}: not an HF model folder",
              file=sys.stderr)
        return 1
    (target / MARKER).write_text(json.dumps({**want, "commit": commit}))
    print("download_model: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
