"""Generates the Python gRPC stubs of every pdcluster/proto/*.proto next to it (git-ignored).

Generated code must match the installed grpcio/protobuf, so it is built on the machine, never
committed or edited: by `scripts/setup.sh`, and by the package build itself (setup.py's build_py
hook), so a wheel or a plain `pip install .` ships stubs made by its own grpcio-tools.

protoc names imports after the .proto's path below its include root, so compiling from the
repository root makes the stubs import each other as `pdcluster.proto.metadata_pb2`, the
installed name. Run: python scripts/gen_proto.py [REPO_ROOT]
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path("pdcluster", "proto")
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(root: Path) -> list[Path]:
    """Compiles root/pdcluster/proto/*.proto; returns the stub files written beside them."""
    from grpc_tools import protoc  # a build requirement, imported only when building

    protos = sorted((root / PROTO_DIR).glob("*.proto"))
    args = ["grpc_tools.protoc", f"-I{root}", f"--python_out={root}",
            f"--grpc_python_out={root}", f"--pyi_out={root}",
            *(str(p) for p in protos)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {[p.name for p in protos]}")
    return sorted(p for p in (root / PROTO_DIR).iterdir() if p.name.endswith(STUB_SUFFIXES))


if __name__ == "__main__":
    repo = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd()
    stubs = generate(repo.resolve())
    print("gen_proto: generated", " ".join(s.name for s in stubs))
