"""The repository carries what its tests and docs need: nothing refers to a folder beside the
checkout, and the third-party files in tests/data are there, unchanged, with their source."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("README.md", "Makefile", "docs", "pdcluster", "tests", "k8s", "scripts", "docker",
           "benchmarks")
# `../shared/…`, or a path built from the checkout's parent: `REPO_ROOT.parent / "shared"`.
OUTSIDE = re.compile(r"\.\./shared\b|\.parent\s*/\s*[\"']shared[\"']")
DATA = REPO_ROOT / "tests" / "data"


def scanned_files() -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        path = REPO_ROOT / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(p for p in path.rglob("*") if p.is_file()
                         and p.suffix in {".py", ".md", ".yaml", ".yml", ".tpl", ".sh", ".txt",
                                          ".toml", ".json", ""}
                         and "__pycache__" not in p.parts and p != Path(__file__).resolve())
    return files


def test_nothing_refers_to_a_folder_beside_the_checkout() -> None:
    hits = []
    for path in scanned_files():
        text = path.read_text(errors="replace")
        hits += [f"{path.relative_to(REPO_ROOT)}:{n}" for n, line in
                 enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, f"references outside the repository: {hits}"


def test_the_scan_finds_what_it_looks_for() -> None:
    assert OUTSIDE.search("see ../shared/data/x.jsonl")
    assert OUTSIDE.search('ROOT.parent / "shared" / "schemas"')
    assert not OUTSIDE.search("a shared prefix in ../sharedx")


def test_third_party_data_is_present_unchanged_and_attributed() -> None:
    notice = (DATA / "README.md").read_text()
    trace = DATA / "mooncake_synthetic_trace.jsonl"
    digest = hashlib.sha256(trace.read_bytes()).hexdigest()
    assert digest in notice, "the trace differs from the one tests/data/README.md describes"
    assert len(trace.read_text().splitlines()) == 3993
    for kind in ("raycluster", "rayjob"):
        assert (DATA / "kuberay" / f"{kind}.v1.schema.json").is_file()
    assert notice.count("Apache-2.0") >= 2 and "kvcache-ai/Mooncake" in notice
    assert "ray-project/kuberay" in notice
