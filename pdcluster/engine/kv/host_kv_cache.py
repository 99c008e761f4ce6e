"""`HostKVCache`: the bytes of the KV cache's host tier, and the copies between it and the
device's paged cache (`engine.kv.kv_cache.PagedKVCache`). The bookkeeping is
`engine.core.kv_tiers.KVTiers`.

Layout: one tensor `[num_blocks, *block]` in host memory, each block laid out exactly as a
device block (all layers, all planes: one contiguous range), so a copy of a run of
consecutive blocks is one `copy_` of one contiguous range each way. A step's copies are
grouped into such runs (`copy_runs`): demotions first, then loads (engine/core/kv_tiers.py says
why). On CUDA the region is pinned and the copies run on a stream of their own, which the
compute stream waits for before the model runs: they overlap the step's batch preparation,
not its forward pass. On CPU the copies are plain memcpys on the engine's thread.

With a disk tier (`disk`, an `engine.kv.disk_kv_cache.DiskKVCache`) a step's spills run first:
each host slot the host evicted is staged (one block's bytes copied out) and queued for the
disk's writer thread, before a demotion of the same step reuses the slot; its disk loads run
last, read straight into the device blocks.

With tensor parallelism every rank holds such a host tier (and disk file) for its own slice of
the KV heads, with the same slot numbers; rank 0's `peers` (engine/runner/tp_workers.py) run
each step's copies on theirs as rank 0 runs them on its own, and report their disk writes
(`collect`), while the bookkeeping stays on rank 0.

Sizing (`host_tier_blocks`): `EngineConfig.host_cache_gib` of blocks, refused with a clear
`ValueError` when it is more than the host memory available (`/proc/meminfo`
`MemAvailable`, capped by the container's cgroup limit).

Cost: each step's loads are timed (`engine.core.kv_costs.CopyTimer`): bytes and seconds, from
which a node reports the host tier's bandwidth and latency to the router
(`router.routing.tier_costs`); a calibration copy at start gives the first figure before
any load.

API: `HostKVCache` (`collect`, `flush`, `apply`, `take_written`, `calibrate`, `close`),
`TierPeers`, `copy_runs`, `host_tier_blocks`, `available_host_bytes`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

import torch

from pdcluster.engine.core.kv_costs import CopyTimer
from pdcluster.engine.core.kv_tiers import KVTiers, TierCopies
from pdcluster.engine.core.tier_sizes import tier_blocks
from pdcluster.engine.kv.disk_kv_cache import DiskKVCache
from pdcluster.engine.kv.kv_cache import KVCacheSpec, PagedKVCache


class TierPeers(Protocol):
    """The other tensor-parallel ranks' host tiers, as rank 0 drives them
    (engine/runner/tp_workers.py's `StepPeers`; named here by what it does: kv/ sits below
    runner/ and may not import it)."""

    def copy_tiers(self, copies: TierCopies) -> None: ...

    def disk_written(self, wait: bool) -> list[tuple[bool, list[tuple[int, bool]]]]: ...


def copy_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) block pairs as (src start, dst start, length) runs of consecutive blocks on
    both sides, in order; pairs that step down on both sides (a chain demoted tail first)
    make a run too. Every block is copied once, so the order within a run is free."""
    runs: list[tuple[int, int, int]] = []
    step = 0  # +1 / -1: the direction of the last run; 0: it has one block
    for src, dst in pairs:
        if runs:
            s0, d0, n = runs[-1]
            if step >= 0 and src == s0 + n and dst == d0 + n:
                runs[-1], step = (s0, d0, n + 1), 1
                continue
            if step <= 0 and src == s0 - 1 and dst == d0 - 1:
                runs[-1], step = (src, dst, n + 1), -1
                continue
        runs.append((src, dst, 1))
        step = 0
    return runs


