"""`Throttle`: at most one log line per interval, counting what it held back (a flood of bad
messages must not become a flood of log lines)."""

from __future__ import annotations

import time
from collections.abc import Callable


class Throttle:
    """Allows a log line at most once per `interval_s`; counts what it suppressed."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self._interval_s = interval_s
        self._clock = clock
        self._next = float("-inf")
        self.suppressed = 0

    def ready(self) -> bool:
        now = self._clock()
        if now < self._next:
            self.suppressed += 1
            return False
        self._next = now + self._interval_s
        return True

    def take_suppressed(self) -> int:
        count, self.suppressed = self.suppressed, 0
        return count
