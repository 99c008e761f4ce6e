"""Downloads the model from the hub into PDCLUSTER_MODEL_DIR: the chart's init container, and the
only place in a pdcluster deployment that downloads anything (every other container runs with
HF_HUB_OFFLINE=1).

Environment: PDCLUSTER_MODEL_REPO, PDCLUSTER_MODEL_REVISION, PDCLUSTER_MODEL_DIR, and
PDCLUSTER_MODEL_PATTERNS (comma-separated globs; empty: every file). HF_TOKEN and HF_ENDPOINT
are read by huggingface_hub itself. A finished download leaves a marker naming what it fetched,
so a restarted pod whose volume survived skips the download; any other change fetches again.
Exit status: 0 when the folder holds the model, 1 otherwise (the pod does not start).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

MARKER = ".pdcluster-download.json"


def wanted() -> dict:
    patterns = [p.strip() for p in os.environ.get("PDCLUSTER_MODEL_PATTERNS", "").split(",")]
    return {
        "repo": os.environ["PDCLUSTER_MODEL_REPO"],
        "revision": os.environ.get("PDCLUSTER_MODEL_REVISION") or "main",
        "patterns": [p for p in patterns if p],
    }


def already_done(target: Path, want: dict) -> bool:
    try:
        return json.loads((target / MARKER).read_text()) == want
    except (OSError, ValueError):
        return False


def download(target: Path, want: dict) -> None:
    from huggingface_hub import snapshot_download

    snapshot_download(
        repo_id=want["repo"],
        revision=want["revision"],
        local_dir=target,
        allow_patterns=want["patterns"] or None,
    )


def main() -> int:
    want = wanted()
    if not want["repo"]:
        print("download_model: PDCLUSTER_MODEL_REPO is empty (set model.hub.repo)", file=sys.stderr)
        return 1
    target = Path(os.environ["PDCLUSTER_MODEL_DIR"])
    if already_done(target, want):
        print(f"download_model: {target} already holds {want['repo']}@{want['revision']}")
        return 0
    print(f"download_model: {want['repo']}@{want['revision']} -> {target}", flush=True)
    target.mkdir(parents=True, exist_ok=True)
    download(target, want)
    if not (target / "config.json").is_file():
        print(f"download_model: no config.json in {target}: not an HF model folder",
              file=sys.stderr)
        return 1
    (target / MARKER).write_text(json.dumps(want))
    print("download_model: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
