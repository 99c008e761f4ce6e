"""Aborts on their way through vLLM, until the node's figures include them.

The node forgets an aborted request at once, but vLLM frees its blocks later, in its
engine-core process: the abort crosses a socket, the engine core finishes the request, and
the KV usage the node reads (vllm_backend/stats.py) changes only with the stats of vLLM's
next step. Measured here: a node that looked idle 3 ms after an abort storm still counted one
request's blocks as held (they were free half a second later) — a leak check run then sees a
leak that is not one, and a drain returns before vLLM has let go.

`AbortTracker` keeps that window visible: an abort is pending from `started` until the
engine core has applied it (`confirmed`: called after a utility round trip queued behind the
abort, which the engine core answers in order) and the node has then recorded the stats of a
step that began after it (vLLM steps once more after every abort that finished a request).
An abort that finished nothing (the request had just ended) is followed by no step: it
settles `settle_s` after its confirmation, when vLLM's last figures are still the true ones.

API: `AbortTracker`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

SETTLE_S = 1.0


class AbortTracker:
    """`num_steps`: the number of vLLM steps whose stats the node has recorded so far."""

    def __init__(self, num_steps: Callable[[], int], clock: Callable[[], float] = time.monotonic,
                 settle_s: float = SETTLE_S) -> None:
        self._num_steps = num_steps
        self._clock = clock
        self._settle_s = settle_s
        self._lock = threading.Lock()
        self._num_pending = 0  # sent, not yet confirmed by the engine core
        self._barrier = -1  # the step count at the latest confirmation
        self._confirmed_at = float("-inf")

    def started(self) -> None:
        with self._lock:
            self._num_pending += 1

    def confirmed(self) -> None:
        """The engine core has applied the abort (or cannot: it is gone)."""
        steps = self._num_steps()
        with self._lock:
            self._num_pending -= 1
            self._barrier = max(self._barrier, steps)
            self._confirmed_at = self._clock()

    def settled(self) -> bool:
        """True when no abort is pending: vLLM's figures as the node reads them include every
        abort sent so far."""
        with self._lock:
            if self._num_pending:
                return False
            barrier, confirmed_at = self._barrier, self._confirmed_at
        return self._num_steps() > barrier or self._clock() - confirmed_at >= self._settle_s
