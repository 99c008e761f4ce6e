"""One-command secure install: with only a model, images and API keys (docs/deploy.md's quick
start), the chart renders etcd with TLS and auth and the metadata service with mTLS, from what it
generates itself (templates/generated-secrets.yaml): one CA, the per-role certificates signed by
it, the etcd passwords. The certificates are checked as x509 and used for real: a real
`pdcluster metadata serve` serves with the generated server certificate and requires the
generated client certificates. An upgrade keeps everything (`lookup` of the live Secrets, played
here by a copy of the chart whose lookup reads the previous render), values that name their own
Secrets or cert-manager get nothing generated, and the router also listens on its pod's
loopback, so `kubectl port-forward` works."""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from pdcluster.benchmarks.ports import free_port
from pdcluster.core.credentials import SECRET_ENV, SECRET_FILE_ENV, write_secret_file
from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.metadata_service.errors import MetadataAuthError, MetadataUnavailable
from tests.cluster_secret import SERVICE_TOKEN, TEST_SECRET
from tests.k8s.chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    REPO_ROOT,
    cluster_config,
    find,
    helm,
    needs_helm,
    one,
    pod_templates,
    render,
    write_values,
)

pytestmark = needs_helm

FULL = f"{RELEASE}-pdcluster"
CA = f"{FULL}-generated-ca"
LEAVES = {f"{FULL}-metadata-tls": FULL + "-metadata", f"{FULL}-metadata-router": "pdcluster-router",
          f"{FULL}-metadata-node": "pdcluster-node",
          f"{FULL}-etcd-client": "pdcluster-metadata-etcd-client",
          f"{FULL}-etcd-server": FULL + "-etcd"}
SALT = f"{FULL}-router-salt"  # the routers' cache-salt key, shared by every replica
GENERATED = {CA, *LEAVES, f"{FULL}-etcd-auth", SALT}


def quick_start_values() -> dict:
    """The values file of docs/deploy.md's quick start, as the page shows it."""
    text = (REPO_ROOT / "docs" / "deploy.md").read_text()
    (block,) = re.findall(r"```yaml\n# my-values\.yaml\n(.*?)```", text, re.S)
    return yaml.safe_load(block)


def quick_start_docs(tmp_path: Path) -> list[dict]:
    """`helm install pd ./k8s -f my-values.yaml` as rendered, nothing added by the tests."""
    values = write_values(quick_start_values(), tmp_path)
    out = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(values))
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def secret_data(docs: list[dict], name: str) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in one(docs, "Secret", name)["data"].items()}


def certificate(docs: list[dict], name: str, key: str = "tls.crt") -> x509.Certificate:
    return x509.load_pem_x509_certificate(secret_data(docs, name)[key])


