"""The etcd backend through a real etcd with TLS, client-certificate auth and etcd's own auth
on: the metadata service works end to end as a user whose role covers only its prefix; a
client without a certificate is refused; that user cannot read or write outside the prefix
(with the member control: inside is served); a wrong password stops the service at start."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import etcd3aio
import grpc
import pytest

from pdcluster.benchmarks.ports import free_port
from pdcluster.core.credentials import write_secret_file
from pdcluster.core.tls import ClientTLS
from pdcluster.metadata_service.client import MetadataClient
from pdcluster.metadata_service.etcd_access import (
    EtcdAccessError,
    authenticate,
    grpc_target,
    make_client,
)
from pdcluster.metadata_service.server import ServerThread
from tests.cluster_secret import TEST_SECRET, node_token
from tests.metadata_service.etcd_tls import (
    PASSWORD,
    PREFIX,
    REPO_ROOT,
    USER,
    SecureEtcd,
    run_cli,
)
from tests.metadata_service.helpers import (
    make_chain,
    make_config,
    make_publisher,
    wait_until,
)
from tests.tls_certs import make_pki

CHAIN = make_chain("etcd-tls", 12)
REFUSED = (etcd3aio.EtcdError, grpc.RpcError, TimeoutError)


@pytest.fixture
def secure_etcd(tmp_path: Path) -> Iterator[SecureEtcd]:
    etcd = SecureEtcd(tmp_path / "etcd" / "data", make_pki(tmp_path / "pki"))
    etcd.start()
    try:
        etcd.setup()
        yield etcd
    finally:
        etcd.stop()


def service_config(etcd: SecureEtcd, **overrides):
    fields = dict(backend="etcd", etcd_endpoints=(etcd.endpoint,), etcd_prefix=PREFIX,
                  etcd_tls=etcd.client_tls, etcd_user=USER, etcd_password=PASSWORD)
    return make_config(**{**fields, **overrides})


def settled(client: MetadataClient) -> bool:
    stats = client.stats()
    return stats.healthy and stats.persistence_pending_nodes == 0


def test_the_service_works_through_tls_and_a_prefix_scoped_user(secure_etcd) -> None:
    with ServerThread(service_config(secure_etcd)) as server, \
            MetadataClient(server.address) as client:
        publisher, node = make_publisher(client, "p0", ttl=2)
        publisher.publish([node.store(CHAIN[:5])])
        wait_until(lambda: settled(client), what="persistence through TLS + auth")
        assert client.query(CHAIN) == [("p0", 5)]
        assert client.stats().etcd_writes > 0
        keys = secure_etcd.etcdctl("get", "--prefix", "--keys-only", PREFIX)
        assert f"{PREFIX}/nodes/p0" in keys, "written under the prefix, read back as root"
        # lease expiry reaches the service through the watch, which carries the user's token
        wait_until(lambda: not client.list_nodes(), timeout_s=10, what="etcd lease expiry")
        assert client.query(CHAIN) == [] and client.stats().num_blocks == 0


def test_the_service_logs_in_again_after_etcd_restarts(secure_etcd) -> None:
    # etcd's simple tokens live in its memory: a restart invalidates the one the store holds
    with ServerThread(service_config(secure_etcd)) as server, \
            MetadataClient(server.address) as client:
        publisher, node = make_publisher(client, "p0", ttl=30)
        publisher.publish([node.store(CHAIN[:3])])
        wait_until(lambda: settled(client), what="first write")
        secure_etcd.stop()
        secure_etcd.start()
        publisher.publish([node.store(CHAIN[3:6])])
        wait_until(lambda: settled(client), timeout_s=20, what="re-login and flush")
        assert "p0" in secure_etcd.etcdctl("get", "--prefix", "--keys-only", PREFIX)


@pytest.mark.parametrize("cert", ["none", "rogue"])
def test_a_client_without_a_trusted_certificate_is_refused(secure_etcd, cert) -> None:
    pki = secure_etcd.pki
    tls = (ClientTLS(pki.ca) if cert == "none"
           else ClientTLS(pki.ca, pki.rogue_cert, pki.rogue_key))

    async def attempt() -> None:
        client = make_client([secure_etcd.endpoint], tls, rpc_max_attempts=1)
        await client.connect()
        try:
            await authenticate(client, USER, PASSWORD, timeout_s=3)
        finally:
            await client.close()

    with pytest.raises(REFUSED):
        asyncio.run(attempt())
    with ServerThread(service_config(secure_etcd, etcd_tls=tls)) as server, \
            MetadataClient(server.address) as client:
        publisher, node = make_publisher(client, "p0", ttl=30)
        publisher.publish([node.store(CHAIN[:2])])
        time.sleep(1.0)  # several flush intervals
        stats = client.stats()
        assert not stats.healthy and stats.persistence_pending_nodes == 1
    assert secure_etcd.etcdctl("get", "--prefix", "--keys-only", PREFIX).strip() == ""


def test_the_pdcluster_user_cannot_leave_its_prefix(secure_etcd) -> None:
    secure_etcd.etcdctl("put", "/other/secret", "s3cret")  # as root: someone else's data
    secure_etcd.etcdctl("put", PREFIX + "-sibling/x", "y")

    async def as_pdcluster() -> dict[str, str]:
        client = make_client([secure_etcd.endpoint], secure_etcd.client_tls, rpc_max_attempts=1)
        await client.connect()
        outcome: dict[str, str] = {}
        try:
            await authenticate(client, USER, PASSWORD, timeout_s=5)
            assert client.kv is not None
            moves = {
                "put inside": client.kv.put(f"{PREFIX}/probe", b"1", timeout=5),
                "get inside": client.kv.get(f"{PREFIX}/probe", timeout=5),
                "get outside": client.kv.get("/other/secret", timeout=5),
                "put outside": client.kv.put("/other/evil", b"1", timeout=5),
                "put sibling": client.kv.put(PREFIX + "-sibling/x", b"2", timeout=5),
                "range all": client.kv.get("/", etcd3aio.prefix_range_end(b"/"), timeout=5),
                "delete outside": client.kv.delete("/other/secret", timeout=5),
            }
            for name, move in moves.items():
                try:
                    await move
                    outcome[name] = "served"
                except etcd3aio.EtcdPermissionDeniedError:
                    outcome[name] = "denied"
        finally:
            await client.close()
        return outcome

    assert asyncio.run(as_pdcluster()) == {
        "put inside": "served", "get inside": "served",  # the member control
        "get outside": "denied", "put outside": "denied", "put sibling": "denied",
        "range all": "denied", "delete outside": "denied"}
    assert "s3cret" in secure_etcd.etcdctl("get", "/other/secret")


def test_a_wrong_password_is_a_clear_error_at_start(secure_etcd, tmp_path) -> None:
    server = ServerThread(service_config(secure_etcd, etcd_password="not-the-password"))
    start = time.monotonic()
    try:
        with pytest.raises(EtcdAccessError, match=f"etcd refused user '{USER}'"):
            server.start()
    finally:
        server.stop()
    assert time.monotonic() - start < 30, "refused at once, not after retries"
    secret = write_secret_file(TEST_SECRET, tmp_path / "secret" / "cluster-secret")
    proc = run_cli("metadata", "serve", "--port", "0", "--backend", "etcd",
                   *secure_etcd.cli_args(), "--etcd-user", USER, "--etcd-password-file",
                   secure_etcd.secret_file("bad-pw", "wrong"),
                   env_extra={"PDCLUSTER_CLUSTER_SECRET_FILE": str(secret)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"etcd refused user '{USER}'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_etcd_setup_refuses_a_wrong_root_password(secure_etcd) -> None:
    proc = run_cli("metadata", "etcd-setup", *secure_etcd.cli_args(), "--etcd-user", USER,
                   "--etcd-password-file", secure_etcd.secret_file("pw2", PASSWORD),
                   "--root-password-file", secure_etcd.secret_file("bad-root", "nope"))
    assert proc.returncode == 2 and "etcd refused user 'root'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_etcd_setup_is_idempotent(secure_etcd) -> None:
    again = secure_etcd.setup()
    assert "auth already enabled" in again.stdout
    role = secure_etcd.etcdctl("role", "get", USER)
    assert f"[{PREFIX}/, {PREFIX}0)" in role, role
    assert secure_etcd.etcdctl("user", "get", USER).split("Roles:")[1].split() == [USER]


def test_etcd_access_settings_are_validated(tmp_path) -> None:
    with pytest.raises(ValueError, match="both etcd_user and etcd_password"):
        make_config(etcd_user=USER)
    with pytest.raises(ValueError, match="must not be empty"):
        make_config(etcd_user=USER, etcd_password="")
    assert PASSWORD not in repr(make_config(etcd_user=USER, etcd_password=PASSWORD))
    proc = run_cli("metadata", "serve", "--port", "0", "--backend", "etcd", "--etcd-user", USER,
                   env_extra={"PDCLUSTER_CLUSTER_SECRET": TEST_SECRET.to_text()})
    assert proc.returncode == 2 and "--etcd-password-file go together" in proc.stderr
    proc = run_cli("metadata", "serve", "--port", "0", "--backend", "etcd",
                   "--etcd-tls-cert", str(tmp_path / "c.crt"),
                   env_extra={"PDCLUSTER_CLUSTER_SECRET": TEST_SECRET.to_text()})
    assert proc.returncode == 2 and "need --etcd-tls-ca" in proc.stderr
    proc = run_cli("metadata", "serve", "--port", "0", "--backend", "etcd",
                   "--etcd-tls-ca", str(tmp_path / "missing-ca.crt"),
                   env_extra={"PDCLUSTER_CLUSTER_SECRET": TEST_SECRET.to_text()})
    assert proc.returncode == 2 and "cannot read TLS file" in proc.stderr, proc.stderr[-500:]
    assert "Traceback" not in proc.stderr


def test_metadata_serve_reaches_etcd_through_its_flags(secure_etcd) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDCLUSTER_CLUSTER_SECRET")}
    env["PDCLUSTER_CLUSTER_SECRET"] = TEST_SECRET.to_text()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdcluster.cluster.cli", "metadata", "serve", "--port", str(port),
         "--backend", "etcd", "--etcd-prefix", PREFIX, *secure_etcd.cli_args(),
         "--etcd-user", USER, "--etcd-password-file", secure_etcd.secret_file("pw", PASSWORD)],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert "listening on 127.0.0.1:" in proc.stdout.readline()
        with MetadataClient(f"127.0.0.1:{port}", token=node_token("p0")) as client:
            publisher, node = make_publisher(client, "p0", ttl=30)
            publisher.publish([node.store(CHAIN[:4])])
            wait_until(lambda: f"{PREFIX}/nodes/p0" in secure_etcd.etcdctl(
                "get", "--prefix", "--keys-only", PREFIX), what="the node record in etcd")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0


def test_a_dns_name_endpoint_reaches_etcd(secure_etcd) -> None:
    # the chart names etcd by its Service's DNS name; "localhost" is in the server certificate
    port = secure_etcd.client_port
    for endpoints in ((f"localhost:{port}",), (f"localhost:{port}", f"127.0.0.1:{port}")):
        config = service_config(secure_etcd, etcd_endpoints=endpoints)
        with ServerThread(config) as server, MetadataClient(server.address) as client:
            publisher, node = make_publisher(client, "p0", ttl=30)
            publisher.publish([node.store(CHAIN[:2])])
            wait_until(lambda: settled(client), what=f"persistence through {endpoints}")
            publisher.deregister()


def test_grpc_targets_for_addresses_and_names() -> None:
    assert grpc_target(["127.0.0.1:2379", "10.0.0.2:2379"]) == (
        "ipv4:127.0.0.1:2379,10.0.0.2:2379", None)
    assert grpc_target(["pd-etcd.serving.svc.cluster.local:2379"]) == (
        "dns:///pd-etcd.serving.svc.cluster.local:2379", "pd-etcd.serving.svc.cluster.local")
    assert grpc_target(["localhost:2379", "127.0.0.1:2379"]) == ("ipv4:127.0.0.1:2379",
                                                                 "localhost")
    assert grpc_target(["[::1]:2379"]) == ("ipv6:[::1]:2379", None)
    with pytest.raises(ValueError, match="host:port"):
        grpc_target(["etcd"])
    with pytest.raises(EtcdAccessError, match="cannot resolve"):
        grpc_target(["etcd-0.invalid:2379", "etcd-1.invalid:2379"])


def test_a_service_name_is_dialled_through_dns() -> None:
    # etcd3aio alone dials "ipv4:<name>:2379", which gRPC refuses as an invalid target
    # (UNKNOWN) for any DNS name: the chart's etcd Service name could never be reached
    async def dial() -> BaseException:
        client = make_client(["pd-etcd.serving.svc.invalid:2379"], None, rpc_max_attempts=1)
        assert client._manager.target == "dns:///pd-etcd.serving.svc.invalid:2379"
        await client.connect()
        try:
            assert client.kv is not None
            await client.kv.get("k", timeout=2)
        except BaseException as exc:  # noqa: BLE001 (the kind of failure is the point)
            return exc
        finally:
            await client.close()
        raise AssertionError("a name that does not resolve answered")

    failure = asyncio.run(dial())
    # unresolvable here: an unreachable etcd (the store retries), not an invalid target
    assert isinstance(failure, etcd3aio.EtcdConnectionError), repr(failure)
