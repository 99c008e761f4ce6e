"""`RayFleet`: the node actors the live planner starts and retires on a Ray cluster (local, or
the one a `ray job submit` driver joined).

Starting a node is creating its actor (cluster.ray_cluster.start_node_actor): it registers
with the metadata service and the routers find it there. Retiring one keeps its cache:

1. `begin_drain`: the node refuses new requests and its load reports say `draining`; the
   routers stop sending it requests and hand its hottest prompts to peers that stay, which
   pull the blocks from it (router.routing.handoff).
2. Wait, up to `drain_timeout_s`, for the router's hand-off of that node to be done (its
   /health `draining` entry) and for the node to be idle (its streams finished).
3. `drain`: the node finishes whatever is left, deregisters (its blocks leave the index,
   its lease is released) and releases its engine; then its actor is killed.

A node still starting is killed at once (it holds nothing). Retiring runs on a thread of its
own, so the planner keeps deciding meanwhile; `retired` records each one's outcome.

API: `RayFleet`, `router_health_reader`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.node_actors import start_node_actor
from pdcluster.cluster.planner_signals import NodeLoad
from pdcluster.core.credentials import ClusterSecret

logger = logging.getLogger(__name__)
HANDOFF_WAIT_S = 30.0  # at most, of the drain timeout, for the router's hand-off
_PREFIX = {"prefill": "p", "decode": "d"}


def router_health_reader(base_url: str, api_key: str | None) -> Callable[[], dict]:
    """A reader of the router's detailed /health (`base_url`: http://host:port)."""
    def read() -> dict:
        request = urllib.request.Request(f"{base_url}/health")
        if api_key:
            request.add_header("Authorization", f"Bearer {api_key}")
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:  # 503 still carries the body
            return json.loads(exc.read() or b"{}")
    return read


