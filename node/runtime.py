"""`NodeRuntime`: assembles one node — engine, KV connector over Mooncake, node server, and
(when a metadata service is configured) registration under a lease plus KV event publishing.

    runtime = NodeRuntime(NodeConfig(node_id="p0", role="prefill", engine=EngineConfig(path),
                                     cluster_secret=secret)).start()
    runtime.info()        # addresses for the router: requests and KV side channel
    runtime.stop()        # drain, deregister, release
"""

from __future__ import annotations

import logging
from dataclasses import replace

from pdcluster.core.credentials import node_principal
from pdcluster.core.kv_connector import KVConnector
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.node.config import NodeConfig
from pdcluster.node.events import EventPublisherThread
from pdcluster.node.server import NodeServer
from pdcluster.transfer.connector_scheduler import ConnectorScheduler
from pdcluster.transfer.connector_worker import ConnectorWorker
from pdcluster.transfer.mooncake_engine import MooncakeConfig
from pdcluster.transfer.transport import MooncakeTransport

logger = logging.getLogger(__name__)


def metadata_client(config: NodeConfig) -> MetadataClient:
    """The node's client of the metadata service: its own principal (the service lets it act
    only as itself), over TLS when the config names a CA."""
    assert config.metadata_address is not None, "no metadata service configured"
    token = config.cluster_secret.metadata_token(node_principal(config.node_id))
    return MetadataClient(config.metadata_address, token=token,
                          tls_ca_file=config.metadata_tls_ca,
                          tls_cert_file=config.metadata_tls_cert,
                          tls_key_file=config.metadata_tls_key,
                          tls_server_name=config.metadata_tls_server_name)


class NodeRuntime:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        curve = config.cluster_secret.curve_keys()  # request socket and KV side channel
        transport = MooncakeTransport(MooncakeConfig(hostname=config.host,
                                                     protocol=config.kv_protocol,
                                                     device_name=config.kv_device),
                                      host=config.host, curve=curve)
        worker = ConnectorWorker(transport, timeout_s=config.kv_timeout_s)
        connector = KVConnector(ConnectorScheduler(config.recompute_on_failure,
                                                   config.min_pull_blocks), worker)
        engine_config = replace(config.engine,
                                enable_kv_events=config.metadata_address is not None)
        self.engine = LLMEngine(engine_config, connector)
        self.kv_address = transport.reply_address
        self.server = NodeServer(self.engine, config.node_id, config.role, config.host,
                                 config.port, on_step=self._on_step, curve=curve)
        self.events = self._publisher() if config.metadata_address else None

    def _publisher(self) -> EventPublisherThread:
        cfg, engine = self.config, self.engine
        info = make_node_info(cfg.node_id, cfg.role, request_address=self.server.address,
                              kv_address=self.kv_address, model=cfg.model,
                              block_size=engine.config.block_size,
                              capacity_blocks=engine.kv_spec.num_blocks)
        return EventPublisherThread(metadata_client(cfg), info, engine.cached_block_hashes,
                                    cfg.lease_ttl_s, cfg.publish_interval_s)

    def start(self, registration_timeout_s: float = 10.0) -> NodeRuntime:
        if self.events is not None:
            self.events.start()
            if not self.events.wait_registered(registration_timeout_s):
                logger.warning("node %s: metadata service not reachable yet; serving anyway, "
                               "registration retries in the background", self.config.node_id)
        self.server.start()
        return self

    def _on_step(self, engine: LLMEngine) -> None:
        if self.events is not None:
            self.events.put(engine.take_kv_events())

    def info(self) -> dict[str, str]:
        return {"node_id": self.config.node_id, "role": self.config.role,
                "request_address": self.server.address, "kv_address": self.kv_address}

    def stop(self, drain: bool = True, timeout_s: float = 30.0) -> bool:
        drained = self.server.stop(drain=drain, timeout_s=timeout_s)
        if self.events is not None:
            self.events.stop(deregister=True)
        self.engine.close()
        return drained
