"""Generates the Python gRPC stubs of every proto/*.proto into proto/ (git-ignored).

Generated code must match the installed grpcio/protobuf, so it is built on the machine, never
committed or edited: by `scripts/setup.sh`, and by the package build itself (setup.py's build_py
hook), so a wheel or a plain `pip install .` ships stubs made by its own grpcio-tools.

The stubs import each other as `pdcluster.proto.metadata_pb2` (the installed name): protoc writes
imports after the path of the .proto below its include root, so the files are compiled from a
temporary `pdcluster/proto/` copy. Run: python scripts/gen_proto.py [REPO_ROOT]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(root: Path) -> list[Path]:
    """Compiles root/proto/*.proto; returns the stub files written into root/proto."""
    from grpc_tools import protoc  # a build requirement, imported only when building

    protos = sorted((root / "proto").glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp, "pdcluster", "proto")
        package.mkdir(parents=True)
        for proto in protos:
            shutil.copy(proto, package / proto.name)
        args = ["grpc_tools.protoc", f"-I{tmp}", f"--python_out={tmp}",
                f"--grpc_python_out={tmp}", f"--pyi_out={tmp}",
                *(str(package / p.name) for p in protos)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {[p.name for p in protos]}")
        written = []
        for stub in sorted(package.iterdir()):
            if stub.name.endswith(STUB_SUFFIXES):
                written.append(Path(shutil.copy(stub, root / "proto" / stub.name)))
    return written


if __name__ == "__main__":
    repo = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
    stubs = generate(repo)
    print("gen_proto: generated", " ".join(s.name for s in stubs))
