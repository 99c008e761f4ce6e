"""NodeRuntime: a prefill and a decode node (engine + Mooncake connector + node server)
registered with a real metadata service (gRPC on 127.0.0.1, in-memory store), publishing
their KV events so the global index names the nodes that hold each prompt's blocks."""

from __future__ import annotations

import socket
import time

import pytest

from pdcluster.benchmarks.ports import free_port
from pdcluster.core.hashing import hash_block_tokens
from pdcluster.core.node_wire import GenerateRequest, SamplingSpec, TransferSpec
from pdcluster.engine.config import EngineConfig
from pdcluster.metadata_service.client import MetadataClient
from pdcluster.metadata_service.server import ServerThread
from pdcluster.node.client import BlockingNodeClient, tokens_of
from pdcluster.node.config import NodeConfig
from pdcluster.node.runtime import NodeRuntime
from tests.cluster_secret import TEST_CURVE, TEST_SECRET, node_credentials, node_token
from tests.helpers import assert_pool_clean
from tests.metadata_service.helpers import make_config
from tests.models import random_prompts

OPTIONS = {"num_kv_blocks": 128, "block_size": 8}


@pytest.fixture
def metadata():
    """A metadata service that checks credentials: the nodes present their own."""
    with ServerThread(make_config(cluster_secret=TEST_SECRET)) as server, \
            MetadataClient(server.address, cluster_secret=TEST_SECRET) as client:
        yield server, client


def start_node(model: str, node_id: str, role: str, metadata_address: str | None):
    return NodeRuntime(NodeConfig(node_id=node_id, role=role, engine=EngineConfig(model, **OPTIONS),
                                  metadata_address=metadata_address,
                                  lease_ttl_s=2, publish_interval_s=0.02,
                                  **node_credentials(node_id)), shared_keys=TEST_CURVE).start()


def until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_nodes_register_serve_and_publish_their_blocks(model_dirs, hf_reference, metadata):
    server, client = metadata
    model = model_dirs["llama-gqa"]
    prefill = start_node(model, "p0", "prefill", server.address)
    decode = start_node(model, "d0", "decode", server.address)
    to_p = BlockingNodeClient(prefill.server.address, curve=TEST_CURVE)
    to_d = BlockingNodeClient(decode.server.address, curve=TEST_CURVE)
    try:
        nodes = {n.node_id: n for n in client.list_nodes()}
        assert nodes["p0"].kv_address == prefill.kv_address
        assert nodes["d0"].request_address == decode.server.address
        prompt = random_prompts(1, 40, 40, seed=60)[0]
        to_d.send(GenerateRequest("d", prompt, SamplingSpec(max_tokens=6, temperature=0.0,
                                                            ignore_eos=True),
                                  TransferSpec("remote_prefill", "t", prefill.kv_address)))
        to_p.send(GenerateRequest("p", prompt, SamplingSpec(max_tokens=1, temperature=0.0),
                                  TransferSpec("remote_decode", "t")))
        got = to_d.collect({"d"})
        assert tokens_of(got["d"]) == hf_reference(model, prompt, 6)
        chain = hash_block_tokens(prompt, 8)
        until(lambda: dict(client.query(chain)) == {"p0": 5, "d0": 5})
        assert dict(client.query(chain, role="decode")) == {"d0": 5}
    finally:
        to_p.close()
        to_d.close()
        assert prefill.stop() and decode.stop()
    assert client.list_nodes() == []  # deregistered: their blocks left the index
    assert client.query(chain) == []
    assert_pool_clean(prefill.engine.block_pool)