def test_the_quick_start_names_only_a_model_images_and_api_keys(tmp_path) -> None:
    values = quick_start_values()
    assert set(values) <= {"images", "model", "router"}, set(values)
    assert set(values["router"]) == {"apiKeys"}
    proc = helm("lint", "--strict", str(CHART), "-f", str(write_values(values, tmp_path)),
                check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_quick_start_installs_securely_from_generated_secrets(tmp_path) -> None:
    docs = quick_start_docs(tmp_path)
    assert {d["metadata"]["name"] for d in find(docs, "Secret")} == GENERATED | {f"{FULL}-secrets"}
    for name in GENERATED:
        assert one(docs, "Secret", name)["metadata"]["annotations"] == {
            "helm.sh/resource-policy": "keep"}
    etcd = one(docs, "StatefulSet", f"{FULL}-etcd")["spec"]["template"]["spec"]["containers"][0]
    assert "--client-cert-auth" in etcd["args"]
    assert one(docs, "Job", f"{FULL}-etcd-setup")  # the user confined to the prefix
    metadata = one(docs, "Deployment", f"{FULL}-metadata")
    args = metadata["spec"]["template"]["spec"]["containers"][0]["args"]
    assert {"--tls-bind-client-roles", "--etcd-user=pdcluster"} <= set(args)
    assert "tls_cert" in cluster_config(docs)["metadata"]  # every node actor presents its own
    passwords = secret_data(docs, f"{FULL}-etcd-auth")
    assert set(passwords) == {"password", "root-password"}
    assert passwords["password"] != passwords["root-password"]
    assert all(len(p) >= 32 for p in passwords.values())


def test_one_ca_signs_every_role_its_own_certificate(tmp_path) -> None:
    docs = quick_start_docs(tmp_path)
    ca = certificate(docs, CA)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for name, common_name in LEAVES.items():
        leaf = certificate(docs, name)
        leaf.verify_directly_issued_by(ca)
        assert certificate(docs, name, "ca.crt") == ca, name
        assert leaf.subject.rfc4514_string() == f"CN={common_name}"
    metadata_host = cluster_config(docs)["metadata"]["address"].rsplit(":", 1)[0]
    assert metadata_host in sans(certificate(docs, f"{FULL}-metadata-tls"))
    etcd_host = f"{FULL}-etcd.{NAMESPACE}.svc.cluster.local"
    assert {etcd_host, "127.0.0.1"} <= sans(certificate(docs, f"{FULL}-etcd-server"))


def sans(cert: x509.Certificate) -> set[str]:
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(n.value) for n in names}


@pytest.fixture
def generated_mtls_service(tmp_path):
    """A real metadata service serving the chart's generated certificate and requiring client
    certificates from the chart's CA, with role binding, as the chart runs it."""
    docs = quick_start_docs(tmp_path)
    files = {}
    for name in (f"{FULL}-metadata-tls", f"{FULL}-metadata-router", f"{FULL}-metadata-node"):
        for key, data in secret_data(docs, name).items():
            path = tmp_path / f"{name}-{key}"
            path.write_bytes(data)
            files[(name, key)] = str(path)
    port = free_port()
    secret_file = write_secret_file(TEST_SECRET, tmp_path / "cluster-secret")
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdcluster.cluster.cli", "metadata", "serve", "--port", str(port),
         "--tls-cert", files[(f"{FULL}-metadata-tls", "tls.crt")],
         "--tls-key", files[(f"{FULL}-metadata-tls", "tls.key")],
         "--tls-client-ca", files[(f"{FULL}-metadata-router", "ca.crt")],
         "--tls-bind-client-roles"],
        cwd=REPO_ROOT, env={**env, SECRET_FILE_ENV: str(secret_file)},
        stdout=subprocess.PIPE, text=True)
    try:
        assert "listening on 127.0.0.1:" in proc.stdout.readline()
        server_name = cluster_config(docs)["metadata"]["address"].rsplit(":", 1)[0]
        yield f"127.0.0.1:{port}", files, server_name
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


def test_the_generated_certificates_work_with_a_real_metadata_service(
        generated_mtls_service) -> None:
    address, files, server_name = generated_mtls_service

    def client(kind: str | None, **extra) -> MetadataClient:
        cert = {} if kind is None else {
            "tls_cert_file": files[(f"{FULL}-metadata-{kind}", "tls.crt")],
            "tls_key_file": files[(f"{FULL}-metadata-{kind}", "tls.key")]}
        return MetadataClient(address, token=SERVICE_TOKEN, timeout_s=5,
                              tls_ca_file=files[(f"{FULL}-metadata-tls", "ca.crt")],
                              tls_server_name=server_name, **cert, **extra)

    with client("router") as router:  # the router's certificate and its token
        router.ping()
        assert router.list_nodes() == []
        with pytest.raises(MetadataAuthError, match="PERMISSION_DENIED"):
            router.register(make_node_info("d0", "decode"), 5)
    with client("node") as node, pytest.raises(MetadataAuthError):
        node.ping()  # the router's token over a node's certificate: roles are bound
    with client(None) as stranger, pytest.raises(MetadataUnavailable):
        stranger.ping()  # no client certificate: refused at the handshake


# ---- upgrades: what lookup reads back is kept --------------------------------------------

