"""The other ranks of a tensor-parallel engine (ranks 1..N-1): processes the engine starts and
owns. Each holds its slice of the model (engine/models/parallel.py) and of the KV cache (its
KV heads, under the same block ids as rank 0's) and runs the same forward pass as rank 0 on the
step plan rank 0 sends it. Rank 0 keeps everything else: the scheduler, the block pool, the
sampler, the connector. With a KV connector each rank also runs the connector's agent
(`peers.start_agents(spec)`, engine/runner/tp_agents.py: its own transfer engine and its KV
region registered, writing its share of each transfer on a pipe of its own), so a rank's KV
heads move straight from its memory to a peer's. With a host KV tier each rank also holds a host
tier (and a disk file) of its own for its KV heads (`peers.start_tiers`), runs each step's
tier copies on it as rank 0 sends them (`peers.copy_tiers`, before that step's plan: the pipe
keeps the order) and reports its disk writes when asked (`peers.disk_written`); rank 0 keeps
the bookkeeping (engine/core/kv_tiers.py).

The group: a FileStore in a private temporary folder for the rendezvous (no listening socket),
gloo bound to 127.0.0.1 on CPU, NCCL on CUDA (rank r on the r-th device after rank 0's). A
step's plan crosses a pipe as msgpack (engine/runner/tp_wire.py, never pickle); the collectives
inside the forward pair the ranks up. A rank that dies surfaces as `TensorParallelError` at the
next step, one that stalls when the collectives' timeout runs out (`RankSpec.timeout_s`, the
engine's `tensor_parallel_timeout_s`): never a hang.

API: `TensorParallelError`, `RankSpec`, `StepPeers.start(spec, size)`, `peers.allocate_kv(spec)`,
`peers.start_agents(spec)`, `peers.start_tiers(...)`, `peers.copy_tiers(copies)`,
`peers.disk_written(wait)`, `peers.step(plan)`, `peers.capture(max_batch, max_model_len)`,
`peers.check()`, `peers.close()`, `make_group(rank, size, store_path, device, timeout_s)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import multiprocessing
import shutil
import tempfile
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import msgpack
import torch
import torch.distributed as dist

from pdcluster.core.kv_ranks import RankAgentSpec, RankEndpoint
from pdcluster.engine.core.failures import TensorParallelError
from pdcluster.engine.core.kv_tiers import TierCopies
from pdcluster.engine.kv.disk_kv_cache import DiskKVCache
from pdcluster.engine.kv.host_kv_cache import HostKVCache
from pdcluster.engine.kv.kv_cache import KVCacheSpec, PagedKVCache
from pdcluster.engine.models.parallel import TensorParallel
from pdcluster.engine.runner.inputs import StepPlan
from pdcluster.engine.runner.tp_agents import AgentHost, RankLinks
from pdcluster.engine.runner.tp_wire import decode_copies, decode_plan, encode_copies, encode_plan

logger = logging.getLogger(__name__)
__all__ = ["RANK_TIMEOUT_S", "RankSpec", "StepPeers", "TensorParallelError", "make_group"]

RANK_TIMEOUT_S = 120.0  # by default a collective (or a rank's answer) waits at most this long
_READY, _OK = b"ready", b"ok"


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a rank needs to build its slice of the model."""

    model: str
    dtype: str  # a torch dtype name, e.g. "float32"
    device: str  # rank 0's device; rank r takes the r-th after it on CUDA
    max_model_len: int
    load_format: str = "auto"
    threads: int = 1  # torch threads of each worker on CPU
    timeout_s: float = RANK_TIMEOUT_S  # a collective or a rank's answer, at most


def rank_device(device: str, rank: int) -> torch.device:
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def make_group(rank: int, size: int, store_path: str, device: torch.device,
               timeout_s: float = RANK_TIMEOUT_S) -> TensorParallel:
    """This rank's group: NCCL on CUDA, gloo on 127.0.0.1 elsewhere (blocks until all join);
    a collective that waits `timeout_s` for a rank raises."""
    store = dist.FileStore(store_path, size)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = timeout
        return TensorParallel(rank, size, dist.ProcessGroupNCCL(store, rank, size, nccl))
    # gloo's options type is not in torch's stubs (`_Options`); its device is what pins the
    # group's sockets to the loopback interface
    gloo = getattr(dist.ProcessGroupGloo, "_Options")()  # noqa: B009
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    gloo._timeout = timeout
    return TensorParallel(rank, size, dist.ProcessGroupGloo(store, rank, size, gloo))


