"""download_model.py, the hub-download init container (model.source=hub), against a fake
huggingface_hub: it downloads once, skips when its marker matches, and fails clearly; it
downloads a commit, refuses a branch or tag name unless told to accept one (then resolves it
to its commit and downloads that), and records the commit beside the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.k8s.chart import CHART

DOWNLOAD_MODEL = CHART / "files" / "download_model.py"
PINNED = "7ae557604adf67be50417f59c2c2f167def9a775"
MOVED = "0123456789abcdef0123456789abcdef01234567"

FAKE_HUB = '''
import json, os
from pathlib import Path


MOVED = "0123456789abcdef0123456789abcdef01234567"  # what a branch points at now


class HfApi:
    def model_info(self, repo_id, revision=None):
        with open(os.environ["FAKE_HUB_CALLS"], "a") as f:
            f.write(json.dumps(["model_info", repo_id, revision]) + "\\n")
        return type("ModelInfo", (), {"sha": MOVED})()


def snapshot_download(repo_id, revision, local_dir, allow_patterns=None):
    with open(os.environ["FAKE_HUB_CALLS"], "a") as f:
        f.write(json.dumps([repo_id, revision, str(local_dir), allow_patterns]) + "\\n")
    if repo_id != "org/not-a-model":
        (Path(local_dir) / "config.json").write_text("{}")
    return str(local_dir)
'''


def run_download(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list]:
    fake = tmp_path / "fakehub"
    (fake / "huggingface_hub").mkdir(parents=True, exist_ok=True)
    (fake / "huggingface_hub" / "__init__.py").write_text(textwrap.dedent(FAKE_HUB))
    calls = tmp_path / "calls.jsonl"
    calls.touch()
    full_env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(fake),
                "FAKE_HUB_CALLS": str(calls), "PDCLUSTER_MODEL_DIR": str(tmp_path / "m" / "x"),
                "PDCLUSTER_MODEL_REPO": "org/model", "PDCLUSTER_MODEL_REVISION": PINNED,
                "PDCLUSTER_MODEL_PATTERNS": "", **env}
    proc = subprocess.run([sys.executable, str(DOWNLOAD_MODEL)], env=full_env,
                          capture_output=True, text=True, timeout=60)
    return proc, [json.loads(line) for line in calls.read_text().splitlines()]


def test_download_fetches_once_then_skips(tmp_path) -> None:
    proc, calls = run_download(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert calls == [["org/model", PINNED, str(tmp_path / "m" / "x"), None]]
    marker = json.loads((tmp_path / "m" / "x" / ".pdcluster-download.json").read_text())
    assert marker["commit"] == PINNED
    proc, calls = run_download(tmp_path)
    assert proc.returncode == 0 and "already holds" in proc.stdout
    assert len(calls) == 1
    proc, calls = run_download(tmp_path, PDCLUSTER_MODEL_REVISION=MOVED)
    assert proc.returncode == 0 and len(calls) == 2


@pytest.mark.parametrize("revision", ["", "main", "v2.0", PINNED[:12], PINNED.upper()])
def test_a_revision_that_is_not_a_commit_is_refused(tmp_path, revision: str) -> None:
    proc, calls = run_download(tmp_path, PDCLUSTER_MODEL_REVISION=revision)
    assert proc.returncode == 1 and "is not a commit" in proc.stderr, proc.stderr
    assert calls == []  # nothing fetched, not even resolved


@pytest.mark.parametrize("revision", ["", "main"])
def test_an_acknowledged_branch_downloads_the_commit_it_names_and_records_it(
        tmp_path, revision: str) -> None:
    proc, calls = run_download(tmp_path, PDCLUSTER_MODEL_REVISION=revision,
                               PDCLUSTER_MODEL_ALLOW_UNPINNED="1")
    assert proc.returncode == 0, proc.stderr
    assert "not pinned" in proc.stdout and MOVED in proc.stdout
    # resolved once, then exactly that commit downloaded (a push in between changes nothing)
    assert calls == [["model_info", "org/model", "main"],
                     ["org/model", MOVED, str(tmp_path / "m" / "x"), None]]
    marker = json.loads((tmp_path / "m" / "x" / ".pdcluster-download.json").read_text())
    assert marker["revision"] == "main" and marker["commit"] == MOVED


def test_download_passes_patterns(tmp_path) -> None:
    proc, calls = run_download(tmp_path, PDCLUSTER_MODEL_PATTERNS="*.json,tokenizer.model")
    assert proc.returncode == 0, proc.stderr
    assert calls[0][3] == ["*.json", "tokenizer.model"]


@pytest.mark.parametrize(("env", "message"), [
    ({"PDCLUSTER_MODEL_REPO": ""}, "PDCLUSTER_MODEL_REPO is empty"),
    ({"PDCLUSTER_MODEL_REPO": "org/not-a-model"}, "no config.json"),
])
def test_download_fails_clearly(tmp_path, env: dict, message: str) -> None:
    proc, _ = run_download(tmp_path, **env)
    assert proc.returncode == 1
    assert message in proc.stderr
