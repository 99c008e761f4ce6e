#!/usr/bin/env bash
# Generates the Python gRPC stubs of every proto/*.proto into proto/ (git-ignored): generated
# code must match the installed grpcio/protobuf, so it is built here, never committed or edited.
# Run from anywhere; PYTHON picks the interpreter (default: the project's .venv).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-.venv/bin/python}

# -I . keeps the package path in the generated imports (`from proto import metadata_pb2`).
"$PYTHON" -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. proto/*.proto
echo "gen_proto: generated stubs for" proto/*.proto
