"""The chart's etcd access (etcd.tls, etcd.auth: both on by default, with what the chart
generates: tests/k8s/test_generated_secrets.py) and per-workload-kind certificates from
cert-manager (certManager): etcd without TLS is refused unless acknowledged; with TLS the bundled
etcd serves https with client-certificate auth and only the metadata service holds the client
certificate; with auth the service logs in from a password file and only the setup hook Job
holds etcd's root password; cert-manager issues one client certificate per workload kind whose
common name the service maps to that kind's role; inconsistent values are refused."""

from __future__ import annotations

import re

import pytest

from pdcluster.cluster import cli
from pdcluster.cluster.cli_metadata_ops import etcd_access_fields
from pdcluster.metadata_service.cert_roles import certificate_role
from tests.k8s.chart import RELEASE, find, needs_helm, one, pod_templates, render, template
from tests.k8s.test_cli_contract import command_of

pytestmark = needs_helm

FULL = f"{RELEASE}-pdcluster"
ETCD_TLS = {"enabled": True, "secretName": "etcd-client", "serverSecretName": "etcd-server"}
AUTH = {"enabled": True, "passwordSecret": {"name": "etcd-pw", "key": "password"},
        "rootPasswordSecret": {"name": "etcd-root", "key": "root-password"}}
SECURE = {"etcd": {"tls": ETCD_TLS, "auth": AUTH}}
CERT_MANAGER = {"certManager": {"enabled": True}, "etcd": {"tls": {"enabled": True}},
                "metadata": {"tls": {"enabled": True, "clientAuth": {"enabled": True}}}}


def secret_volumes(values: dict) -> dict[str, set[str]]:
    """component -> the Secrets its pods mount."""
    found: dict[str, set[str]] = {}
    for doc in render(values):
        for _, tmpl in pod_templates(doc):
            component = tmpl["metadata"]["labels"]["app.kubernetes.io/component"]
            found.setdefault(component, set()).update(
                v["secret"]["secretName"] for v in tmpl["spec"].get("volumes", [])
                if "secret" in v)
    return found


@pytest.mark.parametrize("values, match", [
    ({"etcd": {"tls": {"enabled": False}}}, "etcd.tls.enabled is false: the metadata service "
     "would speak plain http://"),
    ({"etcd": {"enabled": False, "externalEndpoints": ["etcd.infra:2379"],
               "auth": AUTH}},
     "etcd.tls.enabled with an external etcd needs etcd.tls.secretName"),
    ({"etcd": {"tls": {"enabled": True, "secretName": "c"}}},
     "name both secretName and serverSecretName"),
    ({"etcd": {"tls": {"enabled": True, "serverSecretName": "s"}}},
     "name both secretName and serverSecretName"),
    ({"etcd": {"enabled": False, "externalEndpoints": ["etcd.infra:2379"],
               "tls": {"secretName": "c"}}},
     "etcd.auth.enabled with an external etcd needs etcd.auth.passwordSecret.name"),
], ids=["plaintext", "external-tls-without-client-secret", "bundled-client-secret-only",
        "bundled-server-secret-only", "external-auth-without-password"])
def test_inconsistent_or_unfenced_etcd_values_are_refused(values, match) -> None:
    proc = template(values, check=False)
    assert proc.returncode != 0 and match in proc.stderr, proc.stderr[-800:]


@pytest.mark.parametrize("values", [
    {"etcd": {"tls": {"enabled": False}, "acknowledgePlaintext": True}},
    {"metadata": {"backend": "memory", "replicas": 1}, "etcd": {"enabled": False,
                                                                 "tls": {"enabled": False}}},
    SECURE,
    {"etcd": {"enabled": False, "externalEndpoints": ["etcd.infra:2379"],
              "tls": {"enabled": True, "secretName": "c"}, "auth": AUTH}},
    {},
], ids=["acknowledged", "memory-backend", "tls-and-auth", "external-tls", "generated"])
def test_acknowledged_or_secured_etcd_renders(values) -> None:
    assert template(values).returncode == 0


