"""The gRPC stubs' runtime checks against pyproject.toml's bounds.

The stubs are generated at build time (scripts/gen_proto.py) and check at import that grpcio is
at least the generator's version (`GRPC_GENERATED_VERSION`) and that protobuf runs their gencode
(`ValidateProtobufRuntimeVersion`). pyproject.toml pins the build's generator and declares the
runtime bounds that follow from it; constraints.txt keeps the project's venv on that generator.
Here the checkout's stubs are imported with grpcio and protobuf reporting the lowest versions
pyproject.toml allows (they must import) and one patch release below (they must refuse).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
STUBS = REPO_ROOT / "pdcluster" / "proto"


def requirement(requirements: list[str], name: str) -> str:
    (found,) = [r for r in requirements if re.match(rf"{re.escape(name)}\b(?![-\w])", r)]
    return found[len(name):]


def lower_bound(spec: str, operator: str = ">=") -> str:
    (bound,) = re.findall(rf"{re.escape(operator)}\s*([\d.]+)", spec)
    return bound


GENERATOR = lower_bound(requirement(PYPROJECT["build-system"]["requires"], "grpcio-tools"), "==")
DEPENDENCIES = PYPROJECT["project"]["dependencies"]
LOWEST_GRPCIO = lower_bound(requirement(DEPENDENCIES, "grpcio"))
LOWEST_PROTOBUF = lower_bound(requirement(DEPENDENCIES, "protobuf"))

IMPORT_AS = """
import sys
import grpc
from google.protobuf import runtime_version
grpc.__version__ = sys.argv[1]
major, minor, patch = map(int, sys.argv[2].split("."))
runtime_version.MAJOR, runtime_version.MINOR, runtime_version.PATCH = major, minor, patch
import pdcluster.proto.metadata_pb2_grpc
"""


def import_stubs_as(grpcio: str, protobuf: str) -> subprocess.CompletedProcess[str]:
    """Import the stubs in a fresh interpreter whose grpcio and protobuf report these versions."""
    return subprocess.run([sys.executable, "-c", IMPORT_AS, grpcio, protobuf], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def one_patch_below(release: str) -> str:
    major, minor, patch = map(int, release.split("."))
    assert patch > 0, release
    return f"{major}.{minor}.{patch - 1}"


def test_the_runtime_bounds_follow_the_pinned_generator() -> None:
    assert lower_bound(requirement(DEPENDENCIES, "grpcio-tools")) == GENERATOR
    assert LOWEST_GRPCIO == GENERATOR  # its stubs need grpcio >= the generator's version
    assert "<8" in requirement(DEPENDENCIES, "protobuf")  # gencode runs on its own major only
    constraints = (REPO_ROOT / "constraints.txt").read_text()
    assert f"grpcio-tools=={GENERATOR}" in constraints.split()


def test_the_stubs_were_made_by_the_pinned_generator() -> None:
    assert version("grpcio-tools") == GENERATOR, "the venv's generator is not the pinned one " \
        "(constraints.txt); regenerate with scripts/gen_proto.py after installing it"
    grpc_stub = (STUBS / "metadata_pb2_grpc.py").read_text()
    assert f"GRPC_GENERATED_VERSION = '{GENERATOR}'" in grpc_stub
    gencode = re.search(r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),",
                        (STUBS / "metadata_pb2.py").read_text())
    assert gencode is not None
    assert ".".join(gencode.groups()) == LOWEST_PROTOBUF


def test_the_stubs_import_under_the_lowest_allowed_versions() -> None:
    proc = import_stubs_as(LOWEST_GRPCIO, LOWEST_PROTOBUF)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_stubs_refuse_anything_older() -> None:
    proc = import_stubs_as(one_patch_below(LOWEST_GRPCIO), LOWEST_PROTOBUF)
    assert proc.returncode != 0 and f"depends on grpcio>={LOWEST_GRPCIO}" in proc.stderr
    proc = import_stubs_as(LOWEST_GRPCIO, one_patch_below(LOWEST_PROTOBUF))
    assert proc.returncode != 0 and "VersionError" in proc.stderr, proc.stderr[-2000:]
