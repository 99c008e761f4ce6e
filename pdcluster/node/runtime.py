"""`NodeRuntime`: assembles one node — engine, KV connector over Mooncake, node server, and
(when a metadata service is configured) registration under a lease plus KV event publishing.

    runtime = NodeRuntime(NodeConfig(node_id="p0", role="prefill", engine=EngineConfig(path),
                                     metadata_address=addr, bootstrap_token=token)).start()
    runtime.info()        # addresses: requests, KV side channel, metrics ("" if none)
    runtime.stop()        # drain, deregister, release

Identity (core.identity): the node makes its own CURVE key pair here, serves its request
socket and KV side channel with it, and registers the public half, its addresses and its
transfer-engine session with the metadata service under its bootstrap credential. Its key
directory follows the metadata service (registered nodes and routers), and is what its
sockets admit and authorise per message. `NodeRuntime(config, shared_keys=pair)` serves and
connects with one pair every member holds instead, admitting its holders for everything:
static nodes without a metadata service, as tests and benchmarks run them; nothing builds it
from a configuration. `on_fatal(error)` is called (on the server thread) once the engine is
lost for good (node/server.py); a node actor exits there so that Ray restarts it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack

from pdcluster.core.credentials import CurveKeys, node_principal
from pdcluster.core.curve import forget_directory
from pdcluster.core.identity import ROUTER_PREFIX, Directory, Peer
from pdcluster.core.kv_identity import KVIdentity
from pdcluster.engine.api import NodeEngine
from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.metadata_service.pod_token import PodTokenSource
from pdcluster.node.config import NodeConfig
from pdcluster.node.engines import make_engine
from pdcluster.node.events import EventPublisherThread
from pdcluster.node.metrics import MetricsServer, NodeMetrics
from pdcluster.node.server import NodeServer

logger = logging.getLogger(__name__)
DIRECTORY_REFRESH_S = 2.0


def node_credential(config: NodeConfig) -> str | Callable[[], str] | None:
    """The node's metadata token: its bootstrap_token, or, with an identity_token_file, a
    source that gets (and renews) one for its pod's service-account token."""
    if config.identity_token_file is None:
        return config.bootstrap_token
    assert config.metadata_address is not None, "NodeConfig checks identity_token_file"
    return PodTokenSource(config.metadata_address, config.node_id, config.role,
                          config.identity_token_file, tls=config.metadata_tls)


def metadata_client(config: NodeConfig,
                    token: str | Callable[[], str] | None = None) -> MetadataClient:
    """The node's client of the metadata service: its own principal (the service lets it act
    only as itself), over TLS when the config names a CA."""
    assert config.metadata_address is not None, "no metadata service configured"
    return MetadataClient(config.metadata_address, token=token or config.bootstrap_token,
                          tls_ca_file=config.metadata_tls_ca,
                          tls_cert_file=config.metadata_tls_cert,
                          tls_key_file=config.metadata_tls_key,
                          tls_server_name=config.metadata_tls_server_name)


def registered_peers(client: MetadataClient) -> list[Peer]:
    """Every key the metadata service vouches for: live nodes' and routers'."""
    peers = [Peer(node_principal(n.node_id), n.curve_public_key.encode(), n.request_address,
                  n.kv_address, n.kv_session)
             for n in client.list_nodes() if n.curve_public_key]
    peers += [Peer(ROUTER_PREFIX + c.client_id, c.curve_public_key.encode(),
                  ticket_key=c.ticket_public_key)
              for c in client.list_clients()]
    return peers