def test_the_bundled_etcd_serves_tls_and_only_the_service_holds_the_client_cert() -> None:
    etcd = one(render(SECURE), "StatefulSet", f"{FULL}-etcd")
    (container,) = etcd["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert "--listen-client-urls=https://$(POD_IP):2379,https://127.0.0.1:2379" in args
    assert "--client-cert-auth" in args
    assert any(a.startswith("--trusted-ca-file=") for a in args)
    mounts = secret_volumes(SECURE)
    assert mounts["etcd"] == {"etcd-server"}
    holders = {c for c, secrets in mounts.items() if "etcd-client" in secrets}
    assert holders == {"metadata", "etcd-setup"}
    assert {c for c, secrets in mounts.items() if "etcd-root" in secrets} == {"etcd-setup"}
    assert {c for c, secrets in mounts.items() if "etcd-pw" in secrets} == \
        {"metadata", "etcd-setup"}


def test_the_service_flags_build_its_etcd_access(tmp_path) -> None:
    args = cli.build_parser().parse_args(command_of(SECURE, "metadata"))
    assert args.etcd_user == "pdcluster"
    assert args.etcd_tls_server_name == f"{FULL}-etcd.serving.svc.cluster.local"
    # the mounted files stand in here: what the CLI makes of them is a valid access config
    password = tmp_path / "password"
    password.write_text("pw\n")
    args.etcd_password_file = str(password)
    fields = etcd_access_fields(args)
    assert fields["etcd_password"] == "pw"
    assert fields["etcd_tls"].cert_file.endswith("/tls.crt")


def test_the_setup_job_is_a_hook_with_the_setup_command() -> None:
    job = one(render(SECURE), "Job", f"{FULL}-etcd-setup")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    (container,) = job["spec"]["template"]["spec"]["containers"]
    args = cli.build_parser().parse_args(container["args"])
    assert (args.metadata_command, args.etcd_user) == ("etcd-setup", "pdcluster")
    assert args.etcd_prefix == "/pdcluster/metadata" and args.etcd_tls_ca
    policy = one(render(SECURE), "NetworkPolicy", f"{FULL}-etcd")
    peers = [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
             for p in policy["spec"]["ingress"][0]["from"]]
    assert peers == ["metadata", "etcd-setup"]
    external = {"etcd": {"enabled": False, "externalEndpoints": ["etcd.infra:2379"],
                         "tls": {"enabled": True, "secretName": "c"}, "auth": AUTH}}
    assert not find(render(external), "Job")  # an external etcd's operator runs the command


def test_cert_manager_issues_one_client_certificate_per_workload_kind() -> None:
    docs = render(CERT_MANAGER)
    certs = {d["spec"]["secretName"]: d for d in find(docs, "Certificate")}
    router, node = certs[f"{FULL}-metadata-router"], certs[f"{FULL}-metadata-node"]
    assert certificate_role(router["spec"]["commonName"]) == "router"
    assert certificate_role(node["spec"]["commonName"]) == "node"
    assert {f"{FULL}-metadata-tls", f"{FULL}-etcd-client", f"{FULL}-etcd-server",
            f"{FULL}-ca"} <= set(certs)
    issuers = {d["metadata"]["name"] for d in find(docs, "Issuer")}
    assert issuers == {f"{FULL}-selfsigned", f"{FULL}-ca"}
    mounts = secret_volumes(CERT_MANAGER)
    assert f"{FULL}-metadata-router" in mounts["router"]
    for ray in ("ray-head", "ray-prefill", "ray-decode"):
        assert f"{FULL}-metadata-node" in mounts[ray]
        assert f"{FULL}-metadata-router" not in mounts[ray], ray
    assert f"{FULL}-metadata-node" not in mounts["router"]
    mounted = set().union(*mounts.values())
    keys = {f"{FULL}-secrets", f"{FULL}-etcd-auth", f"{FULL}-router-salt"}  # not certificates
    issued = {s for s in mounted if s.startswith(FULL)} - keys
    assert issued <= set(certs), "every certificate a pod mounts is one cert-manager issues"
    # and the chart generates no certificate: only the etcd passwords and the routers' salt
    # key the values do not name
    assert {d["metadata"]["name"] for d in find(docs, "Secret")} == keys


def test_cert_manager_with_an_existing_issuer() -> None:
    values = {**CERT_MANAGER, "certManager": {"enabled": True, "issuerRef": {
        "name": "corp-ca", "kind": "ClusterIssuer"}}}
    docs = render(values)
    assert not find(docs, "Issuer")
    refs = {(d["spec"]["issuerRef"]["name"], d["spec"]["issuerRef"]["kind"])
            for d in find(docs, "Certificate")}
    assert refs == {("corp-ca", "ClusterIssuer")}


def test_notes_say_how_to_set_up_an_external_etcd_and_warn_of_plaintext(tmp_path) -> None:
    from tests.k8s.test_chart_wiring import render_notes

    external = {"etcd": {"enabled": False, "externalEndpoints": ["etcd.infra:2379"],
                         "tls": {"enabled": True, "secretName": "c"}, "auth": AUTH}}
    notes = render_notes(external, tmp_path / "external")
    assert "pdcluster metadata etcd-setup --etcd etcd.infra:2379" in notes
    assert "WARNING" not in notes
    plain = {"etcd": {"tls": {"enabled": False}, "acknowledgePlaintext": True}}
    assert "WARNING: etcd.acknowledgePlaintext is set" in render_notes(plain, tmp_path / "plain")
    assert f"job {FULL}-etcd-setup" in render_notes(SECURE, tmp_path / "bundled")


def csi_volumes(values: dict) -> dict[str, dict]:
    """component -> its metadata-client csi volume's attributes."""
    found = {}
    for doc in render(values):
        for _, tmpl in pod_templates(doc):
            component = tmpl["metadata"]["labels"]["app.kubernetes.io/component"]
            for volume in tmpl["spec"].get("volumes", []):
                if "csi" in volume:
                    assert volume["name"] == "metadata-client", component
                    assert volume["csi"]["driver"] == "csi.cert-manager.io"
                    found[component] = volume["csi"]["volumeAttributes"]
    return found


def test_the_csi_driver_gives_every_pod_its_own_certificate_naming_its_role() -> None:
    values = {**CERT_MANAGER, "certManager": {"enabled": True, "csiDriver": True}}
    volumes = csi_volumes(values)
    assert set(volumes) == {"router", "ray-head", "ray-prefill", "ray-decode"}
    for component, attributes in volumes.items():
        name = attributes["csi.cert-manager.io/common-name"]
        kind = "router" if component == "router" else "node"
        assert name == f"pdcluster-{kind}.${{POD_NAME}}"
        # the name the csi-driver issues (it substitutes the pod's name) maps to the role
        assert certificate_role(name.replace("${POD_NAME}", f"{FULL}-{component}-7f9c")) == kind
        assert attributes["csi.cert-manager.io/issuer-name"] == f"{FULL}-ca"
        assert "client auth" in attributes["csi.cert-manager.io/key-usages"]
    docs = render(values)
    issued = {d["spec"]["secretName"] for d in find(docs, "Certificate")}
    assert not {f"{FULL}-metadata-router", f"{FULL}-metadata-node"} & issued  # per pod now
    service = one(docs, "Deployment", f"{FULL}-metadata")
    client_ca = [v for v in service["spec"]["template"]["spec"]["volumes"]
                 if v["name"] == "metadata-client-ca"]
    assert client_ca[0]["secret"]["secretName"] == f"{FULL}-ca"  # the CA the driver uses


@pytest.mark.parametrize("values, match", [
    ({"certManager": {"enabled": False, "csiDriver": True}}, "certManager.csiDriver .per-pod"),
    ({**CERT_MANAGER, "certManager": {"enabled": True, "csiDriver": True,
                                      "issuerRef": {"name": "corp", "kind": "ClusterIssuer"}}},
     "needs the release's own CA"),
])
def test_the_csi_driver_needs_cert_manager_mtls_and_the_release_ca(values, match) -> None:
    proc = template(values, check=False)
    assert proc.returncode != 0
    assert re.search(match, proc.stderr), proc.stderr[-800:]
