"""The engine a node runs, built from its config: the project's own (`engine.LLMEngine` with
the KV connector of `transfer/` over Mooncake) or vLLM (`pdcluster.vllm_backend`, whose
connector runs inside vLLM's processes). Either way the node gets a `NodeEngine`, the
address its peers send KV requests to and its transfer-engine session; nothing else in
`node/` asks which it is. `keys` is the node's own CURVE key pair and `directory` the key
directory its side channel admits and authorises by (core.identity; None: the shared-key mode
of `keys`); a vLLM node hands both to its connector through its private folder.
"""

from __future__ import annotations

from dataclasses import replace

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.identity import Directory
from pdcluster.core.kv_connector import KVConnector
from pdcluster.engine.api import NodeEngine
from pdcluster.node.config import NodeConfig
from pdcluster.transfer.connector_scheduler import ConnectorScheduler
from pdcluster.transfer.connector_worker import ConnectorWorker
from pdcluster.transfer.mooncake_engine import MooncakeConfig
from pdcluster.transfer.transport import MooncakeTransport


def make_engine(config: NodeConfig, keys: CurveKeys, directory: Directory | None
                ) -> tuple[NodeEngine, str, str]:
    """(the engine, its KV side-channel address, its transfer-engine session) for `config`."""
    if config.engine.backend == "vllm":
        return _vllm_engine(config, keys, directory)
    return _own_engine(config, keys, directory)


def _own_engine(config: NodeConfig, keys: CurveKeys, directory: Directory | None
                ) -> tuple[NodeEngine, str, str]:
    from pdcluster.engine.llm_engine import LLMEngine

    transport = MooncakeTransport(MooncakeConfig(hostname=config.host,
                                                 protocol=config.kv_protocol,
                                                 device_name=config.kv_device),
                                  host=config.host, curve=keys, directory=directory)
    worker = ConnectorWorker(transport, timeout_s=config.kv_timeout_s, peers=directory)
    connector = KVConnector(ConnectorScheduler(config.recompute_on_failure,
                                               config.min_pull_blocks), worker)
    engine_config = replace(config.engine, enable_kv_events=config.metadata_address is not None)
    try:
        engine = LLMEngine(engine_config, connector)
    except BaseException:  # a model that does not load: its transfer engine does not stay up
        worker.close()
        raise
    return engine, transport.reply_address, transport.session_id


def _vllm_engine(config: NodeConfig, keys: CurveKeys, directory: Directory | None
                 ) -> tuple[NodeEngine, str, str]:
    # Imported here: vLLM is an optional install, and only vLLM nodes pay for its import.
    from pdcluster.vllm_backend.engine import VllmEngine
    from pdcluster.vllm_backend.settings import ConnectorSettings

    settings = ConnectorSettings(handshake_dir="", host=config.host,
                                 protocol=config.kv_protocol, device=config.kv_device,
                                 timeout_s=config.kv_timeout_s,
                                 recompute_on_failure=config.recompute_on_failure,
                                 min_pull_blocks=config.min_pull_blocks,
                                 hash_seed=config.engine.hash_seed)
    engine = VllmEngine(config.engine, settings, keys, directory)
    return engine, engine.kv_address, engine.kv_session
