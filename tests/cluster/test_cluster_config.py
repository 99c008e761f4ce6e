"""ClusterConfig: cluster.yaml parsing and validation (no Ray needed)."""

from __future__ import annotations

import pytest

from cluster.config import ClusterConfig
from cluster.launch import router_config
from tests.cluster_secret import TEST_SECRET


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
    policy = router_config(config, "meta:50061", TEST_SECRET).policy
    assert (policy.block_size, policy.local_prefill_threshold, policy.global_reuse_min_tokens) \
        == (32, 64, 0)


@pytest.mark.parametrize("bad, match", [
    ({"model": "m", "surprise": 1}, "unknown cluster config keys"),
    ({"model": "m", "num_decode": 0}, "decode node"),
    ({"model": "m", "transfer": {"protocol": "udp"}}, "tcp or rdma"),
    ({"model": "m", "router": {"port": 0}}, "port"),
    ({"model": "m", "node": {"global_reuse_min_tokens": -1}}, "global_reuse_min_tokens"),
])
def test_bad_configs_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        ClusterConfig.from_dict(bad)
