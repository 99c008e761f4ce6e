"""download_model.py, the hub-download init container (model.source=hub), against a fake
huggingface_hub: it downloads once, skips when its marker matches, and fails clearly."""

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

FAKE_HUB = '''
import json, os
from pathlib import Path


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
                "PDCLUSTER_MODEL_REPO": "org/model", "PDCLUSTER_MODEL_REVISION": "main",
                "PDCLUSTER_MODEL_PATTERNS": "", **env}
    proc = subprocess.run([sys.executable, str(DOWNLOAD_MODEL)], env=full_env,
                          capture_output=True, text=True, timeout=60)
    return proc, [json.loads(line) for line in calls.read_text().splitlines()]


def test_download_fetches_once_then_skips(tmp_path) -> None:
    proc, calls = run_download(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert calls == [["org/model", "main", str(tmp_path / "m" / "x"), None]]
    proc, calls = run_download(tmp_path)
    assert proc.returncode == 0 and "already holds" in proc.stdout
    assert len(calls) == 1
    proc, calls = run_download(tmp_path, PDCLUSTER_MODEL_REVISION="v2")
    assert proc.returncode == 0 and len(calls) == 2


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