LOOKUP = re.compile(r'\(lookup "v1" "Secret" (\S+) (\$\w+|\.secret)\)')


def chart_with_lookup_from_values(tmp_path: Path) -> Path:
    """A copy of the chart whose `lookup` of a Secret reads `.Values.liveSecrets.<name>` (a
    previous render's Secrets) instead of the API server, which `helm template` cannot ask."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "values.schema.json").unlink()  # liveSecrets is not a value of the real chart
    for template in ("generated-secrets.yaml", "secret.yaml"):
        path = chart / "templates" / template
        text, count = LOOKUP.subn(r'(get $.Values.liveSecrets \2 | default dict)', path.read_text())
        assert count, template
        path.write_text(text)
    return chart


def render_chart(chart: Path, values: dict, folder: Path) -> list[dict]:
    folder.mkdir()
    out = helm("template", RELEASE, str(chart), "--namespace", NAMESPACE,
               "-f", str(write_values(values, folder))).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_an_upgrade_keeps_what_was_generated(tmp_path) -> None:
    chart = chart_with_lookup_from_values(tmp_path)
    values = quick_start_values()
    first = render_chart(chart, {**values, "liveSecrets": {}}, tmp_path / "install")
    live = {d["metadata"]["name"]: d for d in find(first, "Secret")}
    upgraded = render_chart(chart, {**values, "liveSecrets": live}, tmp_path / "upgrade")
    for name in GENERATED | {f"{FULL}-secrets"}:
        assert one(upgraded, "Secret", name)["data"] == live[name]["data"], name
    # a certificate missing from the cluster is made again, by the same CA
    del live[f"{FULL}-metadata-node"]
    again = render_chart(chart, {**values, "liveSecrets": live}, tmp_path / "reissue")
    node = certificate(again, f"{FULL}-metadata-node")
    assert node != certificate(first, f"{FULL}-metadata-node")
    node.verify_directly_issued_by(certificate(first, CA))


# ---- what is given is used, nothing generated for it --------------------------------------

@pytest.mark.parametrize("values, generated", [
    ({"etcd": {"tls": {"secretName": "ec", "serverSecretName": "es"},
               "auth": {"passwordSecret": {"name": "pw"}, "rootPasswordSecret": {"name": "rp"}}},
      "metadata": {"tls": {"secretName": "mt", "clientAuth": {
          "routerSecretName": "mr", "nodeSecretName": "mn"}}},
      "router": {"cacheSaltKeySecret": {"name": "rs"}}}, set()),
    ({"metadata": {"tls": {"secretName": "mt"}}},
     {CA, f"{FULL}-metadata-router", f"{FULL}-metadata-node", f"{FULL}-etcd-client",
      f"{FULL}-etcd-server", f"{FULL}-etcd-auth", SALT}),
    ({"certManager": {"enabled": True}}, {f"{FULL}-etcd-auth", SALT}),
    ({"metadata": {"backend": "memory", "replicas": 1}, "etcd": {"enabled": False}},
     {CA, f"{FULL}-metadata-tls", f"{FULL}-metadata-router", f"{FULL}-metadata-node", SALT}),
], ids=["all-given", "server-certificate-given", "cert-manager", "memory-backend"])
def test_only_what_is_not_given_is_generated(values: dict, generated: set[str]) -> None:
    docs = render(values)
    assert {d["metadata"]["name"] for d in find(docs, "Secret")} - {f"{FULL}-secrets"} == \
        generated
    mounted = {v["secret"]["secretName"] for doc in docs for _, tmpl in pod_templates(doc)
               for v in tmpl["spec"].get("volumes", []) if "secret" in v}
    given = {"ec", "es", "pw", "rp", "mt", "mr", "mn", "rs"}
    issued = {d["spec"]["secretName"] for d in find(docs, "Certificate")}  # by cert-manager
    unaccounted = mounted - given - generated - issued - {f"{FULL}-secrets"}
    assert not unaccounted, "every mounted Secret is given, generated or cert-manager's"
