"""The chart's TLS and mTLS on the metadata service (metadata.tls, on by default with certificates
the chart generates: tests/k8s/test_generated_secrets.py): the service mounts its certificate
and key and serves TLS; the router and every Ray pod mount only the CA (and, under mTLS, the
client certificate) and are told where it is, the router by its flags, the node actors by
cluster.yaml; the rendered objects pass Kubernetes' and KubeRay's schemas; the flags and
cluster.yaml build valid configurations; inconsistent values are refused."""

from __future__ import annotations

import re

import pytest

from pdcluster.cluster import cli
from pdcluster.cluster.cli_services import metadata_tls_fields
from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.launch import router_config
from pdcluster.metadata_service.config import MetadataConfig
from pdcluster.router.config import RouterConfig
from tests.cluster_secret import SERVICE_TOKEN, TEST_SECRET
from tests.k8s.chart import (
    CHART,
    KUBE_VERSIONS,
    RELEASE,
    cluster_config,
    helm,
    kuberay_validator,
    needs_helm,
    one,
    pod_templates,
    render,
    template,
    validate_kubernetes,
    write_values,
)
from tests.k8s.test_cli_contract import command_of

pytestmark = needs_helm

SERVER_SECRET, ROUTER_SECRET, NODE_SECRET = "md-tls", "md-router", "md-node"
TLS = {"enabled": True, "secretName": SERVER_SECRET, "clientAuth": {"enabled": False}}
MTLS = {**TLS, "clientAuth": {"enabled": True, "routerSecretName": ROUTER_SECRET,
                              "nodeSecretName": NODE_SECRET}}
SETS = {
    "tls": {"metadata": {"tls": TLS}},
    "tls-server-name": {"metadata": {"tls": {**TLS, "serverName": "metadata.internal"}}},
    "mtls": {"metadata": {"tls": MTLS}},
    "mtls-memory": {"metadata": {"backend": "memory", "replicas": 1, "tls": MTLS},
                    "etcd": {"enabled": False}},
}
CA_DIR = "/var/run/secrets/pdcluster-metadata-ca"
CLIENT_DIR = "/var/run/secrets/pdcluster-metadata-client"
SERVER_DIR = "/var/run/secrets/pdcluster-metadata-tls"
CLIENT_CA_DIR = "/var/run/secrets/pdcluster-metadata-client-ca"
CLIENTS = {"router", "ray-head", "ray-prefill", "ray-decode"}


def pods(values: dict) -> dict[str, dict]:
    found = {}
    for doc in render(values):
        for _, tmpl in pod_templates(doc):
            found[tmpl["metadata"]["labels"]["app.kubernetes.io/component"]] = tmpl
    return found


def tls_volumes(spec: dict) -> dict[str, dict]:
    """The pod's metadata-TLS volumes by name: {secretName, items (keys), mode}."""
    return {v["name"]: {"secretName": v["secret"]["secretName"],
                        "items": [i["key"] for i in v["secret"]["items"]],
                        "mode": v["secret"]["defaultMode"]}
            for v in spec.get("volumes", []) if v["name"].startswith("metadata-")}


def tls_mounts(container: dict) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])
            if m["name"].startswith("metadata-") and m.get("readOnly")}


OFF = {"metadata": {"tls": {"enabled": False}}}


def test_off_when_disabled() -> None:
    found = pods(OFF)
    for component, tmpl in found.items():
        assert not tls_volumes(tmpl["spec"]), component
    args = " ".join(command_of(OFF, "metadata") + command_of(OFF, "router"))
    assert "--tls" not in args and "--metadata-tls" not in args
    # no certificate named; the token file is pod identity's (the chart's default)
    assert set(cluster_config(render(OFF))["metadata"]) == {"address", "node_identity_token_file"}


def test_mtls_by_default_with_the_charts_own_certificates() -> None:
    full = f"{RELEASE}-pdcluster"
    found = pods({})
    assert tls_volumes(found["metadata"]["spec"]) == {
        "metadata-tls": {"secretName": f"{full}-metadata-tls", "items": ["tls.crt", "tls.key"],
                         "mode": 0o400},
        "metadata-client-ca": {"secretName": f"{full}-metadata-router", "items": ["ca.crt"],
                               "mode": 0o400}}
    for component in CLIENTS:
        own = f"{full}-metadata-{'router' if component == 'router' else 'node'}"
        assert tls_volumes(found[component]["spec"])["metadata-client"]["secretName"] == own
    assert "--tls-bind-client-roles" in command_of({}, "metadata")


