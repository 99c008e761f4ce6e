# syntax=docker/dockerfile:1
# The pdcluster node image: CUDA, torch (CUDA build), Ray with its dashboard agent, and pdcluster
# with the CUDA build of Mooncake's Transfer Engine (the `gpu` extra). It runs the Ray head and
# the prefill/decode workers of the Helm chart (k8s/), and the launcher Job.
#
#   docker build -f docker/node.Dockerfile -t REGISTRY/pdcluster/node:0.1.0 .
#
# Build from the repository root. Nothing here needs a GPU at build time; the CUDA Mooncake
# build imports only where an NVIDIA driver is present (it is not imported during the build).
# Runs as root: registering GPU/host memory for RDMA needs CAP_IPC_LOCK in the effective set.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG RAY_VERSION=2.60.0

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

# libibverbs1 + ibverbs-providers + librdmacm1: RDMA user space for Mooncake (mlx5 and others);
# ibverbs-utils: ibv_devinfo, to check a pod's RDMA ports; wget and bash: KubeRay's probes.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv ca-certificates bash wget \
        libibverbs1 ibverbs-providers ibverbs-utils librdmacm1 libnuma1 rdma-core \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV"

# torch first and alone, as scripts/setup.sh does; on Linux the PyPI wheel is the CUDA build.
RUN pip install "torch==${TORCH_VERSION}"

WORKDIR /opt/pdcluster
COPY . .
# The package build generates the gRPC stubs from pdcluster/proto/*.proto (setup.py). The import check runs
# from / so that it sees the installed package, not the checkout's pdcluster/ folder.
RUN pip install -c constraints.txt ".[gpu]" "ray[default]==${RAY_VERSION}" \
    && cd / && python -c "import torch, ray, pdcluster.cluster.cli, pdcluster.metadata_service.client" \
    && pdcluster --help >/dev/null

WORKDIR /home/ray
