"""The router's per-tenant limits as its operators set them: cluster.yaml's
`router.tenant_limits` reaches the router the launcher starts, `pdcluster router serve`'s
flags reach its config, and a mistyped key or a malformed flag is refused by name."""

from __future__ import annotations

import pytest

from pdcluster.cluster import cli
from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.launch import router_config
from pdcluster.core.credentials import ClusterSecret
from pdcluster.router.planning.tenant_limits import TenantLimits


def test_cluster_yaml_tenant_limits_reach_the_router(tmp_path) -> None:
    from tests.models import build_model_dirs

    model = build_model_dirs(tmp_path)["llama-gqa"]
    config = ClusterConfig.from_dict({"model": model, "router": {"tenant_limits": {
        "max_requests": 64, "max_tokens": 262144, "retry_after_s": 2,
        "tenants": {"batch": {"max_requests": 8}}}}})
    want = TenantLimits(64, 262144, (("batch", 8, None),), 2)
    assert config.tenant_limits == want
    secret = ClusterSecret.generate()
    assert router_config(config, "127.0.0.1:1", secret).tenant_limits == want
    assert ClusterConfig.from_dict({"model": model}).tenant_limits == TenantLimits()
    with pytest.raises(ValueError, match="max_inflight"):
        ClusterConfig.from_dict({"model": model, "router": {"tenant_limits": {
            "max_inflight": 3}}})


def test_router_serve_flags_make_the_limits(monkeypatch, tmp_path, capsys) -> None:
    import pdcluster.router.api.server as server

    seen = []

    async def capture(config, on_ready=None) -> None:
        seen.append(config)

    monkeypatch.setattr(server, "serve_forever", capture)
    monkeypatch.setenv("PDCLUSTER_ROUTER_TOKEN", "token")
    (tmp_path / "config.json").write_text("{}")
    base = ["router", "serve", "--model", str(tmp_path), "--metadata", "127.0.0.1:1"]
    assert cli.main([*base, "--tenant-max-requests", "4", "--tenant-max-tokens", "9000",
                     "--tenant-limit", "batch:1:", "--prep-threads", "3"]) == 0
    assert seen[0].tenant_limits == TenantLimits(4, 9000, (("batch", 1, None),))
    assert seen[0].prep_threads == 3
    assert cli.main([*base, "--tenant-limit", "batch:one:"]) == 2
    assert "NAME:REQUESTS:TOKENS" in capsys.readouterr().err