class NodeRuntime:
    def __init__(self, config: NodeConfig, shared_keys: CurveKeys | None = None,
                 on_fatal: Callable[[Exception], None] | None = None) -> None:
        if shared_keys is None and (config.metadata_address is None
                                    or (config.bootstrap_token is None
                                        and config.identity_token_file is None)):
            raise ValueError(f"node {config.node_id}: a node needs a metadata service and its "
                             "bootstrap_token or identity_token_file (its identity comes "
                             "from there): it never serves strangers")
        self.config = config
        # one source for the node's clients, so that they share each exchange
        self._credential = node_credential(config) if config.metadata_address else None
        self.keys = shared_keys or CurveKeys.generate()  # its own pair never leaves this node
        self.directory = None if shared_keys is not None else self._directory()
        # A start that fails (a model that does not load, the node's port in use) leaves
        # nothing running behind it: no engine (vLLM's processes, Mooncake), no open port, no
        # admitted keys. Once it is whole, stop() ends each part.
        with ExitStack() as undo:
            undo.callback(self._close_directory)
            self.engine, self.kv_address, self.kv_session = make_engine(config, self.keys,
                                                                        self.directory)
            undo.callback(self.engine.close)
            self.server = NodeServer(self.engine, config.node_id, config.role, config.host,
                                     config.port, on_step=self._on_step, curve=self.keys,
                                     directory=self.directory, port_span=config.port_span,
                                     on_fatal=on_fatal)
            undo.callback(self.server.stop, drain=False, timeout_s=0)
            if self.directory is not None:  # itself, before the metadata service says so
                self.directory.grant(Peer(node_principal(config.node_id), self.keys.public,
                                          self.server.address, self.kv_address,
                                          self.kv_session))
            self.metrics = NodeMetrics(config.node_id, config.role)
            self.metrics.observe(self.engine)  # the engine thread has not started yet
            self.metrics_server = (None if config.metrics_port is None else
                                   MetricsServer(self.metrics.registry, config.host,
                                                 config.metrics_port))
            if self.metrics_server is not None:
                undo.callback(self.metrics_server.stop)
            self.events = self._publisher() if config.metadata_address else None
            undo.pop_all()

    @property
    def metrics_address(self) -> str:
        """Where the node's Prometheus metrics are served; "" when they are not."""
        return self.metrics_server.address if self.metrics_server is not None else ""

    def _directory(self) -> Directory:
        client = metadata_client(self.config, self._credential)
        return Directory(refresh=lambda: registered_peers(client))

    def _publisher(self) -> EventPublisherThread:
        cfg, engine = self.config, self.engine
        # how this node names its blocks, as its engine does (a vLLM node: vLLM's algorithm
        # and seed), and its model's tokenizer: the router routes to it only if they are
        # the cluster's (core.kv_identity)
        identity = KVIdentity.of(engine.block_size, engine.hash_config, cfg.model)
        info = make_node_info(cfg.node_id, cfg.role, request_address=self.server.address,
                              kv_address=self.kv_address, identity=identity,
                              metrics_address=self.metrics_address,
                              capacity_blocks=engine.num_kv_blocks,
                              curve_public_key=b"" if self.directory is None
                              else self.keys.public, kv_session=self.kv_session)
        return EventPublisherThread(metadata_client(cfg, self._credential), info,
                                    engine.cached_block_media, cfg.lease_ttl_s,
                                    cfg.publish_interval_s)

    def start(self, registration_timeout_s: float = 10.0) -> NodeRuntime:
        if self.events is not None:
            self.events.start()
            if not self.events.wait_registered(registration_timeout_s):
                logger.warning("node %s: metadata service not reachable yet; serving anyway, "
                               "registration retries in the background", self.config.node_id)
        if self.directory is not None:
            self.directory.refresh_now(force=True)
            self.directory.follow(DIRECTORY_REFRESH_S)
        self.server.start()
        return self

    def _on_step(self, engine: NodeEngine) -> None:
        if self.events is not None:
            self.events.put(engine.take_kv_events())
        stats = self.server.stats
        transfers = engine.take_transfer_latencies()
        self.metrics.observe(engine, stats.num_requests, stats.num_refused, transfers)
        self.server.spans.transfers(transfers)

    def reset_prefix_cache(self) -> bool:
        """Empty the node's prefix cache (the global index follows); False while busy."""
        return self.server.call(lambda engine: engine.reset_prefix_cache())

    def info(self) -> dict[str, str]:
        return {"node_id": self.config.node_id, "role": self.config.role,
                "request_address": self.server.address, "kv_address": self.kv_address,
                "metrics_address": self.metrics_address}

    def begin_drain(self) -> None:
        """Stop admitting (server.begin_drain) and tell the metadata service so."""
        self.server.begin_drain()
        if self.events is not None:
            self.events.begin_drain()

    def stop(self, drain: bool = True, timeout_s: float = 30.0) -> bool:
        if drain:
            self.begin_drain()
        drained = self.server.stop(drain=drain, timeout_s=timeout_s)
        if self.events is not None:
            self.events.stop(deregister=True)
        if self.metrics_server is not None:
            self.metrics_server.stop()
        self.engine.close()
        self._close_directory()
        return drained

    def _close_directory(self) -> None:
        if self.directory is not None:
            self.directory.close()
            forget_directory(self.directory)