class StepPeers:
    """Rank 0's handle on ranks 1..N-1: a step pipe each, and a pipe each for the KV
    connector's agent there (engine/runner/tp_agents.py)."""

    def __init__(self, processes: list, pipes: list[Connection], folder: str,
                 agent_pipes: list[Connection], timeout_s: float = RANK_TIMEOUT_S) -> None:
        self.processes, self.pipes, self.folder = processes, pipes, folder
        self.agent_pipes, self.timeout_s = agent_pipes, timeout_s
        self._finalizer = weakref.finalize(self, _stop, processes, pipes + agent_pipes, folder)

    @classmethod
    def start(cls, spec: RankSpec, size: int) -> tuple[StepPeers, TensorParallel]:
        """Start ranks 1..size-1 and join the group as rank 0 (returned). The ranks load
        their slices of the model concurrently with rank 0 once the group is up."""
        folder = tempfile.mkdtemp(prefix="pdcluster-tp-")
        store_path = str(Path(folder) / "store")
        context = multiprocessing.get_context("spawn")
        processes, pipes, agent_pipes = [], [], []
        payload = msgpack.packb(dataclasses.asdict(spec))
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            agent_ours, agent_theirs = context.Pipe()
            process = context.Process(target=_worker_main, name=f"pdcluster-tp-rank{rank}",
                                      args=(payload, rank, size, store_path, theirs,
                                            agent_theirs),
                                      daemon=True)
            process.start()
            theirs.close()
            agent_theirs.close()
            processes.append(process)
            pipes.append(ours)
            agent_pipes.append(agent_ours)
        peers = cls(processes, pipes, folder, agent_pipes, spec.timeout_s)
        try:
            tp = make_group(0, size, store_path, rank_device(spec.device, 0), spec.timeout_s)
        except RuntimeError as exc:
            peers.close()
            raise TensorParallelError(f"the tensor-parallel group did not form: {exc}") from exc
        return peers, tp

    def wait_ready(self) -> None:
        """Wait until every rank has loaded its slice of the model."""
        for rank, pipe in enumerate(self.pipes, start=1):
            self._expect(rank, pipe, _READY)

    def allocate_kv(self, spec: KVCacheSpec) -> None:
        """Every rank allocates its KV cache (this rank's heads, rank 0's block count)."""
        self._send({"op": "kv", "spec": dataclasses.asdict(spec)})
        for rank, pipe in enumerate(self.pipes, start=1):
            self._expect(rank, pipe, _OK)

    def start_agents(self, spec: RankAgentSpec) -> RankLinks:
        """Every rank builds the KV connector's agent `spec` names and registers its KV
        region with it (core.kv_ranks); rank 0's links to them."""
        self._send({"op": "agent", "factory": spec.factory, "options": spec.options})
        endpoints = []
        for rank, pipe in enumerate(self.pipes, start=1):
            self._expect(rank, pipe, _OK)
            endpoints.append(RankEndpoint(*msgpack.unpackb(pipe.recv_bytes())))
        return RankLinks(self.agent_pipes, endpoints)

    def start_tiers(self, host_blocks: int, disk_blocks: int, disk_dir: str | None) -> None:
        """Every rank allocates a host tier of `host_blocks` for its slice (and a disk file of
        `disk_blocks` in `disk_dir`), slot for slot rank 0's (engine/kv/host_kv_cache.py)."""
        self._send({"op": "tiers", "host_blocks": host_blocks, "disk_blocks": disk_blocks,
                    "disk_dir": disk_dir})
        for rank, pipe in enumerate(self.pipes, start=1):
            self._expect(rank, pipe, _OK)

    def copy_tiers(self, copies: TierCopies) -> None:
        """Every rank runs this step's tier copies on its slice."""
        self._send({"op": "copies", **encode_copies(copies)})

    def disk_written(self, wait: bool) -> list[tuple[bool, list[tuple[int, bool]]]]:
        """Each rank's `HostKVCache.take_written(wait)`, in rank order."""
        self._send({"op": "written", "wait": wait})
        reports = []
        for rank, pipe in enumerate(self.pipes, start=1):
            self._expect(rank, pipe, _OK)
            drained, written = msgpack.unpackb(pipe.recv_bytes())
            reports.append((drained, [(slot, ok) for slot, ok in written]))
        return reports

    def block_bytes(self, block_id: int) -> list[bytes]:
        """A copy of block `block_id` of ranks 1..N-1, in rank order (tests and debugging:
        call it between steps)."""
        self._send({"op": "block_bytes", "block": block_id})
        copies = []
        for rank, pipe in enumerate(self.pipes, start=1):
            self._expect(rank, pipe, _OK)
            copies.append(pipe.recv_bytes())
        return copies

    def capture(self, max_batch: int, max_model_len: int) -> None:
        """Every rank starts capturing its CUDA graphs (rank 0 captures alongside: the
        warm-up and captured forwards hold collectives)."""
        self._send({"op": "capture", "max_batch": max_batch, "max_model_len": max_model_len})

    def step(self, plan: StepPlan) -> None:
        self._send({"op": "step", **encode_plan(plan)})

    def check(self) -> None:
        """Raise `TensorParallelError` naming a rank that is no longer running."""
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                raise TensorParallelError(f"tensor-parallel rank {rank} exited "
                                          f"(exit code {process.exitcode})")

    def failed(self, exc: Exception) -> TensorParallelError:
        """The error to raise for a collective that failed: the rank that died (given a
        moment to finish exiting), else the collective's own error."""
        for process in self.processes:
            process.join(timeout=2 / len(self.processes))
        try:
            self.check()
        except TensorParallelError as dead:
            return dead
        return TensorParallelError(
            f"a tensor-parallel collective failed with every rank running (one that stalls "
            f"past tensor_parallel_timeout_s, {self.timeout_s:g} s, ends here): {exc}")

    def close(self) -> None:
        self._finalizer()

    def _send(self, message: dict) -> None:
        data = msgpack.packb(message)
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send_bytes(data)
            except OSError as exc:
                self.check()
                raise TensorParallelError(f"tensor-parallel rank {rank}: {exc}") from exc

    def _expect(self, rank: int, pipe: Connection, want: bytes) -> None:
        if not pipe.poll(self.timeout_s):
            self.check()
            raise TensorParallelError(f"tensor-parallel rank {rank} did not answer within "
                                      f"{self.timeout_s:g} s")
        try:
            got = pipe.recv_bytes()
        except (EOFError, OSError) as exc:
            self.check()
            raise TensorParallelError(f"tensor-parallel rank {rank}: {exc}") from exc
        if got != want:
            raise TensorParallelError(f"tensor-parallel rank {rank} failed:\n"
                                      f"{got.decode(errors='replace')}")


