"""What a user installs, run the way a user runs it: outside the checkout.

`build_wheel` builds a wheel from a copy of the checkout without its generated stubs (the build
hook must make them) and without build isolation (no index is reachable in tests: setuptools
and grpcio-tools come from the project's venv). `fresh_venv` installs it into a new venv that
sees the project venv's third-party packages through a .pth line (torch is not downloaded
again) but not the checkout. `Installed` runs commands of either install — the wheel's venv, or
the project's editable venv — from a folder outside the checkout, with `PYTHONSAFEPATH` set so
that no interpreter puts its working folder or script folder on `sys.path`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE_ROOMS = ("core", "engine", "transfer", "metadata_service", "node", "prefill_node",
                 "decode_node", "router", "cluster", "proto", "benchmarks", "vllm_backend")
_SKIP_DIRS = {".git", ".venv", ".cache", "build", "dist", "tests", "__pycache__", "docs", "k8s",
              "docker", ".pytest_cache", ".ruff_cache", ".mypy_cache", ".hypothesis"}


def build_wheel(work: Path) -> Path:
    """A wheel of the checkout, built from a copy without generated stubs."""
    def ignore(folder: str, names: list[str]) -> set[str]:
        skipped = {n for n in names if n in _SKIP_DIRS or n.endswith(".egg-info")}
        if Path(folder).name == "proto":
            skipped |= {n for n in names if "_pb2" in n}
        return skipped

    src = work / "src"
    shutil.copytree(REPO_ROOT, src, ignore=ignore)
    assert not list((src / "pdcluster" / "proto").glob("*_pb2*.py"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(work / "dist"), str(src)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (built,) = (work / "dist").glob("pdcluster-*.whl")
    return built


def fresh_venv(wheel: Path, env_dir: Path) -> Path:
    """A new venv with the wheel installed; returns its python."""
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True).strip())
    # Third-party dependencies from the project's venv, after the fresh venv's own packages.
    # A path added by a .pth line is not a site folder: the editable install's own .pth (which
    # maps `pdcluster` to the checkout) is not run from it.
    (site / "project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The `ray` command a pip-installed Ray puts beside python (its console script), which
    # the chart's launcher runs: the dependencies came in through the .pth line, not pip.
    ray = env_dir / "bin" / "ray"
    ray.write_text(f"#!{python}\nimport sys\nfrom ray.scripts.scripts import main\n"
                   "sys.exit(main())\n")
    ray.chmod(0o755)
    return python


@dataclass(frozen=True)
class Installed:
    """One install of pdcluster: its interpreter, and where its package's files must live."""

    name: str  # "wheel" or "editable"
    python: Path
    package_dir: Path  # the folder every pdcluster module's file must be in

    @property
    def bin(self) -> Path:
        return self.python.parent

    def env(self, **extra: str) -> dict[str, str]:
        """A user's environment: this install's bin first on PATH, no PYTHONPATH, no checkout
        on sys.path, the hub offline."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PDCLUSTER_CACHE_DIR", "VIRTUAL_ENV")}
        env.update(PATH=f"{self.bin}{os.pathsep}/usr/bin:/bin", PYTHONSAFEPATH="1",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        env.update(extra)
        return env

    def run(self, args: list[str], cwd: Path, timeout: float = 300,
            **env: str) -> subprocess.CompletedProcess:
        """`args[0]` is a command of this install's bin folder (`pdcluster`, `python`)."""
        command = [str(self.bin / args[0]), *args[1:]]
        return subprocess.run(command, cwd=cwd, env=self.env(**env), capture_output=True,
                              text=True, timeout=timeout)


def site_package_dir(python: Path) -> Path:
    """Where that interpreter's venv installs the pdcluster package."""
    site = subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True)
    return Path(site.strip()) / "pdcluster"


def editable_install() -> Installed:
    """The project's venv (`pip install -e .` by scripts/setup.sh)."""
    return Installed("editable", Path(sys.executable), REPO_ROOT / "pdcluster")


# A script run by an install's python: where every loaded pdcluster module came from, and any
# module of ours loaded under a second name (a bare room, `engine.llm` beside
# `pdcluster.engine.llm`).
MODULE_REPORT = f"""
import json, sys
rooms = {PACKAGE_ROOMS!r}
ours = {{name: getattr(module, "__file__", None) for name, module in list(sys.modules.items())
        if name == "pdcluster" or name.startswith("pdcluster.")}}
bare = sorted(name for name in sys.modules if name.split(".")[0] in rooms)
print("MODULES " + json.dumps({{"ours": ours, "bare": bare}}))
"""