def available_host_bytes(meminfo: Path = Path("/proc/meminfo"),
                         cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Host memory this process may still take: the system's MemAvailable, capped by the
    room left under its cgroup's (v2) limit (a container's: MemAvailable shows the
    machine's); None where neither says."""
    available = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            room = int(limit) - int((cgroup / "memory.current").read_text())
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return available


def host_tier_blocks(host_cache_gib: float, num_host_blocks: int | None, block_nbytes: int,
                     available: int | None) -> int:
    """Blocks of the host tier (0: none); ValueError when they do not fit."""
    return tier_blocks("host", "host_cache_gib", host_cache_gib, num_host_blocks, block_nbytes,
                       available, "only {:.2f} GiB of host memory is available",
                       "lower host_cache_gib (hostCacheGiB in the chart)")


class HostKVCache:
    def __init__(self, device_cache: PagedKVCache, num_blocks: int) -> None:
        device = device_cache.tensor.device
        self.spec: KVCacheSpec = device_cache.spec
        self.num_blocks = num_blocks
        self.device_cache = device_cache
        # Zero-filled, though a slot is read only after a block was copied into it: the
        # pages are committed now (a tier that does not fit fails at start, not mid-serving)
        # and the first demotions do not pay a page fault per 4 KiB.
        self.tensor = torch.zeros((num_blocks, *device_cache.tensor.shape[1:]),
                                  dtype=device_cache.tensor.dtype,
                                  pin_memory=device.type == "cuda")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.loads = CopyTimer()
        self.demotions = CopyTimer()
        self.disk: DiskKVCache | None = None  # the disk tier below, if any
        self.peers: TierPeers | None = None  # the other tensor-parallel ranks' tiers, if any

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.spec.block_nbytes

    def collect(self, tiers: KVTiers, wait: bool = False) -> bool:
        """Tell the bookkeeping which disk writes finished, on every rank (before
        scheduling: a block written since the last step is a hit in this one). `wait`: first
        wait until every queued write finished (a reset); False when one did not in time."""
        if self.disk is None or not tiers.num_pending_spills:
            return True
        reports = [self.take_written(wait)]
        if self.peers is not None:
            reports += self.peers.disk_written(wait)
        for _, written in reports:
            tiers.writes_done(written)
        return all(drained for drained, _ in reports)

    def take_written(self, wait: bool = False) -> tuple[bool, list[tuple[int, bool]]]:
        """This rank's disk writes finished since the last call (`wait`: once every queued
        one has), and whether none is still queued."""
        assert self.disk is not None, "disk writes without a disk tier"
        drained = self.disk.drain() if wait else True
        return drained, self.disk.take_written()

    def flush(self, tiers: KVTiers) -> None:
        """Run the copies `tiers` queued this step, on every rank, then let their host slots
        go (a rank runs them before anything rank 0 sends it later: one ordered pipe)."""
        copies = tiers.take_copies()
        if copies:
            if self.peers is not None:  # the other ranks copy their slices meanwhile
                self.peers.copy_tiers(copies)
            self.apply(copies)
            tiers.copies_done(copies)

    def apply(self, copies: TierCopies) -> None:
        """Run one step's copies: every spill, every demotion, every load, every disk
        load."""
        block_nbytes, device = self.spec.block_nbytes, self.device_cache.tensor
        if copies.spills:
            self._spill(copies.spills)
        for pairs, timer, load in ((copies.demotions, self.demotions, False),
                                   (copies.loads, self.loads, True)):
            if not pairs:
                continue
            started = time.perf_counter()
            self._copy(copy_runs(pairs), device, load)
            if self._stream is None:  # on CUDA the copy is still running: calibration only
                timer.add(len(pairs) * block_nbytes, time.perf_counter() - started)
        if copies.disk_loads:
            assert self.disk is not None, "disk loads without a disk tier"
            self.disk.read_runs(copy_runs(copies.disk_loads), device)

    def _spill(self, spills: list[tuple[int, int]]) -> None:
        """Stage each (host slot, disk slot) spill's bytes and queue its write."""
        assert self.disk is not None, "spills without a disk tier"
        if self._stream is not None:  # earlier demotions into these slots may be in flight
            self._stream.synchronize()
        for host_slot, disk_slot in spills:
            self.disk.submit(disk_slot, self.tensor[host_slot].view(torch.uint8).numpy().copy())

    def _copy(self, runs: list[tuple[int, int, int]], device: torch.Tensor, load: bool) -> None:
        if self._stream is None:
            for src, dst, n in runs:
                if load:
                    device[dst:dst + n].copy_(self.tensor[src:src + n])
                else:
                    self.tensor[dst:dst + n].copy_(device[src:src + n])
            return
        # CUDA: after the work that wrote these blocks, before the work that reuses them
        compute = torch.cuda.current_stream(device.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            for src, dst, n in runs:
                if load:
                    device[dst:dst + n].copy_(self.tensor[src:src + n], non_blocking=True)
                else:
                    self.tensor[dst:dst + n].copy_(device[src:src + n], non_blocking=True)
        compute.wait_stream(self._stream)

    def calibrate(self, max_blocks: int = 8) -> None:
        """Time copies of 1 and of `max_blocks` blocks between the tiers, so the first load
        report has a measured figure. They run device -> host (free host slots; a load the
        other way would put the host's unset bytes into device blocks, which must stay
        finite), which crosses the same bus."""
        n = min(max_blocks, self.num_blocks, self.spec.num_blocks)
        for size in sorted({1, n}):
            for _ in range(2):
                started = time.perf_counter()
                self._copy([(0, 0, size)], self.device_cache.tensor, load=False)
                if self._stream is not None:
                    torch.cuda.synchronize(self.device_cache.tensor.device)
                self.loads.add(size * self.spec.block_nbytes, time.perf_counter() - started)

    def close(self) -> None:
        """Delete the disk tier's file, if any (the host tier is only memory)."""
        if self.disk is not None:
            self.disk.close()
