"""`Admissions`: generate requests a node has received but not yet handed to its engine,
because work they need first runs off the serving thread (`NodeEngine.prepare`: compiling a
structured-output grammar, ~0.5 s for a 64 KiB schema, which the one thread that serves every
request must not spend).

The server parks each such request with its future and a deadline; every turn of its loop
`take_due` returns the parked requests whose future finished (admit them, or refuse them with
the future's error) or whose deadline passed (refuse them: the work did not finish in time;
it goes on off the thread, but nothing waits for it). An abort from the request's submitter
drops it while it is parked.

API: `Admissions`, `Parked`, `PREPARE_TIMEOUT_S`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from pdcluster.core.node_wire import GenerateRequest

PREPARE_TIMEOUT_S = 10.0


@dataclass(slots=True)
class Parked:
    identity: bytes
    principal: str | None
    msg: GenerateRequest
    future: Future[None]
    deadline: float


class Admissions:
    def __init__(self, timeout_s: float = PREPARE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._clock = clock
        self._parked: dict[str, Parked] = {}

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parked

    def park(self, identity: bytes, principal: str | None, msg: GenerateRequest,
             future: Future[None]) -> None:
        self._parked[msg.request_id] = Parked(identity, principal, msg, future,
                                              self._clock() + self.timeout_s)

    def drop(self, request_id: str, principal: str | None) -> bool | None:
        """Forget a parked request on its submitter's abort: True if dropped, False if
        another principal asked, None if it is not parked."""
        parked = self._parked.get(request_id)
        if parked is None:
            return None
        if parked.principal != principal:
            return False
        del self._parked[request_id]
        return True

    def take_due(self) -> list[tuple[Parked, str | None]]:
        """(request, why it is refused, or None to admit it) for each that is due."""
        if not self._parked:
            return []
        now, due = self._clock(), []
        for request_id, parked in list(self._parked.items()):
            if parked.future.done():
                error = parked.future.exception()
                due.append((parked, None if error is None else str(error)))
            elif now >= parked.deadline:
                due.append((parked, f"its preparation (compiling its grammar) did not finish "
                                    f"within {self.timeout_s:g} s"))
            else:
                continue
            del self._parked[request_id]
        return due

    def take_all(self) -> list[Parked]:
        parked, self._parked = list(self._parked.values()), {}
        return parked
