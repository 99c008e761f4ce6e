"""The machine side of `bench peers`: its limits, measured in the same run, and how busy it is.

- `machine_limits(threads)`: fp32 matmul GFLOP/s; copy bandwidth (bytes copied per second,
  each counted once, as before); read bandwidth (a `sum` over a tensor far larger than the
  caches: bytes read per second). Decode streams weights and only reads them, so decode
  bandwidth use divides by the read bandwidth (a copy reads and writes every byte: STREAM
  counts it twice, and the figure here once, so it sits about 2x below the read rate).
  Each is the best of a few tries: neighbours' noise lowers no limit.
- `LoadGate`: before the run, waits (up to `wait_s`) for the 1-minute load average to drop to
  `max_load`, and refuses the run (`UsageError`) when it does not, unless `allow_busy`, which
  runs and flags the result. During the run, `LoadMonitor` measures two things about the
  processes outside the bench's own tree: the cores they used (CPU time from `/proc/stat`
  minus the bench's own, per second of wall time: a steady figure that no sampling instant
  can miss) and how many of their threads were runnable (`procs_running` minus the bench's
  own running threads, sampled: it also sees neighbours waiting for a core). A repeat where
  either averages more than `BUSY_THREADS` is flagged.

Torch is imported lazily (the gate and the monitor need none).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pdcluster.cluster.cli_common import UsageError

# A repeat during which other processes used (or kept runnable) this many cores on average is
# flagged.
BUSY_THREADS = 0.5
_TICKS = os.sysconf("SC_CLK_TCK")


def machine_limits(threads: int, matmul_n: int = 2048, stream_mib: int = 512) -> dict:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(matmul_n, matmul_n), torch.randn(matmul_n, matmul_n)
    src = torch.ones(stream_mib * 2**20 // 4)
    dst = torch.empty_like(src)
    torch.mm(a, b), dst.copy_(src), src.sum()  # first touch and warm-up
    matmul = min(_seconds(lambda: torch.mm(a, b)) for _ in range(5))
    copy = min(_seconds(lambda: dst.copy_(src)) for _ in range(5))
    read = min(_seconds(lambda: src.sum()) for _ in range(5))
    nbytes = src.numel() * src.element_size()
    return {"matmul_gflops": 2 * matmul_n**3 / matmul / 1e9, "copy_gb_per_s": nbytes / copy / 1e9,
            "read_gb_per_s": nbytes / read / 1e9}


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass(frozen=True, slots=True)
class LoadGate:
    max_load: float
    wait_s: float = 0.0
    allow_busy: bool = False

    @classmethod
    def for_threads(cls, threads: int, max_load: float | None, wait_s: float,
                    allow_busy: bool) -> LoadGate:
        """Default limit: the load that still leaves `threads` cores free, plus half a core."""
        if max_load is None:
            max_load = max(0.5, (os.cpu_count() or 1) - threads + 0.5)
        return cls(max_load, wait_s, allow_busy)

    def check(self, loadavg=os.getloadavg, sleep=time.sleep, poll_s: float = 5.0) -> dict:
        """Wait for a quiet machine; returns the load seen and whether the run is flagged."""
        waited = 0.0
        load = loadavg()[0]
        while load > self.max_load and waited < self.wait_s:
            sleep(poll_s)
            waited += poll_s
            load = loadavg()[0]
        busy = load > self.max_load
        if busy and not self.allow_busy:
            raise UsageError(
                f"machine busy: 1-minute load average {load:.2f} > {self.max_load:.2f} after "
                f"{waited:.0f} s; figures would measure the neighbours. Wait for a quiet "
                "machine (--wait-quiet SECONDS), raise --max-load, or pass --allow-busy to run "
                "and flag the result")
        return {"load_avg_1m_at_start": round(load, 2), "max_load": self.max_load,
                "waited_s": waited, "busy_at_start": busy}


class LoadMonitor:
    """Samples, in a daemon thread, the CPU used and the threads runnable outside the bench."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self._interval = interval_s
        self._samples: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-monitor", daemon=True)
        self._since = self._cpu_now()

    def __enter__(self) -> LoadMonitor:
        self._since = self._cpu_now()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def window(self) -> dict:
        """Figures since the last call (one repeat), and the 1-minute load average now."""
        now = self._cpu_now()
        with self._lock:
            samples, self._samples = self._samples, []
            since, self._since = self._since, now
        wall = now[0] - since[0]
        other_ticks = (now[1] - since[1]) - (now[2] - since[2])
        cores = max(0.0, other_ticks / _TICKS / wall) if wall > 0 else 0.0
        runnable = sum(samples) / len(samples) if samples else 0.0
        return {"other_cpu_cores": round(cores, 2), "other_runnable_threads": round(runnable, 2),
                "samples": len(samples), "load_avg_1m": round(os.getloadavg()[0], 2),
                "busy": max(cores, runnable) > BUSY_THREADS}

    @staticmethod
    def _cpu_now() -> tuple[float, int, int]:
        """(wall time, CPU ticks the whole machine has used, those of the bench's own tree)."""
        return time.monotonic(), machine_cpu_ticks(), own_cpu_ticks()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            others = max(0, procs_running() - own_running_threads())
            with self._lock:
                self._samples.append(others)


def machine_cpu_ticks(stat: Path = Path("/proc/stat")) -> int:
    """Ticks every core spent busy (user, nice, system, irq, softirq), summed."""
    for line in stat.read_text().splitlines():
        if line.startswith("cpu "):
            user, nice, system, _idle, _iowait, irq, softirq = map(int, line.split()[1:8])
            return user + nice + system + irq + softirq
    return 0


def own_cpu_ticks(root: int | None = None) -> int:
    """CPU ticks of this process and its descendants: live ones, and the reaped ones that the
    kernel folds into their parent's children's time."""
    ticks, pending = 0, [root or os.getpid()]
    while pending:
        pid = pending.pop()
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            # after the name: state is field 0, utime/stime 11/12, cutime/cstime 13/14
            ticks += sum(int(f) for f in fields[11:15])
            for task in Path(f"/proc/{pid}/task").glob("*"):
                pending += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
    return ticks


def procs_running(stat: Path = Path("/proc/stat")) -> int:
    for line in stat.read_text().splitlines():
        if line.startswith("procs_running "):
            return int(line.split()[1])
    return 0


def own_running_threads(root: int | None = None) -> int:
    """Threads in state R of this process and its descendants (the peer engines)."""
    running, pending = 0, [root or os.getpid()]
    while pending:
        pid = pending.pop()
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                # The state follows the parenthesised name, which may hold spaces.
                running += (task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "R"
                pending += [int(c) for c in (task / "children").read_text().split()]
            except (OSError, IndexError):
                continue  # the thread or process ended while we looked
    return running
