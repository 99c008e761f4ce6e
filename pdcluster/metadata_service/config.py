"""The metadata service's configuration: one frozen dataclass, built once at the edge (CLI or
a test) and validated here. Values computed at run time are never written back into it.

API: ``MetadataConfig``, ``BACKENDS``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdcluster.core.credentials import ClusterSecret
from pdcluster.core.tls import ClientTLS
from pdcluster.metadata_service.node_tokens import PodIdentityConfig

BACKENDS = ("memory", "etcd")
HASH_SIZES = (16, 32)


@dataclass(frozen=True, slots=True)
class MetadataConfig:
    host: str = "127.0.0.1"
    port: int = 50061  # 0: any free port (the server reports the one it bound)
    backend: str = "memory"
    etcd_endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    etcd_prefix: str = "/pdcluster/metadata"
    hash_size: int = 32  # bytes per block hash: 32 for sha256, 16 for xxh3_128
    default_lease_ttl_s: int = 10
    min_lease_ttl_s: int = 1  # etcd itself rounds a TTL up to its own minimum (about 2 s)
    max_lease_ttl_s: int = 300
    max_batch_events: int = 4096
    max_batch_hashes: int = 65536
    max_snapshot_hashes: int = 1_000_000
    max_query_blocks: int = 16384
    # WatchBlocks: hashes queued for one subscriber before it is cut off (it resubscribes and
    # gets a fresh snapshot); bounds the service's memory per slow subscriber (32 MB at 32 B).
    watch_max_pending_hashes: int = 1_000_000
    # etcd persistence: at most one write per node per flush interval, whatever the event rate.
    flush_interval_s: float = 0.25
    compact_after_deltas: int = 64
    etcd_timeout_s: float = 2.0
    # etcd's client TLS (its CA; a client certificate when etcd runs --client-cert-auth), and
    # etcd's own auth: a user whose role may read and write only etcd_prefix (etcd_access.py).
    etcd_tls: ClientTLS | None = None
    etcd_user: str | None = None
    etcd_password: str | None = field(default=None, repr=False)
    # etcd's simple tokens expire (--auth-token-ttl, 300 s by default) and vanish when etcd
    # restarts: the store authenticates again this often, and whenever etcd was unreachable.
    etcd_reauth_interval_s: float = 60.0
    health_interval_s: float = 0.5
    sweep_interval_s: float = 0.2  # memory backend: how often expired leases are swept
    # Every call must present a token derived from this secret (core.credentials); a node's
    # token lets it act only as itself. Required unless allow_unauthenticated.
    cluster_secret: ClusterSecret | None = None
    # Also accepted as principal "service" (the router's client credential), so that a
    # router can be given a random token instead of one derived from the secret (the chart)
    router_token: str | None = field(default=None, repr=False)
    # Unit tests of this room only: no credentials checked. No product entry point sets it.
    allow_unauthenticated: bool = False
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # mTLS: require a client certificate signed by this CA (PEM) on every connection; the
    # token is still required on every call (the certificate authenticates the connection,
    # the token the principal).
    tls_client_ca_file: str | None = None
    # mTLS: a client certificate's role (its common name: cert_roles.py) must match the
    # principal its token names, so one kind of pod's token is refused over another's cert
    tls_bind_client_roles: bool = False
    replica_id: str = ""  # empty: a random one per process
    # Which node ids may register, per role name ("prefill", "decode"); None: any id. The
    # chart lists the ids its launcher starts, so a stolen way to mint node tokens cannot add
    # nodes (a fake node with no load would attract traffic).
    node_allowlist: Mapping[str, frozenset[str]] | None = None
    # At most this many live nodes per role name (absent: no limit): with a planner, whose node
    # ids are new on every start, the bound on how many nodes any token can add.
    max_nodes: Mapping[str, int] | None = None
    # Blocks one node may hold in the index: its declared capacity_blocks times this factor
    # (its host and disk tiers hold more than its device), never above max_node_blocks (also
    # the cap of a node that declares none). Bounds what one member adds to the index, etcd
    # and every router's mirror.
    node_capacity_factor: int = 64
    max_node_blocks: int = 1_000_000
    # Kubernetes: issue node tokens to pods of the release's Ray service account against
    # their projected service-account tokens (node_tokens.py), for ids the allowlist names
    # (or, without one, of a role max_nodes bounds). None: no node tokens are issued here.
    pod_identity: PodIdentityConfig | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.hash_size not in HASH_SIZES:
            raise ValueError(f"hash_size must be one of {HASH_SIZES}, got {self.hash_size}")
        if self.backend == "etcd" and not self.etcd_endpoints:
            raise ValueError("the etcd backend needs at least one etcd endpoint")
        if not self.etcd_prefix.startswith("/") or self.etcd_prefix.endswith("/"):
            raise ValueError(f"etcd_prefix must start and not end with '/': {self.etcd_prefix!r}")
        if not 1 <= self.min_lease_ttl_s <= self.default_lease_ttl_s <= self.max_lease_ttl_s:
            raise ValueError(
                "lease TTLs must satisfy 1 <= min_lease_ttl_s <= default_lease_ttl_s <= "
                f"max_lease_ttl_s, got {self.min_lease_ttl_s}, {self.default_lease_ttl_s}, "
                f"{self.max_lease_ttl_s}"
            )
        for name in ("max_batch_events", "max_batch_hashes", "max_snapshot_hashes",
                     "max_query_blocks", "compact_after_deltas", "watch_max_pending_hashes",
                     "node_capacity_factor", "max_node_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("flush_interval_s", "etcd_timeout_s", "health_interval_s",
                     "sweep_interval_s", "etcd_reauth_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if (self.etcd_user is None) != (self.etcd_password is None):
            raise ValueError("etcd auth needs both etcd_user and etcd_password, or neither")
        if self.etcd_user is not None and not (self.etcd_user and self.etcd_password):
            raise ValueError("etcd_user and etcd_password must not be empty")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("TLS needs both tls_cert_file and tls_key_file, or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file (mTLS) needs TLS: tls_cert_file and "
                             "tls_key_file")
        if self.tls_bind_client_roles and (self.tls_client_ca_file is None
                                           or self.allow_unauthenticated):
            raise ValueError("tls_bind_client_roles binds client certificates to tokens: it "
                             "needs mTLS (tls_client_ca_file) and credentials")
        if self.allow_unauthenticated:
            if self.cluster_secret is not None:
                raise ValueError("give cluster_secret or allow_unauthenticated, not both")
        elif not isinstance(self.cluster_secret, ClusterSecret):
            raise ValueError("the metadata service needs cluster_secret (a ClusterSecret, "
                             "core/credentials.py): it never answers a caller without "
                             "credentials")

        for name in ("node_allowlist", "max_nodes"):
            if not set(getattr(self, name) or ()) <= {"prefill", "decode"}:
                raise ValueError(f"{name} is keyed by the roles 'prefill' and 'decode', got "
                                 f"{sorted(getattr(self, name))}")
        if self.pod_identity is not None and self.cluster_secret is None:
            raise ValueError("pod_identity issues tokens signed with cluster_secret: it needs "
                             "one (and credentials checked)")
        if any(n < 0 for n in (self.max_nodes or {}).values()):
            raise ValueError(f"max_nodes must be >= 0 per role, got {dict(self.max_nodes or {})}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def node_block_cap(self, capacity_blocks: int) -> int:
        """The most blocks a node that declared `capacity_blocks` may hold in the index."""
        if capacity_blocks <= 0:
            return self.max_node_blocks
        return min(self.max_node_blocks, capacity_blocks * self.node_capacity_factor)

    def node_token_refusal(self, role: str, node_id: str) -> str | None:
        """Why a node token for `node_id` in `role` may not be issued here, or None: its id
        must be on the allowlist, or, without one, its role's live count bounded."""
        if self.node_allowlist is not None:
            if node_id in self.node_allowlist.get(role, frozenset()):
                return None
            return (f"node id {node_id!r} is not on the {role} allowlist of this metadata "
                    "service (--allow-nodes)")
        if self.max_nodes is not None and role in self.max_nodes:
            return None
        return (f"this metadata service bounds no {role} node ids (neither --allow-nodes nor "
                f"--max-nodes for {role}): it issues no {role} node tokens")

    def clamp_ttl(self, requested_s: int) -> int:
        if requested_s <= 0:
            return self.default_lease_ttl_s
        return max(self.min_lease_ttl_s, min(self.max_lease_ttl_s, requested_s))
