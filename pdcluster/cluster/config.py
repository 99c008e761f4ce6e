"""`ClusterConfig`: the whole cluster's settings — what `pdcluster serve` flags and the Helm
chart's `cluster.yaml` both turn into. Validated once here, passed down explicitly.

cluster.yaml:
    model: /models/name
    num_prefill: 2
    num_decode: 2
    engine: {dtype: bfloat16, block_size: 16, max_num_seqs: 64, max_num_batched_tokens: 2048,
             speculative: "ngram:k=4",         # speculative decoding: decode nodes only
             host_cache_gib: 16,               # the KV host tier per node (own engine)
             disk_cache_gib: 256,              # the KV disk tier below it (own engine)
             backend: pdcluster}               # or vllm: every node runs vLLM (docs/engines.md),
                                               # with tensor_parallel_size, gpu_memory_utilization
    transfer: {protocol: rdma, device_name: "", timeout_s: 30}
    metadata: {address: "metadata:50061",      # absent: an embedded in-memory service
               tls_ca: /tls/ca.crt,            # TLS to it (router and nodes); absent: plaintext
               tls_cert: /tls/client.crt, tls_key: /tls/client.key,   # mTLS client cert
               tls_server_name: metadata,      # name in its certificate, if not the address's
               node_identity_token_file: /var/run/secrets/pdcluster-node-identity/token}
                                               # nodes trade their pod's projected token for
                                               # their own (Kubernetes): no secret in the launcher
    router: {host: 0.0.0.0, port: 8000, enabled: true,   # false: a router runs elsewhere
             routing: kv,                      # or round_robin / least_loaded (baselines)
             admission: {slo_ttft_s: 2, mode: reject,   # or queue (router.planning.admission)
                         max_queue_s: 10, tenant_priorities: {batch: low}},
             tenant_limits: {max_requests: 64, max_tokens: 262144,  # in flight per tenant
                             tenants: {batch: {max_requests: 8}}}}  # router.planning
    planner: {enabled: true, ...}              # scale each role live (cluster/planner_settings.py)
    node: {gpus: 1,                            # GPUs per tensor-parallel rank
           tensor_parallel_size: {prefill: 2, decode: 1},   # per role (or one int for both;
                                               # absent: engine.tensor_parallel_size, else 1);
                                               # a node actor takes gpus x its role's size
           max_restarts: 3, lease_ttl_s: 10, local_prefill_threshold_tokens: 32,
           metrics_port: 9400,                 # Prometheus /metrics per node; 0: a free port
           request_port: 9500, request_ports: 4,  # each node binds a free one of 9500-9503
           global_reuse_min_tokens: 512,        # pull a cached prefix this long; 0: never
           role_resource_prefix: pdcluster_}   # actors ask for Ray resource <prefix><role>
    host: auto                                 # nodes bind and publish $POD_IP (or 127.0.0.1)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdcluster.cluster.planner_settings import PlannerSettings
from pdcluster.core.roles import Role
from pdcluster.core.tls import ClientTLS, MetadataTLSFields
from pdcluster.engine.config import EngineConfig
from pdcluster.router.planning.admission import AdmissionConfig
from pdcluster.router.planning.tenant_limits import TenantLimits
from pdcluster.router.routing.baselines import ROUTINGS

# Uncached prompt tokens up to which the decode node prefills itself. Low, because on a CPU
# prefill is dear and moving KV is cheap: SmolLM2-135M, the built-in model, prefills ~4.4
# ms/token here (README, "Performance"), while its KV is 46 KB/token (~0.05 ms/token over
# loopback TCP) plus ~1 ms of handshake. So only a short follow-up turn (the decode node
# holding the rest) stays local, and a first chat turn (~40 tokens) uses the prefill node. The
# Helm chart (GPU prefill) sets its own, higher value.
LOCAL_PREFILL_THRESHOLD_TOKENS = 32

_SECTIONS = {"model", "num_prefill", "num_decode", "engine", "transfer", "metadata", "router",
             "node", "host", "planner"}
_ADMISSION_KEYS = {"slo_ttft_s", "mode", "max_queue_s", "tenant_priorities",
                   "default_priority", "header"}
_METADATA_KEYS = {"address", "tls_ca", "tls_cert", "tls_key", "tls_server_name",
                  "node_identity_token_file"}


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    model: str
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"  # where nodes bind their endpoints; "auto": $POD_IP or 127.0.0.1
    engine: dict[str, Any] = field(default_factory=dict)
    kv_protocol: str = "tcp"
    kv_device: str = ""
    kv_timeout_s: float = 30.0
    metadata_address: str | None = None  # None: start an in-memory service in the launcher
    # TLS to an external metadata service, for the router and every node (core.tls.ClientTLS)
    metadata_tls_ca: str | None = None
    metadata_tls_cert: str | None = None
    metadata_tls_key: str | None = None
    metadata_tls_server_name: str | None = None
    # Each node gets its own token from the metadata service for its pod's projected
    # service-account token in this file (metadata_service/pod_token.py), instead of from the
    # launcher: the launcher then needs no cluster secret for the nodes. None: the launcher
    # derives each node's token from the secret.
    node_identity_token_file: str | None = None
    router_host: str = "127.0.0.1"
    router_port: int = 8000
    router_enabled: bool = True
    routing: str = "kv"  # router.routing.baselines.ROUTINGS
    node_metrics_port: int | None = None  # each node's Prometheus port; 0: free; None: none
    # each node's request port: the first free one of [port, port + ports); 0: any free port
    node_request_port: int = 0
    node_request_ports: int = 1
    node_gpus: float = 0.0  # per tensor-parallel rank: an actor takes this x its TP size
    node_cpus: float = 1.0
    # Tensor parallelism per role (None: the engine section's tensor_parallel_size, else 1):
    # prefill and decode may differ, the KV connector maps heads between them (docs/transfer.md)
    prefill_tensor_parallel_size: int | None = None
    decode_tensor_parallel_size: int | None = None
    max_restarts: int = 3
    lease_ttl_s: int = 10  # each node's lease with the metadata service
    local_prefill_threshold_tokens: int = LOCAL_PREFILL_THRESHOLD_TOKENS
    global_reuse_min_tokens: int = 512  # 0: prefilling nodes never pull a prefix
    role_resource_prefix: str | None = None
    planner: PlannerSettings | None = None  # None: the node counts stay as started
    admission: AdmissionConfig | None = None  # the router's admission by predicted TTFT
    tenant_limits: TenantLimits = field(default_factory=TenantLimits)  # the router's, per tenant

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError("need at least one decode node (and zero or more prefill nodes)")
        planner = self.planner
        if planner is not None and not (
                planner.min_prefill <= self.num_prefill <= planner.max_prefill
                and planner.min_decode <= self.num_decode <= planner.max_decode):
            raise ValueError("with the planner, num_prefill and num_decode (what starts) must "
                             "lie within its [min, max] per role")
        if self.max_restarts < 0 or self.node_gpus < 0 or self.node_cpus < 0:
            raise ValueError("max_restarts, node_gpus and node_cpus must be >= 0")
        if self.lease_ttl_s < 1:
            raise ValueError(f"lease_ttl_s must be >= 1, got {self.lease_ttl_s}")
        if self.local_prefill_threshold_tokens < 0 or self.global_reuse_min_tokens < 0:
            raise ValueError("local_prefill_threshold_tokens and global_reuse_min_tokens "
                             "must be >= 0")
        if not 0 < self.router_port < 65536:
            raise ValueError(f"router port {self.router_port} out of range")
        for role in (Role.PREFILL, Role.DECODE):  # every node's, checked at load
            EngineConfig.from_options(self.model, self.engine_options(role))
        if self.node_metrics_port is not None and not 0 <= self.node_metrics_port < 65536:
            raise ValueError(f"node metrics port {self.node_metrics_port} out of range")
        if not (0 <= self.node_request_port < 65536 and self.node_request_ports >= 1
                and self.node_request_port + self.node_request_ports <= 65536):
            raise ValueError(f"node request ports [{self.node_request_port}, "
                             f"+{self.node_request_ports}) out of range")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got "
                             f"{self.routing!r}")
        if self.kv_protocol not in ("tcp", "rdma"):
            raise ValueError(f"transfer protocol must be tcp or rdma, got {self.kv_protocol!r}")
        tls = ClientTLS.from_fields(self.metadata_tls_ca, self.metadata_tls_cert,
                                    self.metadata_tls_key, self.metadata_tls_server_name)
        if tls is not None and self.metadata_address is None:
            raise ValueError("metadata TLS settings need an external metadata service (its "
                             "address): the embedded one serves plaintext on 127.0.0.1")
        if self.node_identity_token_file is not None and self.metadata_address is None:
            raise ValueError("node_identity_token_file trades a pod's token at an external "
                             "metadata service (its address); the embedded one issues none")

    @property
    def engine_config(self) -> EngineConfig:
        """The nodes' engine (one backend per cluster): the router names a prompt's blocks
        with its block size and hash scheme."""
        return EngineConfig.from_options(self.model, self.engine)

    def engine_options(self, role: str) -> dict[str, Any]:
        """EngineConfig keywords for a node of `role`. Speculative decoding runs on decode
        nodes only: a prefill node emits one token per request, nothing to speculate on."""
        options = dict(self.engine)
        if role != Role.DECODE:
            options.pop("speculative", None)
        size = self.decode_tensor_parallel_size if role == Role.DECODE \
            else self.prefill_tensor_parallel_size
        if size is not None:
            options["tensor_parallel_size"] = size
        return options

    def tensor_parallel_size(self, role: str) -> int:
        """Ranks of a node of `role` (what its actor's GPUs are multiplied by)."""
        return int(self.engine_options(role).get("tensor_parallel_size", 1))

    def node_gpus_of(self, role: str) -> float:
        """GPUs a node actor of `role` asks Ray for: one set per tensor-parallel rank, all
        on one Ray node (a node's ranks are processes of its actor)."""
        return self.node_gpus * self.tensor_parallel_size(role)

    def metadata_tls_fields(self) -> MetadataTLSFields:
        """The `metadata_tls_*` fields, as RouterConfig and NodeConfig take them."""
        return {"metadata_tls_ca": self.metadata_tls_ca,
                "metadata_tls_cert": self.metadata_tls_cert,
                "metadata_tls_key": self.metadata_tls_key,
                "metadata_tls_server_name": self.metadata_tls_server_name}

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterConfig:
        import yaml

        data = yaml.safe_load(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterConfig:
        unknown = set(data) - _SECTIONS
        if unknown:
            raise ValueError(f"unknown cluster config keys: {sorted(unknown)}")
        transfer, node = data.get("transfer") or {}, data.get("node") or {}
        router, metadata = data.get("router") or {}, data.get("metadata") or {}
        unknown = set(metadata) - _METADATA_KEYS  # a mistyped tls_ca would mean plaintext
        if unknown:
            raise ValueError(f"unknown metadata config keys: {sorted(unknown)}")
        engine = {k: v for k, v in (data.get("engine") or {}).items() if v is not None}
        return cls(
            model=data["model"], num_prefill=data.get("num_prefill", 1),
            num_decode=data.get("num_decode", 1), host=data.get("host", "127.0.0.1"),
            engine=engine, kv_protocol=transfer.get("protocol", "tcp"),
            kv_device=transfer.get("device_name", ""),
            kv_timeout_s=transfer.get("timeout_s", 30.0),
            metadata_address=metadata.get("address"),
            metadata_tls_ca=metadata.get("tls_ca"), metadata_tls_cert=metadata.get("tls_cert"),
            metadata_tls_key=metadata.get("tls_key"),
            metadata_tls_server_name=metadata.get("tls_server_name"),
            node_identity_token_file=metadata.get("node_identity_token_file"),
            router_host=router.get("host", "127.0.0.1"), router_port=router.get("port", 8000),
            router_enabled=router.get("enabled", True), routing=router.get("routing", "kv"),
            node_metrics_port=node.get("metrics_port"),
            node_request_port=node.get("request_port", 0),
            node_request_ports=node.get("request_ports", 1),
            role_resource_prefix=node.get("role_resource_prefix"),
            node_gpus=node.get("gpus", 0.0), node_cpus=node.get("cpus", 1.0),
            **_tensor_parallel(node.get("tensor_parallel_size")),
            max_restarts=node.get("max_restarts", 3),
            lease_ttl_s=node.get("lease_ttl_s", 10),
            local_prefill_threshold_tokens=node.get("local_prefill_threshold_tokens",
                                                    LOCAL_PREFILL_THRESHOLD_TOKENS),
            global_reuse_min_tokens=node.get("global_reuse_min_tokens", 512),
            planner=PlannerSettings.from_dict(data.get("planner") or {}),
            admission=_admission(router.get("admission")),
            tenant_limits=TenantLimits.from_dict(router.get("tenant_limits") or {}))


def _tensor_parallel(value: int | dict[str, int] | None) -> dict[str, int | None]:
    """`node.tensor_parallel_size`: one size for both roles, or {prefill: N, decode: M}."""
    if value is None:
        return {}
    if isinstance(value, int):
        return {"prefill_tensor_parallel_size": value, "decode_tensor_parallel_size": value}
    if not isinstance(value, dict) or not set(value) <= {Role.PREFILL, Role.DECODE}:
        raise ValueError("node.tensor_parallel_size is a size or {prefill: N, decode: M}, "
                         f"got {value!r}")
    return {f"{role}_tensor_parallel_size": value[role] for role in value}


def _admission(data: dict[str, Any] | None) -> AdmissionConfig | None:
    """The router's `admission:` section (absent: admit everything)."""
    if not data:
        return None
    unknown = set(data) - _ADMISSION_KEYS
    if unknown:
        raise ValueError(f"unknown admission config keys: {sorted(unknown)}")
    fields = dict(data)
    fields["tenant_priorities"] = tuple((fields.get("tenant_priorities") or {}).items())
    return AdmissionConfig(**fields)