@pytest.mark.parametrize("name", sorted(SETS))
def test_tls_manifests_lint_and_pass_schemas(name: str, tmp_path) -> None:
    proc = helm("lint", "--strict", str(CHART), "-f", str(write_values(SETS[name], tmp_path)),
                check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    failures = []
    for doc in render(SETS[name]):
        if doc["apiVersion"] == "ray.io/v1":
            validator = kuberay_validator(doc["kind"])
            failures += [e.message for e in validator.iter_errors(doc)] if validator else []
        elif doc["apiVersion"] != "monitoring.coreos.com/v1":
            for version in KUBE_VERSIONS:
                validate_kubernetes(doc, version)
    assert not failures, failures


@pytest.mark.parametrize("name", sorted(SETS))
def test_service_gets_its_key_and_clients_only_the_ca(name: str) -> None:
    mtls = "mtls" in name
    found = pods(SETS[name])
    service = found["metadata"]
    expected = {"metadata-tls": {"secretName": SERVER_SECRET, "items": ["tls.crt", "tls.key"],
                                 "mode": 0o400}}
    if mtls:  # the service trusts the CA that signed the router's (and the nodes') certificate
        expected["metadata-client-ca"] = {"secretName": ROUTER_SECRET, "items": ["ca.crt"],
                                          "mode": 0o400}
    assert tls_volumes(service["spec"]) == expected
    (container,) = service["spec"]["containers"]
    assert tls_mounts(container) == {"metadata-tls": SERVER_DIR,
                                     **({"metadata-client-ca": CLIENT_CA_DIR} if mtls else {})}
    for component in CLIENTS:
        client_volumes = {"metadata-ca": {"secretName": SERVER_SECRET, "items": ["ca.crt"],
                                          "mode": 0o400}}
        if mtls:  # one client certificate per workload kind: the router's is not the nodes'
            own = ROUTER_SECRET if component == "router" else NODE_SECRET
            client_volumes["metadata-client"] = {"secretName": own,
                                                 "items": ["tls.crt", "tls.key"], "mode": 0o400}
        spec = found[component]["spec"]
        # never the service's private key outside the service's pod
        assert tls_volumes(spec) == client_volumes, component
        (container,) = spec["containers"]
        assert tls_mounts(container) == {"metadata-ca": CA_DIR,
                                         **({"metadata-client": CLIENT_DIR} if mtls else {})}
    for component in set(found) - CLIENTS - {"metadata"}:  # etcd, the launcher
        assert not tls_volumes(found[component]["spec"]), component


@pytest.mark.parametrize("name", sorted(SETS))
def test_flags_and_cluster_yaml_build_tls_configs(name: str) -> None:
    values, mtls = SETS[name], "mtls" in name
    server_name = values["metadata"]["tls"].get("serverName")
    expected = {"metadata_tls_ca": f"{CA_DIR}/ca.crt",
                "metadata_tls_cert": f"{CLIENT_DIR}/tls.crt" if mtls else None,
                "metadata_tls_key": f"{CLIENT_DIR}/tls.key" if mtls else None,
                "metadata_tls_server_name": server_name}
    parser = cli.build_parser()
    router_args = parser.parse_args(command_of(values, "router"))
    assert metadata_tls_fields(router_args) == expected
    RouterConfig(model_dir=router_args.model, metadata_address=router_args.metadata,
                 metadata_token=SERVICE_TOKEN, **metadata_tls_fields(router_args))
    service = parser.parse_args(command_of(values, "metadata"))
    assert (service.tls_cert, service.tls_key) == (f"{SERVER_DIR}/tls.crt",
                                                   f"{SERVER_DIR}/tls.key")
    assert service.tls_client_ca == (f"{CLIENT_CA_DIR}/ca.crt" if mtls else None)
    assert service.tls_bind_client_roles == mtls  # clientAuth.bindRoles: true by default
    MetadataConfig(tls_cert_file=service.tls_cert, tls_key_file=service.tls_key,
                   tls_client_ca_file=service.tls_client_ca, cluster_secret=TEST_SECRET,
                   tls_bind_client_roles=service.tls_bind_client_roles)
    launcher = ClusterConfig.from_dict(cluster_config(render(values)))
    assert launcher.metadata_tls_fields() == expected  # what every node actor is given
    assert router_config(launcher, launcher.metadata_address, TEST_SECRET).metadata_tls \
        is not None


@pytest.mark.parametrize("tls, match", [
    ({**TLS, "clientAuth": {"enabled": True, "routerSecretName": "x"}},
     "name both routerSecretName and nodeSecretName"),
    ({**TLS, "clientAuth": {"enabled": True, "routerSecretName": "x", "nodeSecretName": "x"}},
     "must not share one client certificate"),
    ({**TLS, "clientAuth": {"enabled": True, "secretName": "shared"}},
     "additional properties 'secretName' not allowed"),
    ({**TLS, "caFile": "x"}, "additional properties 'caFile' not allowed"),
    ({"enabled": "yes"}, "got string, want boolean|expected boolean"),
])
def test_inconsistent_tls_values_are_refused(tls: dict, match: str) -> None:
    proc = template({"metadata": {"tls": tls}}, check=False)
    assert proc.returncode != 0
    assert re.search(match, proc.stderr), proc.stderr


def test_router_flags_name_the_mounted_files() -> None:
    deploy = one(render(SETS["mtls"]), "Deployment", f"{RELEASE}-pdcluster-router")
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--metadata-tls")] == [
        f"--metadata-tls-ca={CA_DIR}/ca.crt", f"--metadata-tls-cert={CLIENT_DIR}/tls.crt",
        f"--metadata-tls-key={CLIENT_DIR}/tls.key"]
