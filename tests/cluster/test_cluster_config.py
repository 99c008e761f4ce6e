"""ClusterConfig: cluster.yaml parsing and validation (no Ray needed)."""

from __future__ import annotations

import pytest

from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.launch import router_config
from pdcluster.engine.config import EngineConfig
from pdcluster.node.config import NodeConfig
from tests.cluster_secret import TEST_SECRET, node_token


def test_yaml_sections_map_to_fields(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("model: /models/m\nnum_prefill: 2\nnum_decode: 3\nhost: auto\n"
                    "engine: {dtype: bfloat16, block_size: 32, max_model_len: null}\n"
                    "transfer: {protocol: rdma, device_name: mlx5_0, timeout_s: 12}\n"
                    "metadata: {address: 'meta:50061'}\n"
                    "router: {host: 0.0.0.0, port: 9000, enabled: false}\n"
                    "node: {gpus: 1, max_restarts: 5, role_resource_prefix: pdcluster_,\n"
                    "       local_prefill_threshold_tokens: 64, global_reuse_min_tokens: 0}\n")
    config = ClusterConfig.from_yaml(path)
    assert (config.num_prefill, config.num_decode, config.host) == (2, 3, "auto")
    assert config.engine == {"dtype": "bfloat16", "block_size": 32}  # nulls mean "default"
    assert (config.kv_protocol, config.kv_device, config.kv_timeout_s) == ("rdma", "mlx5_0", 12)
    assert config.metadata_address == "meta:50061" and not config.router_enabled
    assert (config.node_gpus, config.max_restarts, config.role_resource_prefix) == \
        (1, 5, "pdcluster_")
    router = router_config(config, "meta:50061", TEST_SECRET)
    policy = router.policy
    assert (policy.local_prefill_threshold, policy.global_reuse_min_tokens) == (64, 0)
    # the router hashes with the KV identity cluster.yaml gives every node it launches
    identity = router.cluster_identity
    assert identity is not None and policy.block_size == 0  # unset: the cluster's is bound
    assert (identity.block_size, identity.hash_algorithm, identity.model) == (32, "sha256", "m")


@pytest.mark.parametrize("bad, match", [
    ({"model": "m", "surprise": 1}, "unknown cluster config keys"),
    ({"model": "m", "num_decode": 0}, "decode node"),
    ({"model": "m", "transfer": {"protocol": "udp"}}, "tcp or rdma"),
    ({"model": "m", "router": {"port": 0}}, "port"),
    ({"model": "m", "node": {"global_reuse_min_tokens": -1}}, "global_reuse_min_tokens"),
    ({"model": "m", "metadata": {"tls_ca": "/tls/ca.crt"}}, "external metadata service"),
    ({"model": "m", "metadata": {"address": "meta:1", "tls_ca": "ca", "tls_cert": "c"}},
     "both its cert and key"),
    ({"model": "m", "metadata": {"address": "meta:1", "tls_key": "k"}}, "need metadata_tls_ca"),
    ({"model": "m", "metadata": {"address": "meta:1", "tls-ca": "ca"}},
     "unknown metadata config keys"),
])
def test_bad_configs_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        ClusterConfig.from_dict(bad)


def test_metadata_tls_reaches_the_router_and_the_node_options():
    config = ClusterConfig.from_dict({"model": "m", "metadata": {
        "address": "meta:50061", "tls_ca": "/tls/ca.crt", "tls_cert": "/c/tls.crt",
        "tls_key": "/c/tls.key", "tls_server_name": "meta.svc"}})
    fields = {"metadata_tls_ca": "/tls/ca.crt", "metadata_tls_cert": "/c/tls.crt",
              "metadata_tls_key": "/c/tls.key", "metadata_tls_server_name": "meta.svc"}
    assert config.metadata_tls_fields() == fields
    tls = router_config(config, "meta:50061", TEST_SECRET).metadata_tls
    assert (tls.ca_file, tls.cert_file, tls.key_file, tls.server_name) == \
        ("/tls/ca.crt", "/c/tls.crt", "/c/tls.key", "meta.svc")
    assert NodeConfig(node_id="p0", role="prefill", engine=EngineConfig("m"),
                      bootstrap_token=node_token("p0"),
                      metadata_address="meta:50061", **fields).metadata_tls == tls
    assert router_config(ClusterConfig(model="m"), "x:1", TEST_SECRET).metadata_tls is None


def test_cli_metadata_tls_flags_reach_the_configs():
    from pdcluster.cluster import cli
    from pdcluster.cluster.cli_services import metadata_tls_fields

    tls = ["--metadata-tls-ca", "ca.crt", "--metadata-tls-cert", "c.crt",
           "--metadata-tls-key", "c.key", "--metadata-tls-server-name", "meta"]
    parser = cli.build_parser()
    router = parser.parse_args(["router", "serve", "--model", "m", "--metadata", "x:1", *tls])
    serve = parser.parse_args(["serve", "--model", "m", "--metadata", "x:1", *tls])
    expected = {"metadata_tls_ca": "ca.crt", "metadata_tls_cert": "c.crt",
                "metadata_tls_key": "c.key", "metadata_tls_server_name": "meta"}
    assert metadata_tls_fields(router) == metadata_tls_fields(serve) == expected
    metadata = parser.parse_args(["metadata", "serve", "--tls-cert", "s.crt", "--tls-key",
                                  "s.key", "--tls-client-ca", "clients.crt"])
    assert metadata.tls_client_ca == "clients.crt"


def test_speculative_decoding_goes_to_decode_nodes_only():
    config = ClusterConfig.from_dict({"model": "m", "engine": {"block_size": 8,
                                                                "speculative": "ngram:k=4"}})
    assert config.engine_options("decode") == {"block_size": 8, "speculative": "ngram:k=4"}
    assert config.engine_options("prefill") == {"block_size": 8}
    assert config.engine == {"block_size": 8, "speculative": "ngram:k=4"}  # not mutated


def test_serve_refuses_a_bad_speculative_flag():
    from pdcluster.cluster.cli_common import UsageError
    from pdcluster.cluster.cli_services import _speculative_arg

    assert _speculative_arg("draft:/m/small,k=2") == "draft:/m/small,k=2"
    with pytest.raises(UsageError, match="speculative method"):
        _speculative_arg("beam:k=2")


def test_host_tier_reaches_every_node_and_bad_sizes_fail_at_start():
    config = ClusterConfig(model="/models/m", engine={"block_size": 8, "host_cache_gib": 4})
    assert config.engine_options("prefill")["host_cache_gib"] == 4
    assert config.engine_options("decode")["host_cache_gib"] == 4
    with pytest.raises(ValueError, match="host_cache_gib must be >= 0"):
        ClusterConfig(model="/models/m", engine={"host_cache_gib": -1})
    with pytest.raises(ValueError, match="vLLM's own connectors"):
        ClusterConfig(model="/models/m", engine={"host_cache_gib": 4, "backend": "vllm"})


def test_tensor_parallel_size_per_role_sets_each_engine_and_its_gpus():
    config = ClusterConfig.from_dict({"model": "m", "engine": {"tensor_parallel_size": 4},
                                      "node": {"gpus": 1, "tensor_parallel_size":
                                               {"prefill": 2}}})
    assert config.engine_options("prefill")["tensor_parallel_size"] == 2
    assert config.engine_options("decode")["tensor_parallel_size"] == 4  # the engine's own
    assert (config.node_gpus_of("prefill"), config.node_gpus_of("decode")) == (2, 4)
    both = ClusterConfig.from_dict({"model": "m", "node": {"tensor_parallel_size": 2}})
    assert both.tensor_parallel_size("prefill") == both.tensor_parallel_size("decode") == 2
    assert both.node_gpus_of("decode") == 0  # CPU: ranks are processes, no GPU asked
    plain = ClusterConfig(model="m", node_gpus=1)
    assert plain.tensor_parallel_size("decode") == 1 and plain.node_gpus_of("prefill") == 1
    for bad in ({"prefill": 2, "both": 1}, "2", {"decode": 0}):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            ClusterConfig.from_dict({"model": "m", "node": {"tensor_parallel_size": bad}})
