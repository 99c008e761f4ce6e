"""`NodeActor`: the body of a node's Ray actor, kept Ray-free. `prefill_node` and
`decode_node` subclass it with their role, and the launcher wraps them with `ray.remote`."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, ClassVar

from pdcluster.engine.api import NodeEngine
from pdcluster.engine.config import EngineConfig
from pdcluster.node.config import NodeConfig
from pdcluster.node.runtime import NodeRuntime

logger = logging.getLogger(__name__)
POD_IP_ENV = "POD_IP"
# A node actor whose engine is lost exits with this code: Ray restarts an actor whose process
# died, not one that returned
ENGINE_LOST_EXIT = 75
_FLUSH_S = 0.5  # ZMQ sends the frames queued before the exit on its own threads
_STOP_S = 15.0


def _transfer_stats(engine: NodeEngine) -> dict[str, Any]:
    return {**engine.transfer_counters(), "recent_write_s": engine.recent_write_times()}


class NodeActor:
    role: ClassVar[str]

    def __init__(self, node_id: str, model: str, **options: Any) -> None:
        # The launcher hands each node its own bootstrap credential (the token of principal
        # node/<node_id>, good for registering that id only) as a constructor option: Ray
        # keeps constructor arguments out of logs and the dashboard, unlike a runtime_env.
        # Only the launcher issues them: a worker holds no secret to derive one from (the
        # chart mounts the cluster secret on the Ray head alone), so none is looked for.
        if options.get("host") == "auto":  # this pod's address on a cluster, loopback here
            options["host"] = os.environ.get(POD_IP_ENV) or "127.0.0.1"
        engine = EngineConfig.from_options(model, options.pop("engine_options", None) or {})
        # one pair shared by every member (NodeRuntime's shared_keys): tests and benchmarks
        shared_keys = options.pop("shared_keys", None)
        self.runtime = NodeRuntime(NodeConfig(node_id=node_id, role=self.role, engine=engine,
                                              **options), shared_keys=shared_keys,
                                   on_fatal=self._engine_lost).start()

    def _engine_lost(self, error: Exception) -> None:
        """The engine is lost for good (a tensor-parallel rank died or stalls; the server has
        failed every request): exit, so that Ray restarts this actor (up to its
        max_restarts) with a fresh engine. Off the server thread, which is still returning."""
        threading.Thread(target=self._exit_for_restart, name="node-restart", daemon=True).start()

    def _exit_for_restart(self) -> None:
        time.sleep(_FLUSH_S)  # the errors just queued reach the router and peers first
        try:  # deregister (the index drops this node's blocks) and stop the engine's ranks
            self.runtime.stop(drain=False, timeout_s=_STOP_S)
        except Exception:  # exiting anyway: a restart is the remedy
            logger.exception("node %s: stopping before its restart failed",
                             self.runtime.config.node_id)
        os._exit(ENGINE_LOST_EXIT)

    def info(self) -> dict[str, str]:
        return self.runtime.info()

    def load(self) -> dict[str, Any]:
        report = self.runtime.server.load_report()
        return {name: getattr(report, name) for name in report.__dataclass_fields__}

    def transfer_stats(self) -> dict[str, Any]:
        """The KV connector's running totals (`WorkerStats` by name) and the durations of its
        recent writes (`recent_write_s`)."""
        return self.runtime.server.call(_transfer_stats)

    def pool_state(self) -> dict[str, int]:
        """For leak checks: blocks free, in total, held by requests, and pinned requests."""
        return self.runtime.server.call(lambda engine: engine.pool_state())

    def cached_block_hashes(self) -> list[bytes]:
        """Every block hash in the prefix cache, read on the engine's thread: what the global
        index should say this node holds (fault benchmarks compare the two)."""
        return self.runtime.server.call(lambda engine: list(engine.cached_block_hashes()))

    def pid(self) -> int:
        """The actor's process id, for fault injection (signals) by benchmarks and tests."""
        return os.getpid()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache between benchmark runs; False while requests run."""
        return self.runtime.reset_prefix_cache()

    def ping(self) -> bool:
        return True

    def begin_drain(self) -> None:
        """Stop admitting (new requests get "draining", load reports say so: routers stop
        sending and hand this node's hot prefixes to peers, which pull them from here);
        running requests, transfers and pulls go on; the metadata service's index marks it
        draining. `drain` then finishes the job."""
        self.runtime.begin_drain()

    def load_summary(self) -> dict[str, Any]:
        """What the planner reads: the load report and the blocks its requests hold."""
        return {**self.load(), "pool": self.pool_state()}

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Stop admitting, finish running requests and transfers, deregister."""
        return self.runtime.stop(drain=True, timeout_s=timeout_s)

