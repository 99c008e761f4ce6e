"""The cluster secret's plumbing at the edges (no Ray): where each entry point reads it, that
the ones that join a running cluster refuse to start without it, and that `pdcluster serve`
keeps a generated one in a 0600 file whose path, never the secret, it prints."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster.cluster import launch
from pdcluster.cluster.cli_services import _serve_secret
from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.launch import router_config
from pdcluster.cluster.ray_cluster import RayCluster
from pdcluster.core.credentials import (
    ROUTER_TOKEN_ENV,
    ROUTER_TOKEN_FILE_ENV,
    SECRET_ENV,
    SECRET_FILE_ENV,
    SERVICE,
    ClusterSecret,
    write_secret_file,
)
from pdcluster.node.actor import NodeActor
from pdcluster.node.runtime import NodeRuntime
from pdcluster.router.config import RouterConfig
from tests.cluster_secret import TEST_SECRET, node_token

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_secret_env(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)


def _env_without_secret(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    return {**env, **extra}


def test_router_serve_refuses_to_start_without_its_client_credential(tmp_path) -> None:
    """The router takes a client credential, never the cluster secret: the secret alone in
    its environment is not enough."""
    (tmp_path / "config.json").write_text("{}")
    env = _env_without_secret(**{SECRET_ENV: TEST_SECRET.to_text()})
    env.pop(ROUTER_TOKEN_ENV, None)
    env.pop(ROUTER_TOKEN_FILE_ENV, None)
    proc = subprocess.run(
        [sys.executable, "-m", "pdcluster.cluster.cli", "router", "serve", "--model", str(tmp_path),
         "--metadata", "127.0.0.1:1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "pdcluster router serve needs the router's client credential" in proc.stderr
    assert ROUTER_TOKEN_FILE_ENV in proc.stderr and ROUTER_TOKEN_ENV in proc.stderr


def test_router_serve_with_api_keys_refuses_to_start_without_the_cache_salt_key(
        tmp_path) -> None:
    """Tenants' salts are keyed with a key every router replica shares (router.tenants): a
    router with API keys and no key would salt alone, sharing no prefix with its replicas."""
    from pdcluster.router.tenants import SALT_KEY_ENV, SALT_KEY_FILE_ENV

    (tmp_path / "config.json").write_text("{}")
    env = _env_without_secret(**{ROUTER_TOKEN_ENV: "service:x",
                                 "PDCLUSTER_API_KEYS": "team-a:sk-0123456789abcdef"})
    env.pop(SALT_KEY_ENV, None)
    env.pop(SALT_KEY_FILE_ENV, None)
    proc = subprocess.run(
        [sys.executable, "-m", "pdcluster.cluster.cli", "router", "serve", "--model", str(tmp_path),
         "--metadata", "127.0.0.1:1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "needs the cache-salt key" in proc.stderr and SALT_KEY_FILE_ENV in proc.stderr


def test_the_router_token_printed_for_the_router_is_the_service_credential(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdcluster.cluster.cli", "metadata", "router-token"],
        cwd=ROOT, env=_env_without_secret(**{SECRET_ENV: TEST_SECRET.to_text()}),
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == TEST_SECRET.metadata_token(SERVICE)


def test_a_malformed_secret_is_a_usage_error(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdcluster.cluster.cli", "metadata", "serve", "--port", "0"],
        cwd=ROOT, env=_env_without_secret(**{SECRET_ENV: "not hex"}), capture_output=True,
        text=True, timeout=60)
    assert proc.returncode == 2 and "must be hex" in proc.stderr


def test_launcher_needs_the_secret_unless_everything_is_embedded(tmp_path, no_secret_env,
                                                                 capsys) -> None:
    external = tmp_path / "external.yaml"
    external.write_text("model: /m\nmetadata: {address: 'meta:50061'}\n")
    router_elsewhere = tmp_path / "router.yaml"
    router_elsewhere.write_text("model: /m\nrouter: {enabled: false}\n")
    for path in (external, router_elsewhere):
        assert launch.main(["--config", str(path)]) == 2
        assert f"set ${SECRET_FILE_ENV}" in capsys.readouterr().err


def test_launcher_reads_the_secret_file(tmp_path, monkeypatch) -> None:
    path = write_secret_file(TEST_SECRET, tmp_path / "secret")
    config = tmp_path / "cluster.yaml"
    config.write_text("model: /m\nmetadata: {address: 'meta:50061'}\n")
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    seen = {}
    monkeypatch.setattr(launch, "serve", lambda config, **kw: seen.update(kw) or 0)
    assert launch.main(["--config", str(config)]) == 0
    assert seen["cluster_secret"] == TEST_SECRET


def test_serve_writes_a_generated_secret_to_a_private_file(tmp_path, no_secret_env,
                                                           monkeypatch, capsys) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    secret = _serve_secret()
    out = capsys.readouterr().out
    (path,) = (tmp_path / "pdcluster").iterdir()
    assert str(path) in out and secret.to_text() not in out
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert ClusterSecret.from_file(path) == secret


def test_serve_uses_the_secret_from_the_environment(no_secret_env, monkeypatch, capsys) -> None:
    monkeypatch.setenv(SECRET_ENV, TEST_SECRET.to_text())
    assert _serve_secret() == TEST_SECRET
    assert capsys.readouterr().out == ""


def test_configs_refuse_to_run_without_credentials() -> None:
    from pdcluster.router.metrics import RouterMetrics
    from pdcluster.router.routing.dispatch import Dispatcher

    with pytest.raises(ValueError, match="metadata service"):
        Dispatcher(RouterConfig(model_dir="m"), RouterMetrics())
    with pytest.raises(ValueError, match="metadata_token"):
        RouterConfig(model_dir="m", metadata_address="meta:50061")
    with pytest.raises(ValueError, match="external metadata service needs its cluster secret"):
        RayCluster(ClusterConfig(model="m", metadata_address="meta:50061"))
    assert RayCluster(ClusterConfig(model="m")).cluster_secret is not None  # all embedded


def test_a_node_actor_gets_its_own_bootstrap_credential_only(no_secret_env,
                                                             monkeypatch) -> None:
    """The launcher hands each node actor the token of its own principal, never the secret;
    without one, the actor refuses to start, even with the secret in its worker's environment
    (only the launcher issues node tokens)."""
    seen = []
    monkeypatch.setattr("pdcluster.node.actor.NodeRuntime",
                        lambda config, shared_keys=None, on_fatal=None: seen.append(config)
                        or _Started())

    class Prefill(NodeActor):
        role = "prefill"

    Prefill("p0", "m", metadata_address="meta:1", bootstrap_token=node_token("p0"))
    assert [c.bootstrap_token for c in seen] == [node_token("p0")]
    assert not any(isinstance(v, ClusterSecret) for c in seen
                   for v in (getattr(c, f) for f in c.__dataclass_fields__))
    monkeypatch.setattr("pdcluster.node.actor.NodeRuntime", NodeRuntime)  # refuses it first
    monkeypatch.setenv(SECRET_ENV, TEST_SECRET.to_text())
    with pytest.raises(ValueError, match="bootstrap_token"):
        Prefill("p1", "m", metadata_address="meta:1")
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(ValueError, match="bootstrap_token"):
        Prefill("p2", "m", metadata_address="meta:1")
    with pytest.raises(ValueError, match="not a credential of principal node/p3"):
        Prefill("p3", "m", metadata_address="meta:1", bootstrap_token=node_token("p0"))


def test_the_launcher_gives_the_router_a_client_credential_only() -> None:
    config = router_config(ClusterConfig(model="m"), "meta:1", TEST_SECRET)
    assert config.metadata_token == TEST_SECRET.metadata_token(SERVICE)
    assert not any(isinstance(getattr(config, f), ClusterSecret)
                   for f in config.__dataclass_fields__)
    assert "shared_curve" not in config.__dataclass_fields__  # its own pair, made at start


class _Started:
    def start(self):
        return self


def test_a_link_planted_where_the_secret_goes_is_replaced_not_followed(tmp_path) -> None:
    """Another local user plants a link at the secret's path (or opens the file first): the
    secret must not land in the link's target (theirs to read), nor in an open file."""
    target = tmp_path / "attacker-readable"
    target.write_text("")
    target.chmod(0o644)
    path = tmp_path / "cache" / "cluster-secret"
    path.parent.mkdir()
    path.symlink_to(target)
    write_secret_file(TEST_SECRET, path)
    assert target.read_text() == ""
    assert not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ClusterSecret.from_text(path.read_text().strip()) == TEST_SECRET
    assert sorted(p.name for p in path.parent.iterdir()) == ["cluster-secret"]  # no leftovers


def test_configs_keep_credentials_out_of_their_reprs() -> None:
    from pdcluster.engine.config import EngineConfig
    from pdcluster.metadata_service.config import MetadataConfig
    from pdcluster.node.config import NodeConfig

    router = RouterConfig(model_dir="m", metadata_address="meta:1",
                          metadata_token="service:router-token-value",
                          api_keys=("tenant:sk-tenant-key",))
    node = NodeConfig(node_id="p0", role="prefill", engine=EngineConfig("m"),
                      metadata_address="meta:1", bootstrap_token=node_token("p0"))
    metadata = MetadataConfig(cluster_secret=TEST_SECRET, router_token="router-token-value")
    text = repr(router) + repr(node) + repr(metadata)
    for secret in ("router-token-value", "sk-tenant-key", node_token("p0"),
                   TEST_SECRET.to_text()):
        assert secret not in text