def _stop(processes: list, pipes: list[Connection], folder: str) -> None:
    for pipe in pipes:
        with contextlib.suppress(OSError):
            pipe.send_bytes(msgpack.packb({"op": "stop"}))
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
    for pipe in pipes:
        pipe.close()
    shutil.rmtree(folder, ignore_errors=True)


def _worker_main(payload: bytes, rank: int, size: int, store_path: str,
                 pipe: Connection, agent_pipe: Connection) -> None:
    """A rank's process: join the group, load this rank's slice, then run what rank 0 sends
    until it says stop. A failure is reported on the pipe (rank 0 raises it) and ends the
    process."""
    try:
        spec = RankSpec(**msgpack.unpackb(payload))
        device = rank_device(spec.device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(spec.threads)
        tp = make_group(rank, size, store_path, device, spec.timeout_s)
        _serve(spec, tp, device, pipe, agent_pipe)
    except Exception:  # reported to rank 0, which raises it as TensorParallelError
        logger.exception("tensor-parallel rank %d failed", rank)
        with contextlib.suppress(OSError):
            pipe.send_bytes(traceback.format_exc().encode())
        raise SystemExit(1) from None


def _serve(spec: RankSpec, tp: TensorParallel, device: torch.device, pipe: Connection,
           agent_pipe: Connection) -> None:
    from pdcluster.engine.models.loader import load_model
    from pdcluster.engine.models.model_config import ModelConfig
    from pdcluster.engine.runner.model_runner import ModelRunner

    dtype = getattr(torch, spec.dtype)
    model = load_model(spec.model, ModelConfig.from_pretrained(spec.model), dtype, device,
                       spec.max_model_len, dummy=spec.load_format == "dummy", tp=tp)
    pipe.send_bytes(_READY)
    runner: ModelRunner | None = None
    agent: AgentHost | None = None
    host: HostKVCache | None = None
    while True:
        message = msgpack.unpackb(pipe.recv_bytes())
        op = message["op"]
        if op == "stop":
            if agent is not None:
                agent.close()
            if host is not None:
                host.close()
            return
        if op == "kv":
            kv = PagedKVCache(KVCacheSpec(**message["spec"]), dtype, device)
            runner = ModelRunner(model, kv, device)
            pipe.send_bytes(_OK)
            continue
        assert runner is not None, "the KV cache is allocated before any step"
        if op == "agent":
            agent, endpoint = AgentHost.start(
                RankAgentSpec(message["factory"], message["options"]), runner.kv_cache,
                agent_pipe, host)
            pipe.send_bytes(_OK)
            pipe.send_bytes(msgpack.packb([endpoint.session, endpoint.base_addr,
                                           endpoint.host_addr]))
        elif op == "block_bytes":
            pipe.send_bytes(_OK)
            pipe.send_bytes(runner.kv_cache.block_bytes(message["block"]))
        elif op == "capture":
            runner.capture_graphs(message["max_batch"], message["max_model_len"])
        elif op in ("tiers", "copies", "written"):
            host = _tier_op(message, runner.kv_cache, host, pipe)
        elif op == "step":
            runner.forward(decode_plan(message))


def _tier_op(message: dict, kv_cache: PagedKVCache, host: HostKVCache | None,
             pipe: Connection) -> HostKVCache:
    """Rank 0's `start_tiers`, `copy_tiers` or `disk_written` on this rank's own host tier
    (returned)."""
    op = message["op"]
    if op == "tiers":
        host = HostKVCache(kv_cache, message["host_blocks"])
        if message["disk_blocks"]:
            host.disk = DiskKVCache.create(message["disk_dir"], 0.0, message["disk_blocks"],
                                           kv_cache.spec.block_nbytes)
        pipe.send_bytes(_OK)
        return host
    assert host is not None, "the host tier is allocated before its copies"
    if op == "copies":
        host.apply(decode_copies(message))
    else:
        drained, written = host.take_written(message["wait"])
        pipe.send_bytes(_OK)
        pipe.send_bytes(msgpack.packb([drained, written]))
    return host
