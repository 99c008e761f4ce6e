"""The router's one frozen configuration, built at the edge (CLI) and validated here.

API: `NodeSpec`, `RouterConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdcluster.core.kv_identity import KVIdentity
from pdcluster.core.roles import Role, role_names
from pdcluster.core.tls import ClientTLS
from pdcluster.router.planning.admission import AdmissionConfig
from pdcluster.router.routing.baselines import ROUTINGS
from pdcluster.router.routing.policy import PolicyConfig
from pdcluster.router.tenants import MIN_SALT_KEY_BYTES, ApiKeys


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """A node the router can send requests to (static, or discovered from the metadata
    service): its ZMQ request address and its KV side-channel address."""

    node_id: str
    role: str
    request_address: str
    kv_address: str = ""
    curve_public_key: bytes = b""  # the node's own key (Z85); b"": the shared-key test mode
    # the KV identity it registered (router.routing.identity checks it against the cluster's);
    # None: a static node, which the operator vouches for
    identity: KVIdentity | None = None

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
    # more addresses the public API listens on, on the same port: in a pod, 127.0.0.1 beside
    # the pod's IP (`host`), so that `kubectl port-forward` (which dials the pod's loopback)
    # reaches it without a wildcard listener
    also_listen: tuple[str, ...] = ()
    nodes: tuple[NodeSpec, ...] = ()
    metadata_address: str | None = None
    # TLS to the metadata service (core.tls.ClientTLS): the CA that signed its certificate;
    # a client certificate and key when it requires mTLS; the name to check in its
    # certificate when the address is not in it. All None: plaintext.
    metadata_tls_ca: str | None = None
    metadata_tls_cert: str | None = None
    metadata_tls_key: str | None = None
    metadata_tls_server_name: str | None = None
    # The router's client credential: its metadata-service token (principal SERVICE: read the
    # index, register this router's key; never act as a node). The router makes its own CURVE
    # key pair and registers it, so that nodes admit it. It holds no cluster secret.
    metadata_token: str | None = field(default=None, repr=False)
    # "tenant:key" or "key" entries (router.tenants): a tenant's requests share a KV
    # cache with nobody else's
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # the key tenants' cache salts are keyed with (router.tenants): the same in every router
    # replica of a cluster; None: one of this process's own (a warning; the CLI refuses)
    cache_salt_key: bytes | None = field(default=None, repr=False)
    # /metrics and the detailed /health without a key, on their own listener (keep it off
    # the Ingress); None: the public port serves them behind the API key
    admin_port: int | None = None
    admin_host: str = "127.0.0.1"
    # the routing policy; its block_size stays unset: the router routes with the cluster's
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # The cluster's KV identity (core.kv_identity: block size, hash algorithm and seed, model,
    # tokenizer digest), when the launcher knows it (cluster.yaml); None: taken from the
    # nodes' registrations (router.routing.identity). The router has no block size or hash
    # scheme of its own: it hashes prompts the way the cluster's nodes name their blocks.
    cluster_identity: KVIdentity | None = None
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
    # route on a node's block claims only where this router gave the node those tokens
    # (router.routing.attestations); False trusts every member's claims (docs/security.md)
    attest_claims: bool = True
    # admission by predicted TTFT (router.planning.admission): shed (429) or hold requests
    # whose prediction is over their priority class's limit; None: admit everything
    admission: AdmissionConfig | None = None

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
        if any(not address or address == self.host for address in self.also_listen) \
                or len(set(self.also_listen)) != len(self.also_listen):
            raise ValueError(f"also_listen must name addresses other than host ({self.host}), "
                             f"each once, got {self.also_listen}")
        if self.admin_port is not None and not 0 <= self.admin_port < 65536:
            raise ValueError(f"admin_port must be in [0, 65536), got {self.admin_port}")
        if self.metadata_address is not None and not self.metadata_token:
            raise ValueError("a router with a metadata service needs its metadata_token (the "
                             "client credential of principal 'service')")
        if self.policy.block_size:
            raise ValueError("policy.block_size is not the router's to set: it routes with the "
                             "block size of the cluster's KV identity (the nodes' "
                             "registrations, or cluster_identity)")
        if self.cluster_identity is not None and self.cluster_identity.problems():
            raise ValueError("cluster_identity: "
                             + "; ".join(self.cluster_identity.problems().values()))
        ApiKeys(self.api_keys)  # ValueError for a malformed entry
        if self.cache_salt_key is not None and len(self.cache_salt_key) < MIN_SALT_KEY_BYTES:
            raise ValueError(f"cache_salt_key must hold at least {MIN_SALT_KEY_BYTES} bytes")
        _ = self.metadata_tls  # ValueError for an inconsistent set of metadata_tls_* fields

    @property
    def metadata_tls(self) -> ClientTLS | None:
        return ClientTLS.from_fields(self.metadata_tls_ca, self.metadata_tls_cert,
                                     self.metadata_tls_key, self.metadata_tls_server_name)
