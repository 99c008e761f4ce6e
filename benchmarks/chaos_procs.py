"""The processes a node leaves behind when it dies: what the chaos benchmark checks after it
kills one, and after it stops the cluster.

A node's Ray actor is one process, but a vLLM node has children: vLLM's engine core
(`VLLM::EngineCore`), its worker (`VLLM::Worker`) and a multiprocessing resource tracker.
Killed with the actor, they must go too (Ray reaps a dead worker's children, and the vLLM
backend's connector ties them to the node's life besides: vllm_backend/lifeline.py); a child
still running after `grace_s` is an orphan — memory, Mooncake listeners and threads that
nobody will ever free. `kill_tree` SIGKILLs a node, watches its children go and kills (and
counts) any that outlive the grace period; `reap` does the same for processes collected
before a shutdown.

API: `descendants`, `kill_tree`, `reap`, `TreeKill`.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

GRACE_S = 10.0  # how long a dead node's children may take to exit


@dataclass(slots=True)
class TreeKill:
    """What became of a killed process's children: how many it had, how soon the last one
    exited (None: some had to be killed), and the names of those killed here."""

    num_children: int = 0
    children_gone_after_s: float | None = 0.0
    orphans_killed: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"num_children": self.num_children,
                "children_gone_after_s": self.children_gone_after_s,
                "orphans_killed": self.orphans_killed}


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (empty when it is gone)."""
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _alive(pids: list[int]) -> dict[int, str]:
    """Those of `pids` still running (a zombie has exited), with their names."""
    import psutil

    out = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                out[pid] = proc.name()
        except psutil.Error:
            continue
    return out


def reap(pids: list[int], grace_s: float = GRACE_S) -> TreeKill:
    """Wait up to `grace_s` for `pids` to exit; SIGKILL those that do not."""
    started = time.monotonic()
    result = TreeKill(num_children=len(pids))
    while True:
        alive = _alive(pids)
        if not alive:
            result.children_gone_after_s = round(time.monotonic() - started, 3)
            return result
        if time.monotonic() - started > grace_s:
            break
        time.sleep(0.05)
    for pid, name in alive.items():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        result.orphans_killed.append(f"{name}({pid})")
    result.children_gone_after_s = None
    return result


def kill_tree(pid: int, grace_s: float = GRACE_S) -> TreeKill:
    """SIGKILL `pid`, then `reap` the children it had."""
    children = descendants(pid)
    os.kill(pid, signal.SIGKILL)
    return reap(children, grace_s)
