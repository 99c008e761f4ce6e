"""`NodeConfig`: one node's settings, built once at the edge (launcher or actor) and
validated here."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pdcluster.core.roles import NODE_ROLES, role_names
from pdcluster.core.tls import ClientTLS
from pdcluster.engine.config import EngineConfig

_NODE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass(frozen=True, slots=True)
class NodeConfig:
    node_id: str
    role: str  # a core.roles.NODE_ROLES value: "prefill" | "decode"
    # The engine this node runs, model included, validated when built. The runtime sets
    # `enable_kv_events` itself (on exactly when there is a metadata service to publish to).
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0  # request endpoint; 0 picks a free port
    # with a port: bind the first free one of [port, port + port_span) (a fixed range that a
    # NetworkPolicy can admit the router to, several nodes of one pod taking one each)
    port_span: int = 1
    # Prometheus metrics at http://host:metrics_port/metrics (node/metrics.py); 0 picks a
    # free port, None serves none
    metrics_port: int | None = None
    metadata_address: str | None = None  # None: run without the global index
    # TLS to the metadata service (core.tls.ClientTLS): its CA; a client certificate and
    # key when it requires mTLS; the name in its certificate. All None: plaintext.
    metadata_tls_ca: str | None = None
    metadata_tls_cert: str | None = None
    metadata_tls_key: str | None = None
    metadata_tls_server_name: str | None = None
    # The node's bootstrap credential: the metadata-service token of principal node/<node_id>
    # (ClusterSecret.metadata_token), good for registering this id and nothing else. With it,
    # the node makes its own CURVE key pair, registers the public half and admits only the
    # routers and nodes the metadata service names (core.identity).
    bootstrap_token: str | None = field(default=None, repr=False)
    # Instead of a bootstrap_token, on Kubernetes: the pod's projected service-account token
    # file; the node gets its token from the metadata service for it (ExchangeNodeToken, bound
    # to the pod, renewed before it expires), so nothing that hands the node a token needs the
    # cluster secret (metadata_service/pod_token.py).
    identity_token_file: str | None = None
    lease_ttl_s: int = 10
    publish_interval_s: float = 0.05
    kv_protocol: str = "tcp"  # "rdma" on a GPU cluster
    kv_device: str = ""
    kv_timeout_s: float = 30.0
    recompute_on_failure: bool = True
    # Global prefix reuse: follow a router's PrefixSource hint only when it saves at least
    # this many blocks of compute (below it, the round trip costs more than computing).
    min_pull_blocks: int = 2

    def __post_init__(self) -> None:
        if self.role not in NODE_ROLES:
            raise ValueError(f"role must be one of {role_names(NODE_ROLES)}, got {self.role!r}")
        if not _NODE_ID.match(self.node_id):
            raise ValueError(f"node id {self.node_id!r} must match {_NODE_ID.pattern}")
        if not 0 <= self.port < 65536 or not 1 <= self.port_span <= 65536 - max(1, self.port):
            raise ValueError(f"ports [{self.port}, {self.port} + {self.port_span}) out of range")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics port {self.metrics_port} out of range")
        if self.lease_ttl_s < 1:
            raise ValueError("lease_ttl_s must be >= 1")
        if self.publish_interval_s <= 0 or self.kv_timeout_s <= 0:
            raise ValueError("publish_interval_s and kv_timeout_s must be > 0")
        if self.min_pull_blocks < 1:
            raise ValueError(f"min_pull_blocks must be >= 1, got {self.min_pull_blocks}")
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"engine must be an EngineConfig, got {type(self.engine).__name__}")
        if self.bootstrap_token is not None and not self.bootstrap_token.startswith(
                f"node/{self.node_id}:"):
            raise ValueError(f"node {self.node_id}: bootstrap_token is not a credential of "
                             f"principal node/{self.node_id}")
        if self.identity_token_file is not None and (self.bootstrap_token is not None
                                                     or self.metadata_address is None):
            raise ValueError(f"node {self.node_id}: identity_token_file gets the node's token "
                             "from the metadata service: it needs metadata_address and no "
                             "bootstrap_token")
        _ = self.metadata_tls  # ValueError for an inconsistent set of metadata_tls_* fields

    @property
    def model(self) -> str:
        return self.engine.model

    @property
    def metadata_tls(self) -> ClientTLS | None:
        return ClientTLS.from_fields(self.metadata_tls_ca, self.metadata_tls_cert,
                                     self.metadata_tls_key, self.metadata_tls_server_name)
