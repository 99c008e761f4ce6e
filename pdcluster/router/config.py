"""The router's one frozen configuration, built at the edge (CLI) and validated here.

API: `NodeSpec`, `RouterConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdcluster.core.credentials import ClusterSecret
from pdcluster.core.hashing import DEFAULT_HASH_CONFIG, HashConfig
from pdcluster.core.roles import Role, role_names
from pdcluster.core.tls import ClientTLS
from pdcluster.router.routing.baselines import ROUTINGS
from pdcluster.router.routing.policy import PolicyConfig


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """A node the router can send requests to (static, or discovered from the metadata
    service): its ZMQ request address and its KV side-channel address."""

    node_id: str
    role: str
    request_address: str
    kv_address: str = ""

    def __post_init__(self) -> None:
        if self.role not in tuple(Role):
            raise ValueError(f"node {self.node_id}: role must be one of {role_names()}")
        if not self.request_address:
            raise ValueError(f"node {self.node_id}: request_address is empty")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    model_dir: str
    model_name: str = ""  # served name; default: the model folder's name
    host: str = "127.0.0.1"
    port: int = 8000
    nodes: tuple[NodeSpec, ...] = ()
    metadata_address: str | None = None
    # TLS to the metadata service (core.tls.ClientTLS): the CA that signed its certificate;
    # a client certificate and key when it requires mTLS; the name to check in its
    # certificate when the address is not in it. All None: plaintext.
    metadata_tls_ca: str | None = None
    metadata_tls_cert: str | None = None
    metadata_tls_key: str | None = None
    metadata_tls_server_name: str | None = None
    # Required (None is refused below): the router's CURVE keys for the node sockets and its
    # metadata-service credential (principal SERVICE) derive from it.
    cluster_secret: ClusterSecret | None = None
    api_keys: tuple[str, ...] = ()
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # How the nodes name their blocks, so the router can name a prompt's: the own engine's
    # scheme, or vLLM's (core.vllm_hashing) when the nodes run vLLM.
    hash_config: HashConfig = DEFAULT_HASH_CONFIG
    # "kv": the policy (prefix hits and load); "round_robin" / "least_loaded": the cache-blind
    # baselines of router.routing.baselines, for benchmarks against the KV policy
    routing: str = "kv"
    max_body_bytes: int = 4 << 20
    # The HTTP edge (router.api.edge): a request head must arrive within header_timeout_s of the
    # connection opening or of the previous response (idle keep-alive connections close
    # then too), a body within body_timeout_s of its head; the longest request or header
    # line and the number of headers.
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    max_header_bytes: int = 8190
    max_headers: int = 128
    max_tokens_limit: int = 32768
    load_interval_s: float = 0.5
    node_timeout_s: float = 2.0
    metadata_timeout_s: float = 0.5
    metadata_retry_s: float = 1.0
    seed: int | None = None
    # times a request may move to another node when its decode node is lost mid-stream
    # (router.routing.migration); 0: the client gets the error
    max_migrations: int = 1
    # follow the metadata service's index in memory (WatchBlocks); False: one Query per request
    index_mirror: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got "
                             f"{self.routing!r}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if self.max_header_bytes < 256 or self.max_headers < 8:
            raise ValueError("max_header_bytes must be >= 256 and max_headers >= 8")
        for name in ("load_interval_s", "node_timeout_s", "metadata_timeout_s",
                     "metadata_retry_s", "header_timeout_s", "body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if len({n.node_id for n in self.nodes}) != len(self.nodes):
            raise ValueError("node ids must be unique")
        if any(not key for key in self.api_keys):
            raise ValueError("API keys must be non-empty")
        if not isinstance(self.cluster_secret, ClusterSecret):
            raise ValueError("cluster_secret (a ClusterSecret, core/credentials.py) is required: "
                             "the router reaches nodes and the metadata service with it")
        _ = self.metadata_tls  # ValueError for an inconsistent set of metadata_tls_* fields

    @property
    def secret(self) -> ClusterSecret:
        """`cluster_secret`, which `__post_init__` makes sure is there."""
        assert self.cluster_secret is not None, "RouterConfig refuses a router without a secret"
        return self.cluster_secret

    @property
    def metadata_tls(self) -> ClientTLS | None:
        return ClientTLS.from_fields(self.metadata_tls_ca, self.metadata_tls_cert,
                                     self.metadata_tls_key, self.metadata_tls_server_name)