class RayFleet:
    def __init__(self, config: ClusterConfig, metadata_address: str,
                 cluster_secret: ClusterSecret | None, actors: dict[str, Any],
                 drain_timeout_s: float = 120.0) -> None:
        self.config, self.metadata_address = config, metadata_address
        self.cluster_secret, self.drain_timeout_s = cluster_secret, drain_timeout_s
        self.actors = dict(actors)  # node id -> actor handle
        self.router_health: Callable[[], dict] | None = None
        self.retired: list[dict] = []
        self._leaving: set[str] = set()
        self._pings: dict[str, Any] = {}  # starting node -> its first ping's ObjectRef
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    @staticmethod
    def role_of(node_id: str) -> str:
        return "prefill" if node_id.startswith("p") else "decode"

    def serving(self, role: str) -> list[str]:
        with self._lock:
            return sorted((n for n in self.actors if self.role_of(n) == role
                           and n not in self._leaving), key=_index)

    def starting(self) -> set[str]:
        import ray

        with self._lock:
            pending = dict(self._pings)
        if pending:
            done, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=0)
            ready = {n for n, ref in pending.items() if ref in done}
            with self._lock:
                for node_id in ready:
                    self._pings.pop(node_id, None)
        with self._lock:
            return set(self._pings)

    def loads(self) -> list[NodeLoad]:
        import ray

        starting = self.starting()
        with self._lock:
            live = {n: a for n, a in self.actors.items()
                    if n not in self._leaving and n not in starting}
        reports = ray.get([a.load.remote() for a in live.values()], timeout=30)
        return [NodeLoad(node_id, self.role_of(node_id), r["queued_prefill_tokens"],
                         r["num_running"] + r["num_waiting"],
                         r["kv_costs"].prefill_tokens_per_s if r["kv_costs"] else None)
                for node_id, r in zip(live, reports, strict=True)]

    def start(self, role: str) -> str:
        import ray

        from pdcluster.decode_node.actor import DecodeNodeActor
        from pdcluster.prefill_node.actor import PrefillNodeActor

        with self._lock:
            taken = [_index(n) for n in self.actors if self.role_of(n) == role]
            taken += [_index(r["node_id"]) for r in self.retired
                      if self.role_of(r["node_id"]) == role]
            node_id = f"{_PREFIX[role]}{max(taken, default=-1) + 1}"
        cls = PrefillNodeActor if role == "prefill" else DecodeNodeActor
        handle = start_node_actor(ray, cls, node_id, self.config, self.metadata_address,
                                  self.cluster_secret)
        with self._lock:
            self.actors[node_id] = handle
            self._pings[node_id] = handle.ping.remote()
        logger.info("planner: started %s", node_id)
        return node_id

    def retire(self, node_id: str) -> None:
        with self._lock:
            self._leaving.add(node_id)
        thread = threading.Thread(target=self._retire, args=(node_id,), daemon=True,
                                  name=f"retire-{node_id}")
        self._threads.append(thread)
        thread.start()

    def _retire(self, node_id: str) -> None:
        import ray

        started = time.monotonic()
        handle = self.actors[node_id]
        outcome: dict[str, Any] = {"node_id": node_id, "drained": False, "handoff": None}
        try:
            if node_id not in self.starting():
                outcome.update(self._drain(handle, node_id))
        except Exception as exc:  # a node that cannot drain is released all the same
            logger.error("planner: %s did not drain cleanly: %s", node_id, exc)
            outcome["error"] = str(exc)
        finally:
            ray.kill(handle, no_restart=True)
            with self._lock:
                self.actors.pop(node_id, None)
                self._pings.pop(node_id, None)
                self._leaving.discard(node_id)
                outcome["seconds"] = round(time.monotonic() - started, 2)
                self.retired.append(outcome)
            logger.info("planner: retired %s: %s", node_id, outcome)

    def _drain(self, handle, node_id: str) -> dict[str, Any]:
        import ray

        deadline = time.monotonic() + self.drain_timeout_s
        ray.get(handle.begin_drain.remote(), timeout=30)
        handoff = self._wait_handoff(node_id, min(deadline, time.monotonic() + HANDOFF_WAIT_S))
        while time.monotonic() < deadline:  # its streams finish
            load = ray.get(handle.load.remote(), timeout=30)
            if not load["num_running"] and not load["num_waiting"]:
                break
            time.sleep(0.2)
        left = max(1.0, deadline - time.monotonic())
        drained = ray.get(handle.drain.remote(left), timeout=left + 30)
        return {"drained": bool(drained), "handoff": handoff}

    def _wait_handoff(self, node_id: str, deadline: float) -> dict | None:
        """The router's hand-off of `node_id` once done (None: no router, or timed out)."""
        if self.router_health is None:
            return None
        while time.monotonic() < deadline:
            try:
                entry = self.router_health().get("draining", {}).get(node_id)
            except OSError as exc:
                logger.warning("planner: router /health unreadable: %s", exc)
                entry = None
            if entry is not None and entry.get("handoff") == "done":
                return entry
            time.sleep(0.2)
        return None

    def wait_retired(self, timeout_s: float) -> None:
        """Wait for the retirements under way."""
        for thread in self._threads:
            thread.join(timeout_s)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Drain every node left (in parallel) and wait for retirements under way."""
        import ray

        self.wait_retired(timeout_s)
        with self._lock:
            handles = dict(self.actors)
            self.actors.clear()
        pending = [h.drain.remote(timeout_s) for h in handles.values()]
        try:
            ray.get(pending, timeout=timeout_s + 10)
        except Exception as exc:  # a dead actor cannot drain; shutting down anyway
            logger.warning("some nodes did not drain: %s", exc)

    def info(self) -> list[dict[str, str]]:
        import ray

        with self._lock:
            handles = [a for n, a in self.actors.items() if n not in self._leaving]
        return ray.get([a.info.remote() for a in handles], timeout=60)


def _index(node_id: str) -> int:
    return int(node_id[1:]) if node_id[1:].isdigit() else 0
