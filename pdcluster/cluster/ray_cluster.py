"""Launch the node actors on Ray (a local Ray started here, or the cluster a `ray job submit`
driver is attached to), with the metadata service they register with.

    cluster = RayCluster(ClusterConfig(model=path, num_prefill=1, num_decode=1),
                         cluster_secret=secret).start()   # None: a fresh one (all embedded)
    cluster.nodes()     # [{"node_id", "role", "request_address", "kv_address",
                        #   "metrics_address"}, ...]
    cluster.stop()      # drain the nodes, stop the embedded metadata service, shut Ray down

Ray restarts a crashed node actor up to `max_restarts` times; the new incarnation registers
with a new epoch, so the metadata service drops everything the old one held.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import TYPE_CHECKING

from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.node_actors import start_node_actor
from pdcluster.core.credentials import ClusterSecret

if TYPE_CHECKING:  # all three load only when the cluster starts
    from ray.actor import ActorHandle

    from pdcluster.metadata_service.server import ServerThread
    from pdcluster.node.actor import NodeActor

logger = logging.getLogger(__name__)
# Where a Ray that `serve` starts itself keeps its sessions (and the node actors' logs).
RAY_TEMP_DIR = os.path.join(tempfile.gettempdir(), "pdcluster-ray")


class RayCluster:
    def __init__(self, config: ClusterConfig, ray_address: str | None = None,
                 cluster_secret: ClusterSecret | None = None) -> None:
        if (cluster_secret is None and config.metadata_address is not None
                and config.node_identity_token_file is None):
            raise ValueError("a cluster using an external metadata service needs its cluster "
                             "secret ($PDCLUSTER_CLUSTER_SECRET or $PDCLUSTER_CLUSTER_SECRET_FILE)"
                             ", unless its nodes get their tokens for their pods' identity "
                             "(metadata.node_identity_token_file)")
        self.config = config
        # None: everything is embedded here, so a fresh secret that only this launcher knows;
        # with pod identity the nodes need none, and this launcher holds none
        self.cluster_secret: ClusterSecret | None = cluster_secret
        if cluster_secret is None and config.metadata_address is None:
            self.cluster_secret = ClusterSecret.generate()
        self.ray_address = ray_address  # None: start a local Ray; "auto": join a running one
        self.metadata_server: ServerThread | None = None
        self.metadata_address = config.metadata_address
        self.actors: dict[str, ActorHandle] = {}
        self.planner: ActorHandle | None = None  # owns the nodes once started (config.planner)
        self._started_ray = False

    def start(self, timeout_s: float = 300.0) -> RayCluster:
        if self.ray_address is None:
            # Keeps every Ray listener on 127.0.0.1 on a one-interface machine (measured: with
            # it unset, Ray binds the machine's one non-loopback interface even when given
            # --node-ip-address 127.0.0.1). Ray reads it once, when imported: set it first.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        import ray

        if not ray.is_initialized():
            self._init_ray(ray)
        if self.metadata_address is None:
            self._start_metadata()
        self._start_nodes(ray)
        ray.get([actor.ping.remote() for actor in self.actors.values()], timeout=timeout_s)
        if self.config.planner is not None:
            self._start_planner(ray)
        return self

    def _start_planner(self, ray) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from pdcluster.cluster.planner_actor import PlannerActor

        names = {node_id: f"pdcluster-{node_id}" for node_id in self.actors}
        # The planner derives the tokens of the nodes it starts from the cluster secret: it
        # runs on this driver's Ray node (the chart's head, the one pod holding the secret),
        # never on a worker, which holds none.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                              soft=False)
        self.planner = ray.remote(PlannerActor).options(
            name="pdcluster-planner", num_cpus=0, max_concurrency=8,
            scheduling_strategy=here).remote(
            self.config, self.metadata_address, self.cluster_secret, names)
        ray.get(self.planner.ping.remote(), timeout=60)

    def attach_router(self, base_url: str, api_key: str | None = None,
                      run_loop: bool = True) -> None:
        """Tell the planner (if any) where the router is (http://host:port): it reads its
        metrics and /health from there, and with `run_loop` starts deciding."""
        import ray

        if self.planner is not None:
            ray.get(self.planner.attach_router.remote(base_url, api_key, run_loop),
                    timeout=30)

    def _init_ray(self, ray) -> None:
        if self.ray_address is None:
            cpus = max(os.cpu_count() or 1, self._num_nodes() * self.config.node_cpus + 1)
            ray.init(num_cpus=int(cpus), include_dashboard=False, _node_ip_address="127.0.0.1",
                     _temp_dir=RAY_TEMP_DIR,
                     logging_level="WARNING", log_to_driver=False)
            self._started_ray = True
        else:
            ray.init(address=self.ray_address, logging_level="WARNING")

    def _num_nodes(self) -> int:
        started = self.config.num_prefill + self.config.num_decode
        planner = self.config.planner
        return started if planner is None else max(started, planner.most_nodes)

    def _start_metadata(self) -> None:
        from pdcluster.metadata_service.config import MetadataConfig
        from pdcluster.metadata_service.server import ServerThread

        assert self.cluster_secret is not None, "an embedded service gets a fresh secret"
        config = MetadataConfig(host="127.0.0.1", port=0, cluster_secret=self.cluster_secret)
        self.metadata_server = ServerThread(config).start()
        self.metadata_address = self.metadata_server.address

    def _start_nodes(self, ray) -> None:
        from pdcluster.decode_node.actor import DecodeNodeActor
        from pdcluster.prefill_node.actor import PrefillNodeActor

        roles: list[tuple[str, type[NodeActor]]] = []
        roles += [("p", PrefillNodeActor)] * self.config.num_prefill
        roles += [("d", DecodeNodeActor)] * self.config.num_decode
        counters = {"p": 0, "d": 0}
        for prefix, cls in roles:
            node_id = f"{prefix}{counters[prefix]}"
            counters[prefix] += 1
            self.actors[node_id] = self._actor(ray, cls, node_id)

    def _actor(self, ray, cls, node_id: str):
        assert self.metadata_address is not None, "the metadata service starts first"
        return start_node_actor(ray, cls, node_id, self.config, self.metadata_address,
                                self.cluster_secret)

    def router_clients(self) -> dict:
        """A `BlockingNodeClient` per node id, speaking as a router: a fresh key pair
        registered with the router's credential, each node's own public key as published
        (benchmarks and tests drive the nodes this way)."""
        import secrets

        from pdcluster.core.credentials import SERVICE, CurveKeys
        from pdcluster.core.tls import ClientTLS
        from pdcluster.metadata_service.client import MetadataClient
        from pdcluster.node.client import BlockingNodeClient

        assert self.metadata_address is not None, "start() the cluster first"
        if self.cluster_secret is None:
            raise ValueError("router_clients speak as the router: they need the cluster "
                             "secret, which this launcher does not hold")
        keys = CurveKeys.generate()
        token = self.cluster_secret.metadata_token(SERVICE)
        cfg = self.config
        tls = ClientTLS.from_fields(cfg.metadata_tls_ca, cfg.metadata_tls_cert,
                                    cfg.metadata_tls_key, cfg.metadata_tls_server_name)
        with MetadataClient(self.metadata_address, token=token, tls=tls) as client:
            client.register_client(f"driver-{secrets.token_hex(4)}", keys.public, 3600)
            nodes = client.list_nodes()
        return {n.node_id: BlockingNodeClient(n.request_address, curve=keys,
                                              server_key=n.curve_public_key.encode())
                for n in nodes}

    def nodes(self, timeout_s: float = 60.0) -> list[dict[str, str]]:
        import ray

        if self.planner is not None:
            return ray.get(self.planner.nodes.remote(), timeout=timeout_s)
        return ray.get([actor.info.remote() for actor in self.actors.values()],
                       timeout=timeout_s)

    def stop(self, drain_timeout_s: float = 30.0) -> None:
        import ray

        if self.planner is not None:  # it drains every node it holds, the first ones too
            try:
                ray.get(self.planner.shutdown.remote(drain_timeout_s),
                        timeout=drain_timeout_s * 2 + 30)
                self.actors.clear()
            except Exception as exc:  # the nodes are drained below instead
                logger.warning("the planner did not shut down cleanly: %s", exc)
            ray.kill(self.planner)
            self.planner = None
        pending = [actor.drain.remote(drain_timeout_s) for actor in self.actors.values()]
        try:
            ray.get(pending, timeout=drain_timeout_s + 10)
        except Exception as exc:  # a dead actor cannot drain; shutting down anyway
            logger.warning("some nodes did not drain: %s", exc)
        self.actors.clear()
        if self.metadata_server is not None:
            self.metadata_server.stop()
        if self._started_ray:
            ray.shutdown()

