"""`pip install .` gives a working package: the wheel, installed into a fresh venv
(tests/installed.py), holds one top-level package (`pdcluster`) with every module of the tree
and gRPC stubs its build generated, every module imports from it, and the `pdcluster` command
runs. What the installed package does is tests/test_installed.py.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from pdcluster.cluster.cli import BENCHMARKS
from tests.installed import PACKAGE_ROOMS, REPO_ROOT, Installed

pytestmark = pytest.mark.slow
# What `pdcluster bench`'s benchmarks import at run time besides their own modules.
BENCHMARK_HELPERS = {"host_tier_bench", "spec_decode_bench", "gpu_bench", "trace_client",
                     "trace_workload", "instant_node", "ports"}


def test_the_wheel_installs_one_namespace_with_generated_stubs(built_wheel: Path) -> None:
    names = zipfile.ZipFile(built_wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"pdcluster"}
    for room in PACKAGE_ROOMS:
        assert f"pdcluster/{room}/__init__.py" in names, room
    for stub in ("metadata_pb2.py", "metadata_pb2_grpc.py", "metadata.proto"):
        assert f"pdcluster/proto/{stub}" in names, stub
    assert not any(name.startswith("tests/") for name in names)
    sources = {str(path.relative_to(REPO_ROOT)) for pattern in ("*.py", "*.cpp")
               for path in (REPO_ROOT / "pdcluster").rglob(pattern)
               if "__pycache__" not in path.parts
               and not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))}
    assert not sources - set(names), "modules or kernel sources missing from the wheel " \
        f"(pyproject.toml's package discovery and data): {sorted(sources - set(names))}"


def test_the_wheel_holds_no_harness(built_wheel: Path) -> None:
    """The package ships what `pdcluster bench` offers and what those benchmarks import; the
    harnesses and studies (benchmarks/ of the checkout) and the test fakes stay out."""
    names = zipfile.ZipFile(built_wheel).namelist()
    shipped = {Path(name).stem for name in names
               if name.startswith("pdcluster/benchmarks/") and name.endswith(".py")}
    offered = {module for module, _ in BENCHMARKS.values()}
    assert shipped == {"__init__"} | offered | BENCHMARK_HELPERS
    harnesses = {path.stem for path in (REPO_ROOT / "benchmarks").glob("*.py")}
    assert {"chaos_bench", "peers_bench", "vllm_bench", "grammar_bench", "mla_decode",
            "moe_step"} <= harnesses
    stems = {Path(name).stem for name in names}
    assert not stems & (harnesses - {"__init__", "__main__"}), stems & harnesses
    assert "pdcluster/transfer/loopback.py" not in names  # a test fake (tests/transfer)


def test_every_module_imports_from_the_installed_wheel(wheel_install: Installed,
                                                       built_wheel: Path,
                                                       tmp_path: Path) -> None:
    modules = sorted(
        name[:-len(".py")].replace("/", ".").removesuffix(".__init__")
        for name in zipfile.ZipFile(built_wheel).namelist()
        if name.startswith("pdcluster/") and name.endswith(".py")
        and not name.endswith("__main__.py"))
    code = ("import importlib, json, sys\n"
            "files = {m: importlib.import_module(m).__file__ for m in sys.argv[1:]}\n"
            "print(json.dumps(files))\n")
    proc = wheel_install.run(["python", "-c", code, *modules], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = json.loads(proc.stdout.strip().splitlines()[-1])
    outside = {m: f for m, f in files.items()
               if not Path(f).is_relative_to(wheel_install.package_dir)}
    assert not outside, f"imported from outside the installed wheel: {outside}"
    assert len(files) > 100


def test_the_pdcluster_command_runs(wheel_install: Installed, tmp_path: Path) -> None:
    proc = wheel_install.run(["pdcluster", "--help"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "serve" in proc.stdout