def test_node_serves_without_a_reachable_metadata_service(model_dirs):
    engine = EngineConfig(model_dirs["llama-gqa"], **OPTIONS)
    node = NodeRuntime(NodeConfig(node_id="lonely", role="decode", engine=engine,
                                  metadata_address="127.0.0.1:1",
                                  publish_interval_s=0.02, **node_credentials("lonely")),
                       shared_keys=TEST_CURVE)
    node.start(registration_timeout_s=0.5)
    wire = BlockingNodeClient(node.server.address, curve=TEST_CURVE)
    try:
        wire.send(GenerateRequest("r", [1, 2, 3], SamplingSpec(max_tokens=3, ignore_eos=True)))
        assert len(tokens_of(wire.collect({"r"})["r"])) == 3
        assert node.events.num_failures >= 1
    finally:
        wire.close()
        node.stop()


def test_config_is_validated():
    engine = EngineConfig("m")
    with pytest.raises(ValueError, match="role"):
        NodeConfig(node_id="x", role="both", engine=engine)
    with pytest.raises(ValueError, match="node id"):
        NodeConfig(node_id="bad id", role="prefill", engine=engine)
    with pytest.raises(ValueError, match="EngineConfig"):
        NodeConfig(node_id="x", role="prefill", engine={"model": "m"})
    assert NodeConfig(node_id="x", role="prefill", engine=engine).model == "m"
    # the shared-key test mode is no configuration: nothing built from a config turns it on
    assert "shared_curve" not in NodeConfig.__dataclass_fields__


def test_engine_options_from_the_launcher_are_checked_by_name():
    """What crosses Ray as a dict becomes an EngineConfig at once; a misspelt option (or the
    model given twice) is a ValueError naming it, not a TypeError deep in the node."""
    assert EngineConfig.from_options("m", OPTIONS) == EngineConfig("m", **OPTIONS)
    for bad in ({"num_kv_blockz": 4}, {"model": "other"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig.from_options("m", bad)
    with pytest.raises(ValueError, match="block_size"):  # and the values are validated too
        EngineConfig.from_options("m", {"block_size": 0})


def test_a_node_without_an_identity_is_refused():
    """A node serves nobody without credentials: its identity comes from the metadata service
    (and its bootstrap token, for its own id only), or from the shared-key test mode, which
    only a caller of NodeRuntime can choose. Refused before the engine loads."""
    engine = EngineConfig("no-such-model")
    with pytest.raises(ValueError, match="bootstrap_token"):
        NodeRuntime(NodeConfig(node_id="x", role="prefill", engine=engine))
    with pytest.raises(ValueError, match="bootstrap_token"):
        NodeRuntime(NodeConfig(node_id="x", role="prefill", engine=engine,
                               metadata_address="m:1"))
    with pytest.raises(ValueError, match="metadata service"):
        NodeRuntime(NodeConfig(node_id="x", role="prefill", engine=engine,
                               bootstrap_token=node_token("x")))
    with pytest.raises(ValueError, match="not a credential of principal node/x"):
        NodeConfig(node_id="x", role="prefill", engine=engine, metadata_address="m:1",
                   bootstrap_token=node_token("y"))


def _listening_ports() -> set[int]:
    import psutil
    return {c.laddr.port for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


def _node_config(model: str, **overrides) -> NodeConfig:
    return NodeConfig(node_id="n", role="decode", engine=EngineConfig(model, **OPTIONS),
                      **overrides)


def test_a_node_whose_port_is_taken_fails_to_start_and_leaves_nothing_listening(model_dirs):
    """Its engine was up (Mooncake's ports, the KV side channel) when the request port turned
    out to be taken: the error goes on and every port the start opened is closed again."""
    import zmq
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        before = _listening_ports()
        config = _node_config(model_dirs["llama-gqa"], port=taken.getsockname()[1],
                              metrics_port=0)
        with pytest.raises(zmq.ZMQError, match="in use"):
            NodeRuntime(config, shared_keys=TEST_CURVE)
        assert _listening_ports() == before


def test_a_node_whose_model_does_not_load_leaves_no_transfer_engine(tmp_path):
    before = _listening_ports()
    with pytest.raises(Exception, match="config.json|not a folder|No such|does not"):
        NodeRuntime(_node_config(str(tmp_path / "no-model")), shared_keys=TEST_CURVE)
    assert _listening_ports() == before
