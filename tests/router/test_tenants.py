"""The router's edge toward tenants: API keys name tenants, the cache salt is derived from the
tenant server-side (so two keys of different tenants never share a prefix hit, whatever salts
they send), and the router's internals (/metrics, the detailed /health) are not served to a
caller without a key on the public port — they live on the admin port."""

from __future__ import annotations

import hashlib
import http.client
import json
from types import SimpleNamespace

import openai
import pytest
from aiohttp.test_utils import make_mocked_request

from pdcluster.router.errors import ApiError
from pdcluster.router.tenants import ApiKeys, Tenant, TenantSalts, tenant_salt

KEYS = ("team-a:sk-a1", "team-a:sk-a2", "sk-b")
SALT_KEY = b"k" * 32


def _request(key: str | None):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return make_mocked_request("GET", "/", headers=headers)


def test_keys_name_their_tenants():
    keys = ApiKeys(KEYS)
    a1, a2, b = (keys.authenticate(_request(k)) for k in ("sk-a1", "sk-a2", "sk-b"))
    assert a1 == a2 == Tenant("team-a")
    assert b is not None and b != a1 and b.name.startswith("key-")
    assert "sk-b" not in b.name  # a bare key's tenant is named by a digest, not the key
    for bad in (None, "sk-a", "team-a:sk-a1", ""):
        with pytest.raises(ApiError) as exc:
            keys.authenticate(_request(bad))
        assert exc.value.status == 401
    assert ApiKeys(()).authenticate(_request(None)) is None  # an open router: no tenants


def test_the_salt_binds_the_tenant_and_keeps_the_clients_split():
    a, b = Tenant("team-a"), Tenant("team-b")

    def salt(tenant, client):
        return tenant_salt(tenant, client, SALT_KEY)

    assert salt(a, None) != salt(b, None)
    assert salt(a, "x") != salt(b, "x")  # the same client salt: still apart
    assert salt(a, "x") != salt(a, None)
    assert salt(a, "x") == salt(a, "x")
    assert salt(None, "x") == "x" and salt(None, None) is None


def test_the_salt_is_keyed_so_a_tenants_name_does_not_give_it_away():
    """Before, the salt was sha256(tenant \\0 client salt): anyone knowing a tenant's name
    (a member node naming its blocks in a pull) could compute it. Now it is an HMAC under
    the router's cache-salt key: equal for routers sharing the key, apart otherwise."""
    a = Tenant("team-a")
    unkeyed = "tenant:" + hashlib.sha256(b"team-a\0x").hexdigest()
    assert tenant_salt(a, "x", SALT_KEY) != unkeyed
    assert TenantSalts(SALT_KEY).salt(a, "x") == TenantSalts(SALT_KEY).salt(a, "x")
    assert TenantSalts(b"j" * 32).salt(a, "x") != TenantSalts(SALT_KEY).salt(a, "x")
    assert TenantSalts(None).salt(a, "x") != TenantSalts(None).salt(a, "x")  # own keys


@pytest.fixture
def real_node(model_dirs):
    from pdcluster.engine import LLMEngine
    from pdcluster.node.server import NodeServer
    from tests.cluster_secret import TEST_CURVE

    engine = LLMEngine.from_model(model_dirs["llama-gqa"], num_kv_blocks=128, block_size=8)
    server = NodeServer(engine, "d0", "decode", curve=TEST_CURVE).start()
    yield server
    server.stop(drain=False)


def _cached(router, key: str, prompt: str, salt: str | None = None) -> int:
    client = openai.OpenAI(base_url=router.base_url, api_key=key, max_retries=0, timeout=60)
    extra = {} if salt is None else {"extra_body": {"cache_salt": salt}}
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                    temperature=0, **extra)
    return out.usage.prompt_tokens_details.cached_tokens


def test_two_api_keys_never_share_a_prefix_hit(start_router, real_node, model_dirs):
    node = SimpleNamespace(node_id="d0", role="decode", address=real_node.address,
                           kv_address="")
    router = start_router([node], api_keys=KEYS, model_dir=model_dirs["llama-gqa"],
                          cache_salt_key=SALT_KEY)
    prompt = "one two three four five six seven eight nine ten " * 4
    scheduler = real_node.engine.scheduler
    assert _cached(router, "sk-a1", prompt) == 0
    assert _cached(router, "sk-b", prompt) == 0  # another tenant: no hit on a's blocks
    assert _cached(router, "sk-b", prompt, salt="tenant-a-ish") == 0  # nor with any salt
    assert scheduler.num_prefix_hit_tokens == 0  # the node's own counter agrees
    hit = _cached(router, "sk-a2", prompt)  # the same tenant, another key: shared
    assert hit > 0 and scheduler.num_prefix_hit_tokens == hit
    assert _cached(router, "sk-b", prompt) > 0  # b's own blocks serve b


def test_routers_sharing_the_salt_key_share_a_tenants_prefixes(start_router, real_node,
                                                                 model_dirs):
    """Two router replicas with the same cache-salt key salt a tenant alike, so the second
    hits what the first cached; a router with another key shares nothing."""
    node = SimpleNamespace(node_id="d0", role="decode", address=real_node.address,
                           kv_address="")
    model = model_dirs["llama-gqa"]
    first, second, other = (start_router([node], api_keys=KEYS, model_dir=model,
                                         cache_salt_key=key)
                            for key in (SALT_KEY, SALT_KEY, b"j" * 32))
    prompt = "eleven twelve thirteen fourteen fifteen sixteen seventeen " * 4
    assert _cached(first, "sk-a1", prompt) == 0
    assert _cached(other, "sk-a1", prompt) == 0  # another key: another salt, no hit
    assert _cached(second, "sk-a2", prompt) > 0  # the same key: the same salt


def _get(port: int, path: str, key: str | None = None) -> tuple[int, dict | str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path, headers={} if key is None else {"Authorization": f"Bearer {key}"})
    resp = conn.getresponse()
    data = resp.read().decode()
    conn.close()
    try:
        return resp.status, json.loads(data)
    except json.JSONDecodeError:
        return resp.status, data


def test_metrics_and_health_internals_need_a_key_on_the_public_port(start_router, make_node):
    node = make_node("d0", role="decode")
    router = start_router([node], api_keys=KEYS)
    port = router.app.port
    status, body = _get(port, "/metrics")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = _get(port, "/metrics", "sk-b")
    assert status == 200 and "router_requests_total" in body
    status, body = _get(port, "/health")
    assert status in (200, 503) and set(body) == {"status"}  # no node ids, no addresses
    status, body = _get(port, "/health", "sk-a1")
    assert "d0" in json.dumps(body["nodes"])


def test_the_admin_port_serves_what_the_public_port_does_not(start_router, make_node):
    node = make_node("d0", role="decode")
    router = start_router([node], api_keys=KEYS, admin_port=0)
    public, admin = router.app.port, router.app.admin_port
    assert admin not in (None, public)
    assert _get(public, "/metrics", "sk-b")[0] == 404  # not even with a key: admin only
    status, body = _get(public, "/health", "sk-b")  # a tenant's key reads the status alone
    assert status in (200, 503) and set(body) == {"status"}, body
    status, body = _get(admin, "/metrics")
    assert status == 200 and "router_requests_total" in body
    status, body = _get(admin, "/health")
    assert "d0" in json.dumps(body["nodes"])
    assert _get(admin, "/v1/models")[0] == 404  # the admin port serves nothing else
