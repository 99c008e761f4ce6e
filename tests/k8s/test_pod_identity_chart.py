"""The chart with metadata.podIdentity: no Ray pod — the head included — mounts the cluster
secret; every Ray pod runs as the release's Ray service account and carries a projected token
for the metadata service's audience, which cluster.yaml tells the node actors to trade; the
metadata service checks exactly that audience and account, with the right to create
TokenReviews and nothing more; and the launcher, reading the rendered cluster.yaml, needs no
secret. Off (the default), the head keeps the secret and nothing of this renders."""

from __future__ import annotations

import pytest

from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.launch import needs_cluster_secret
from tests.k8s.chart import (
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    cluster_config,
    env_of,
    find,
    needs_helm,
    one,
    pod_templates,
    render,
)

pytestmark = needs_helm

RAY_SA = f"{RELEASE}-pdcluster-ray"
METADATA_SA = f"{RELEASE}-pdcluster-metadata"
AUDIENCE = f"pdcluster.{NAMESPACE}.{RELEASE}-pdcluster"
TOKEN_DIR = "/var/run/secrets/pdcluster-node-identity"
# the planner's variant stays out of VALUE_SETS (other chart tests assume no planner there)
MODES = {"pod-identity": VALUE_SETS["pod-identity"],
         "pod-identity-planner": {**VALUE_SETS["pod-identity"], "planner": {"enabled": True},
                                  "router": {"replicas": 1, "hpa": {"enabled": False}}}}


def _ray_pods(docs: list[dict]) -> dict[str, dict]:
    pods = {}
    for doc in find(docs, "RayCluster"):
        for _, tmpl in pod_templates(doc):
            pods[tmpl["metadata"]["labels"]["app.kubernetes.io/component"]] = tmpl
    assert set(pods) == {"ray-head", "ray-prefill", "ray-decode"}, sorted(pods)
    return pods


def _secret_volumes(spec: dict) -> list[dict]:
    return [v for v in spec.get("volumes", []) if "secret" in v and any(
        i["key"] in ("cluster-secret", "router-token") for i in v["secret"].get("items", []))]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_no_ray_pod_holds_the_secret_and_each_carries_its_projected_token(mode) -> None:
    docs = render(MODES[mode])
    for component, tmpl in _ray_pods(docs).items():
        spec = tmpl["spec"]
        assert _secret_volumes(spec) == [], component
        for container in spec["containers"] + spec.get("initContainers", []):
            assert not {"PDCLUSTER_CLUSTER_SECRET_FILE", "PDCLUSTER_CLUSTER_SECRET"} & set(
                env_of(container)), (component, container["name"])
        assert spec["serviceAccountName"] == RAY_SA
        # the API token only where KubeRay's autoscaler sidecar needs it (head, planner on)
        assert spec["automountServiceAccountToken"] is (
            component == "ray-head" and mode == "pod-identity-planner"), component
        (volume,) = [v for v in spec["volumes"] if v["name"] == "node-identity"]
        assert volume["projected"]["sources"] == [{"serviceAccountToken": {
            "audience": AUDIENCE, "expirationSeconds": 600, "path": "token"}}]
        ray = spec["containers"][0]
        assert {"name": "node-identity", "mountPath": TOKEN_DIR, "readOnly": True} in \
            ray["volumeMounts"], component


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_launcher_reads_the_token_file_and_needs_no_secret(mode) -> None:
    data = cluster_config(render(MODES[mode]))
    assert data["metadata"]["node_identity_token_file"] == f"{TOKEN_DIR}/token"
    config = ClusterConfig.from_dict(data)  # the product's own parse of the rendered file
    assert config.node_identity_token_file == f"{TOKEN_DIR}/token"
    assert not needs_cluster_secret(config)
    off = cluster_config(render(VALUE_SETS["secret-on-head"]))
    assert needs_cluster_secret(ClusterConfig.from_dict(off))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_metadata_service_checks_that_audience_and_account(mode) -> None:
    docs = render(MODES[mode])
    deployment = one(docs, "Deployment", f"{RELEASE}-pdcluster-metadata")
    spec = deployment["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == METADATA_SA
    assert spec["automountServiceAccountToken"] is True  # its own token: creates TokenReviews
    args = spec["containers"][0]["args"]
    assert f"--pod-identity-audience={AUDIENCE}" in args
    assert f"--pod-identity-service-account={NAMESPACE}:{RAY_SA}" in args
    assert "--pod-identity-token-ttl=600" in args
    # what bounds the ids it issues: the allowlist, or with the planner the count per role
    bound = "--max-nodes=" if mode == "pod-identity-planner" else "--allow-nodes="
    assert sum(a.startswith(bound) for a in args) == 2
    # the same args parse in the product's own CLI
    from pdcluster.cluster.cli import build_parser
    from pdcluster.cluster.cli_pod_identity import pod_identity_config

    parsed = build_parser().parse_args(
        [a for a in args[1:] if "$(" not in a] + ["--kubernetes-api", "https://10.0.0.1:443"])
    identity = pod_identity_config(parsed)
    assert (identity.audience, identity.username) == (
        AUDIENCE, f"system:serviceaccount:{NAMESPACE}:{RAY_SA}")


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_metadata_service_may_create_token_reviews_and_nothing_else(mode) -> None:
    docs = render(MODES[mode])
    (role,) = find(docs, "ClusterRole")
    assert role["rules"] == [{"apiGroups": ["authentication.k8s.io"],
                              "resources": ["tokenreviews"], "verbs": ["create"]}]
    (binding,) = find(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                  "kind": "ClusterRole", "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": METADATA_SA,
                                    "namespace": NAMESPACE}]
    accounts = {d["metadata"]["name"]: d for d in find(docs, "ServiceAccount")}
    assert {RAY_SA, METADATA_SA} <= set(accounts)
    assert accounts[RAY_SA]["automountServiceAccountToken"] is False


def test_on_by_default_no_ray_pod_holds_the_secret() -> None:
    pods = _ray_pods(render({}))
    for component, tmpl in pods.items():
        assert not _secret_volumes(tmpl["spec"]), component
        assert any(v["name"] == "node-identity" for v in tmpl["spec"]["volumes"]), component


def test_turned_off_the_head_keeps_the_secret_and_nothing_renders() -> None:
    docs = render(VALUE_SETS["secret-on-head"])
    pods = _ray_pods(docs)
    assert [v["name"] for v in _secret_volumes(pods["ray-head"]["spec"])] == ["cluster-secret"]
    for component, tmpl in pods.items():
        assert "serviceAccountName" not in tmpl["spec"], component
        assert all(v["name"] != "node-identity" for v in tmpl["spec"]["volumes"])
    assert not find(docs, "ClusterRole") and not find(docs, "ClusterRoleBinding")
    assert "node_identity_token_file" not in cluster_config(docs)["metadata"]
