"""`DiskKVCache`: the bytes of the KV cache's disk tier, below the host tier (the bookkeeping is
`engine.core.kv_tiers.KVTiers`, its LRU a `HostBlockPool` of disk slots).

Layout: ONE preallocated file of fixed-size slots, one block each, laid out as a host block
(all layers, all planes: one contiguous range). One file rather than a file per block: a slot
is an offset, so a write is one `os.pwrite` and a read of a run of consecutive slots is one
`os.preadv` straight into the destination blocks; no file is created, named, listed or
unlinked per block, no directory grows, and the size bound is the file's size, reserved at
start (`posix_fallocate`), so the tier cannot run out of disk mid-serving.

Writes (spills of blocks the host tier evicts) run on a writer thread, off the engine step:
the step copies the host slot's bytes into a staging buffer and queues it; the bookkeeping
bounds how many writes may be pending (`KVTiers.max_pending_spills`) and drops a spill
rather than wait when that many are. The writer reports each slot written (or failed)
through `take_written`, which the engine thread drains before it schedules. Reads (disk
hits loaded back) run on the engine thread before the model runs: a prefix they hold must
be in the device blocks by then.

Restart safety: nothing on disk is ever trusted. Each engine creates its own new file
(`kv-<pid>-<random>.bin`, mode 0600) in its own subfolder `kv-disk/` of `disk_cache_dir`
(default: `core.paths.cache_dir()`), holds an exclusive `flock` on it for its life, and at
start deletes every other `kv-*.bin` there whose lock it can take (its owner is gone);
`close` deletes its own. The bookkeeping starts empty, so a restarted node never serves a
block a previous process wrote, and two nodes (processes, or engines of one process) never
share a file. The subfolder is made 0700 (`core.paths.private_dir`: not the umask's mode,
and not the folder the user named, which may hold anything else), and refused when it is a
symlink, another user's, or writable by group or others: whoever can write it could plant a
link where a file is made or deleted.

Cost: reads are timed (`CopyTimer`); a calibration at start writes then reads 1 and 8 slots,
so the first load report has a figure (both include the page cache, as real reads do).

API: `DiskKVCache` (`submit`, `take_written`, `read_runs`, `drain`, `close`, `calibrate`),
`disk_tier_blocks`, `default_disk_dir`, `disk_dir`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

from pdcluster.core.paths import cache_dir, private_dir
from pdcluster.engine.core.kv_costs import CopyTimer
from pdcluster.engine.core.tier_sizes import tier_blocks

logger = logging.getLogger(__name__)
_GIB = 2**30


_SUBFOLDER = "kv-disk"


def default_disk_dir() -> Path:
    return cache_dir() / _SUBFOLDER


def disk_dir(folder: str | None) -> Path:
    """The tier's own subfolder of `folder` (default: the cache dir), made 0700;
    `core.paths.UnsafeDirectory` (a ValueError) when it cannot be kept private."""
    return private_dir((Path(folder) if folder else cache_dir()) / _SUBFOLDER)


def disk_tier_blocks(disk_cache_gib: float, num_disk_blocks: int | None, block_nbytes: int,
                     free_bytes: int | None) -> int:
    """Blocks of the disk tier (0: none); ValueError when they do not fit the free space."""
    return tier_blocks("disk", "disk_cache_gib", disk_cache_gib, num_disk_blocks, block_nbytes,
                       free_bytes, "its directory has only {:.2f} GiB free",
                       "lower disk_cache_gib (diskCacheGiB in the chart) or point "
                       "disk_cache_dir elsewhere")


def _wipe_stale(folder: Path) -> None:
    """Delete the block files of engines that are gone (their flock is free)."""
    for path in folder.glob("kv-*.bin"):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # a live engine holds it
            continue
        path.unlink(missing_ok=True)
        os.close(fd)


class DiskKVCache:
    def __init__(self, folder: Path, num_blocks: int, block_nbytes: int) -> None:
        """Use `create` (it wipes the folder and checks the size first)."""
        self.num_blocks, self.block_nbytes = num_blocks, block_nbytes
        # A new, empty file per engine (two engines of one process never share one either)
        self._fd, name = tempfile.mkstemp(prefix=f"kv-{os.getpid()}-", suffix=".bin",
                                          dir=folder)
        self.path = Path(name)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            os.posix_fallocate(self._fd, 0, num_blocks * block_nbytes)
        except OSError as e:
            self.close()
            raise ValueError(f"the disk KV tier could not reserve "
                             f"{num_blocks * block_nbytes / _GIB:.2f} GiB in {folder}: {e}"
                             ) from e
        self.loads = CopyTimer()
        self.num_write_errors = 0
        self._queue: queue.SimpleQueue[tuple[int, np.ndarray] | None] = queue.SimpleQueue()
        self._written: deque[tuple[int, bool]] = deque()
        self._idle = threading.Condition()
        self._num_queued = 0
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer",
                                        daemon=True)
        self._writer.start()

    @classmethod
    def create(cls, folder: str | None, disk_cache_gib: float, num_disk_blocks: int | None,
               block_nbytes: int, num_ranks: int = 1) -> DiskKVCache:
        """Wipe what dead engines left in the folder, refuse a size its free space cannot
        hold (ValueError), then make the file. With tensor parallelism `disk_cache_gib` holds
        every rank's file: `num_ranks` slices of `block_nbytes` per block."""
        path = disk_dir(folder)
        _wipe_stale(path)
        num_blocks = disk_tier_blocks(disk_cache_gib, num_disk_blocks, block_nbytes * num_ranks,
                                      shutil.disk_usage(path).free)
        return cls(path, num_blocks, block_nbytes)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    # ---- writes (the writer thread) ---------------------------------------------------

    def submit(self, slot: int, staged: np.ndarray) -> None:
        """Queue one block's bytes for `slot` (`KVTiers` bounds how many are pending)."""
        with self._idle:
            self._num_queued += 1
        self._queue.put((slot, staged))

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            slot, staged = item
            ok = True
            try:
                view = staged.data.cast("B")
                done = 0
                while done < len(view):
                    done += os.pwrite(self._fd, view[done:], slot * self.block_nbytes + done)
            except OSError as exc:  # e.g. a full disk: the block is dropped, not retried
                logger.error("writing KV block slot %d to %s failed: %s", slot, self.path, exc)
                ok = False
            self._written.append((slot, ok))
            with self._idle:
                self._num_queued -= 1
                self._idle.notify_all()

    def take_written(self) -> list[tuple[int, bool]]:
        """(slot, written?) of each write finished since the last call."""
        done: list[tuple[int, bool]] = []
        while self._written:
            done.append(self._written.popleft())
        self.num_write_errors += sum(1 for _, ok in done if not ok)
        return done

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write finished (reset, tests); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._num_queued == 0, timeout_s)

    # ---- reads (the engine thread) ----------------------------------------------------

    def read_runs(self, runs: list[tuple[int, int, int]], device: torch.Tensor) -> None:
        """(disk slot start, device block start, n) runs into the device's blocks: one
        `preadv` per run, straight into them on CPU, through a host buffer on CUDA."""
        started, total = time.perf_counter(), 0
        for src, dst, n in runs:
            target = device[dst:dst + n]
            buffer = target if target.device.type == "cpu" else torch.empty(
                target.shape, dtype=target.dtype, pin_memory=True)
            self._read_into(src, buffer)
            if buffer is not target:
                target.copy_(buffer)
            total += n * self.block_nbytes
        self.loads.add(total, time.perf_counter() - started)

    def _read_into(self, slot: int, buffer: torch.Tensor) -> None:
        view = buffer.view(torch.uint8).numpy().data.cast("B")
        done, offset = 0, slot * self.block_nbytes
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"short read of the disk KV tier at slot {slot}: {self.path}")
            done += got

    def calibrate(self, max_blocks: int = 8) -> None:
        """Write then read 1 and `max_blocks` slots, timing the reads (scratch buffers: no
        block is touched; the slots stay unused in the bookkeeping)."""
        n = min(max_blocks, self.num_blocks)
        for size in sorted({1, n}):
            scratch = torch.ones(size * self.block_nbytes, dtype=torch.uint8)
            os.pwrite(self._fd, scratch.numpy().data, 0)
            for _ in range(2):
                started = time.perf_counter()
                self._read_into(0, scratch)
                self.loads.add(size * self.block_nbytes, time.perf_counter() - started)

    def close(self) -> None:
        """Stop the writer and delete the file (nothing on it outlives the engine)."""
        writer = getattr(self, "_writer", None)
        if writer is not None and writer.is_alive():
            self._queue.put(None)
            writer.join(timeout=30)
        if self._fd >= 0:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = -1
