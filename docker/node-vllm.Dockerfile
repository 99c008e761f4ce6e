# syntax=docker/dockerfile:1
# The pdcluster node image for vLLM nodes (cluster.engine.backend: vllm in the Helm chart):
# vLLM's own CUDA image (vLLM, its CUDA torch and kernels), plus Ray with its dashboard agent,
# the CUDA build of Mooncake's Transfer Engine (the `gpu` extra) and pdcluster, whose KV
# connector vLLM loads by module path (pdcluster.vllm_backend.connector).
#
#   docker build -f docker/node-vllm.Dockerfile -t REGISTRY/pdcluster/node-vllm:0.1.0 .
#
# Build from the repository root. vLLM's torch is kept: pdcluster's `torch>=2.4` accepts it, and
# no constraints file is used here (constraints.txt pins the CPU build of the laptop setup).
# Runs as root: registering GPU/host memory for RDMA needs CAP_IPC_LOCK in the effective set.

ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

ARG RAY_VERSION=2.60.0
ARG VLLM_VERSION=0.32.0

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

# RDMA user space for Mooncake (mlx5 and others), ibv_devinfo, and KubeRay's probe tools.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        ca-certificates bash wget \
        libibverbs1 ibverbs-providers ibverbs-utils librdmacm1 libnuma1 rdma-core \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/pdcluster
COPY . .
# The connector is built against this vLLM version: the install fails if another one came in.
RUN pip install ".[gpu]" "ray[default]==${RAY_VERSION}" "vllm==${VLLM_VERSION}" \
    && cd / && python -c "import vllm, ray, pdcluster.vllm_backend.connector, pdcluster.cluster.cli; \
assert vllm.__version__.startswith('${VLLM_VERSION}'), vllm.__version__" \
    && pdcluster --help >/dev/null

WORKDIR /home/ray
# vLLM's image starts its API server; pdcluster's pods are started by KubeRay with their own
# command, so the entry point is cleared.
ENTRYPOINT []
