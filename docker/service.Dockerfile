# syntax=docker/dockerfile:1
# The pdcluster service image: slim, CPU only, no torch, no Ray. It runs the router
# (`pdcluster router serve`), the metadata service (`pdcluster metadata serve`) and the chart's
# model-download init container (huggingface_hub).
#
#   docker build -f docker/service.Dockerfile -t REGISTRY/pdcluster/service:0.1.0 .
#
# Build from the repository root. The router and the metadata service import neither torch
# nor ray (tests/test_import_rules.py), so the image installs every dependency in pyproject.toml
# except torch, then pdcluster itself without dependencies; the last step fails the build if
# torch slipped in.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

WORKDIR /opt/pdcluster
COPY pyproject.toml ./
RUN python - > /tmp/requirements.txt <<'PY'
import re
import tomllib

deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower() != "torch"))
print("huggingface_hub")
PY
RUN pip install -r /tmp/requirements.txt

COPY . .
# The package build generates the gRPC stubs (setup.py); checks run from / (the installed package).
RUN pip install --no-deps . \
    && cd / \
    && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)" \
    && python -c "import pdcluster.cluster.cli, pdcluster.metadata_service.server, pdcluster.router" \
    && pdcluster metadata serve --help >/dev/null \
    && rm -rf /opt/pdcluster

WORKDIR /home/pdcluster
USER 10001:10001
ENTRYPOINT ["pdcluster"]
