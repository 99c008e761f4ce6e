"""`pip install .` gives a working package: the wheel, installed into a fresh venv, holds one
top-level package (`pdcluster`), gRPC stubs its build generated, and every module of every room
imports from it; the `pdcluster` command runs.

The build runs on a copy of the checkout without its generated stubs (so the build hook must
make them) and without build isolation (no index is reachable in tests: setuptools and
grpcio-tools come from the project's venv). The fresh venv sees the project venv's
third-party packages through a .pth line (torch is not downloaded again), but not the
checkout: the interpreter runs from a temporary folder, and every module's file is asserted to
live in the fresh venv.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("core", "engine", "transfer", "metadata_service", "node", "prefill_node",
         "decode_node", "router", "cluster", "proto", "benchmarks")
SKIP_DIRS = {".git", ".venv", ".cache", "build", "dist", "tests", "__pycache__", "docs", "k8s",
             "docker", ".pytest_cache", ".ruff_cache", ".mypy_cache", ".hypothesis"}

pytestmark = pytest.mark.slow


def _copy_checkout(dest: Path) -> Path:
    """The checkout's sources, symlinks kept as links, generated stubs left behind."""
    def ignore(folder: str, names: list[str]) -> set[str]:
        skipped = {n for n in names if n in SKIP_DIRS or n.endswith(".egg-info")}
        if Path(folder).name == "proto":
            skipped |= {n for n in names if "_pb2" in n}
        return skipped
    shutil.copytree(REPO_ROOT, dest, symlinks=True, ignore=ignore)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    src = _copy_checkout(work / "src")
    assert not list((src / "proto").glob("*_pb2*.py"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(work / "dist"), str(src)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (built,) = (work / "dist").glob("pdcluster-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed; returns its python."""
    env_dir = tmp_path_factory.mktemp("venv") / "env"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True).strip())
    # Third-party dependencies from the project's venv, after the fresh venv's own packages.
    (site / "project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return python


def test_the_wheel_installs_one_namespace_with_generated_stubs(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"pdcluster"}
    for room in ROOMS:
        assert f"pdcluster/{room}/__init__.py" in names, room
    for stub in ("metadata_pb2.py", "metadata_pb2_grpc.py", "metadata.proto"):
        assert f"pdcluster/proto/{stub}" in names, stub
    assert not any(name.startswith("tests/") for name in names)
    sources = {f"pdcluster/{path.relative_to(REPO_ROOT)}" for room in ROOMS
               for path in (REPO_ROOT / room).rglob("*.py") if "__pycache__" not in path.parts
               and not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))}
    assert not sources - set(names), "modules missing from the wheel (pyproject.toml's " \
        f"packages list): {sorted(sources - set(names))}"


def test_every_module_imports_from_the_installed_wheel(installed: Path, wheel: Path,
                                                       tmp_path: Path) -> None:
    modules = sorted(
        name[:-len(".py")].replace("/", ".").removesuffix(".__init__")
        for name in zipfile.ZipFile(wheel).namelist()
        if name.startswith("pdcluster/") and name.endswith(".py")
        and not name.endswith("__main__.py"))
    code = ("import importlib, json, sys\n"
            "files = {m: importlib.import_module(m).__file__ for m in sys.argv[1:]}\n"
            "print(json.dumps(files))\n")
    proc = subprocess.run([installed, "-c", code, *modules], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = json.loads(proc.stdout.strip().splitlines()[-1])
    venv_root = installed.parent.parent
    outside = {m: f for m, f in files.items() if not Path(f).is_relative_to(venv_root)}
    assert not outside, f"imported from outside the installed wheel: {outside}"
    assert len(files) > 100


def test_the_pdcluster_command_runs(installed: Path, tmp_path: Path) -> None:
    command = installed.parent / "pdcluster"
    proc = subprocess.run([command, "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "serve" in proc.stdout
