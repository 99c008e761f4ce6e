"""The KV connector's agents in the ranks of a tensor-parallel engine (core.kv_ranks), over a
pipe of their own beside each rank's step pipe (engine/runner/tp_workers.py).

- `AgentHost` (in rank r >= 1's process): builds the connector's agent there, registers the
  rank's KV region with it, and runs the writes rank 0 sends on threads of its own, so the
  rank's main thread keeps stepping the model meanwhile; each write is answered, done or
  failed, on the same pipe.
- `RankLinks` (rank 0's `KVRanks`): sends each rank its writes and resolves their futures as
  the answers come (a reader thread per rank). A rank whose pipe closes — its process died —
  fails every write it had under way and every later one with `TensorParallelError`: the
  transfer fails (the requester recomputes), and the engine's next step raises too.

Messages are msgpack maps; addresses are plain integers (never pickle).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection

import msgpack

from pdcluster.core.kv_connector import KVRegion
from pdcluster.core.kv_ranks import (
    KVRankAgent,
    KVRanks,
    RankAgentSpec,
    RankEndpoint,
    load_rank_agent,
)
from pdcluster.engine.core.failures import TensorParallelError
from pdcluster.engine.kv.host_kv_cache import HostKVCache
from pdcluster.engine.kv.kv_cache import PagedKVCache

logger = logging.getLogger(__name__)
_PARALLEL_WRITES = 2  # a rank's writes under way at once (rank 0's connector sends 2)


class AgentHost:
    """Rank r's agent and the thread serving its pipe."""

    def __init__(self, agent: KVRankAgent, pipe: Connection) -> None:
        self.agent, self.pipe = agent, pipe
        self._send_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(_PARALLEL_WRITES, thread_name_prefix="kv-rank-write")
        self._thread = threading.Thread(target=self._serve, name="kv-rank-agent", daemon=True)

    @classmethod
    def start(cls, spec: RankAgentSpec, kv_cache: PagedKVCache, pipe: Connection,
              host_tier: HostKVCache | None = None) -> tuple[AgentHost, RankEndpoint]:
        """The agent built and this rank's region registered (with its host tier, so a peer's
        pull can be served from there); where peers reach it."""
        kv = kv_cache.spec
        agent = load_rank_agent(spec)
        region = KVRegion(kv_cache.data_ptr(), kv.total_nbytes, kv.block_nbytes, kv.num_blocks,
                          host_addr=host_tier.tensor.data_ptr() if host_tier else 0,
                          num_host_blocks=host_tier.num_blocks if host_tier else 0)
        session = agent.register(region)
        host = cls(agent, pipe)
        host._thread.start()
        return host, RankEndpoint(session, region.base_addr, region.host_addr)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.agent.close()

    def _serve(self) -> None:
        while True:
            try:
                message = msgpack.unpackb(self.pipe.recv_bytes())
            except (EOFError, OSError):  # rank 0 is gone or closed the group
                return
            if message.get("op") == "stop":  # the group closes (tp_workers' stop)
                return
            try:
                self._pool.submit(self._write, message)
            except RuntimeError:  # closed meanwhile: the rank is stopping
                return

    def _write(self, message: dict) -> None:
        error = None
        try:
            self.agent.write(message["session"], message["src"], message["dst"],
                             message["lengths"])
        except Exception as exc:  # reported to rank 0, which fails the transfer
            logger.warning("KV write of this tensor-parallel rank failed: %s", exc)
            error = f"{type(exc).__name__}: {exc}"
        with self._send_lock, contextlib.suppress(OSError):
            self.pipe.send_bytes(msgpack.packb({"id": message["id"], "error": error}))


class RankLinks(KVRanks):
    """Rank 0's links to the agents of ranks 1..N-1 (`pipes[r - 1]`, `endpoints[r - 1]`)."""

    def __init__(self, pipes: list[Connection], endpoints: list[RankEndpoint]) -> None:
        self._pipes, self._endpoints = pipes, endpoints
        self._lock = threading.Lock()  # the pending writes and dead ranks
        self._send_locks = [threading.Lock() for _ in pipes]
        self._ids = itertools.count()
        self._pending: list[dict[int, Future[None]]] = [{} for _ in pipes]
        self._dead: list[str | None] = [None for _ in pipes]
        for rank in range(1, len(pipes) + 1):
            threading.Thread(target=self._read, args=(rank,), name=f"kv-rank{rank}-answers",
                             daemon=True).start()

    @property
    def endpoints(self) -> list[RankEndpoint]:
        return list(self._endpoints)

    def write(self, rank: int, session: str, src: list[int], dst: list[int],
              lengths: list[int]) -> Future[None]:
        future: Future[None] = Future()
        with self._lock:
            dead = self._dead[rank - 1]
            if dead is not None:
                future.set_exception(_rank_error(rank, dead))
                return future
            write_id = next(self._ids)
            self._pending[rank - 1][write_id] = future
        message = msgpack.packb({"id": write_id, "session": session, "src": src, "dst": dst,
                                 "lengths": lengths})
        try:
            with self._send_locks[rank - 1]:
                self._pipes[rank - 1].send_bytes(message)
        except OSError as exc:
            with self._lock:
                self._fail_rank(rank, f"is unreachable: {exc}")
        return future

    def _read(self, rank: int) -> None:
        pipe = self._pipes[rank - 1]
        while True:
            try:
                answer = msgpack.unpackb(pipe.recv_bytes())
            except (EOFError, OSError):
                with self._lock:
                    self._fail_rank(rank, "exited")
                return
            with self._lock:
                future = self._pending[rank - 1].pop(answer["id"], None)
            if future is None:
                continue
            if answer["error"] is None:
                future.set_result(None)
            else:
                future.set_exception(RuntimeError(f"rank {rank}: {answer['error']}"))

    def _fail_rank(self, rank: int, why: str) -> None:
        """Every write of `rank` under way fails, and every later one (lock held)."""
        self._dead[rank - 1] = why
        pending, self._pending[rank - 1] = self._pending[rank - 1], {}
        for future in pending.values():
            future.set_exception(_rank_error(rank, why))


def _rank_error(rank: int, why: str) -> Exception:
    return TensorParallelError(f"tensor-parallel rank {rank} {why}")
