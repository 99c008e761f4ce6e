"""Noticing that this process stood still: `StallClock` is ticked by a task that runs every
`interval_s`, and by any handler that must know before acting; a tick that comes `STALL_S`
or more late means the process did not run meanwhile (SIGSTOP, a frozen VM, a starved
machine), and it reports how long. The metadata service forgives its nodes' leases that long
(nobody could renew one while it stood still).

API: `StallClock`, `STALL_S`.
"""

from __future__ import annotations

from collections.abc import Callable

# A tick this much late means a stall; shorter delays are ordinary scheduling noise on a busy
# machine, far below any lease TTL (>= 1 s).
STALL_S = 0.5


class StallClock:
    def __init__(self, interval_s: float, clock: Callable[[], float],
                 on_stall: Callable[[float], None]) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._on_stall = on_stall
        self._ticked_at = clock()

    def restart(self) -> None:
        """Start counting from now (the ticking task starts)."""
        self._ticked_at = self._clock()

    def tick(self) -> None:
        now = self._clock()
        lag = now - self._ticked_at - self.interval_s
        if lag >= STALL_S:
            self._on_stall(lag)
        self._ticked_at = now
