"""`PinBudget`: the per-node bound on KV blocks held for other nodes (torch-free).

Four kinds of work hold blocks on behalf of a peer rather than a local client, and a flood
of any could otherwise take the whole pool from normal traffic:
- a `RemoteDecode` request (prefill node): it holds its blocks while it prefills, then keeps
  them pinned until the decode node's `XferRequest` arrives and the write ends;
- a `RemotePrefill` request (decode node): the blocks it allocated for the prefill node's
  write, from admission until the KV arrives, fails or times out;
- a prefix pull this node serves (holder): the leading run of blocks it still caches is
  referenced until the write to the requester ends;
- a prefix pull this node makes (requester): the blocks parked for the holder's write, until
  it answers or the connector's timeout.
All draw on one budget of `max_blocks` (a fraction of the pool, `EngineConfig.
max_pinned_fraction`), which is also the cap of any one of them: nothing pinned, one request
still cannot take more than the budget. A remote decode reserves the blocks it will pin when
it is admitted (`try_reserve`; refused: `OverloadedError`, never queued; one that needs more
than the whole budget is refused too: prefill it where it decodes). A remote prefill holds
its blocks when it is admitted (`can_hold`, then `hold`); until they fit it waits like a
request the pool cannot take yet, and one that can never fit computes its prompt itself. A
served pull takes what is left (`grant`), maybe nothing: the requester computes the rest. A
pull this node would make that does not fit (`can_hold`) is not made: the request computes its
prefix. In time: a send pin starts its
clock when prefill ends (`start_clock`) and `expired()` names the pins past `timeout_s`, which
the scheduler cancels through the connector (an unstarted send then releases its blocks at
once; a write under way releases them when it ends). Pulls are not clocked here: blocks
cannot be freed under a write, and the connector worker already expires a pull not yet
resolved (holder) or not answered (requester) after its `kv_timeout_s`.
Keys are `("send", request id)`, `("recv", request id)`, `("serve", transfer id)` and
`("pull", request id)`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

PinKey = tuple[str, str]


class OverloadedError(Exception):
    """The node cannot take this request now; it may be retried later or elsewhere."""


class PinBudget:
    def __init__(self, max_blocks: int, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_blocks < 1 or timeout_s <= 0:
            raise ValueError("a pin budget needs max_blocks >= 1 and timeout_s > 0")
        self.max_blocks = max_blocks
        self.timeout_s = timeout_s
        self._clock = clock
        self._held: dict[PinKey, int] = {}
        self._deadlines: dict[PinKey, float] = {}
        self.num_used = 0
        self.num_refused = 0  # remote decodes refused at admission
        self.num_serves_cut = 0  # served pulls given fewer blocks than the holder had
        self.num_expired = 0

    def can_hold(self, num_blocks: int) -> bool:
        return self.num_used + num_blocks <= self.max_blocks

    def try_reserve(self, key: PinKey, num_blocks: int) -> bool:
        if not self.can_hold(num_blocks):
            self.num_refused += 1
            return False
        self.hold(key, num_blocks)
        return True

    def grant(self, key: PinKey, num_blocks: int) -> int:
        """Reserve as many of `num_blocks` as fit (0 to all of them); returns that number."""
        granted = max(0, min(num_blocks, self.max_blocks - self.num_used))
        if granted < num_blocks:
            self.num_serves_cut += 1
        if granted:
            self.hold(key, granted)
        return granted

    def start_clock(self, key: PinKey) -> None:
        if key in self._held:
            self._deadlines[key] = self._clock() + self.timeout_s

    def expired(self) -> list[PinKey]:
        """Pins past their deadline, each named once (the caller cancels them)."""
        now = self._clock()
        keys = [k for k, deadline in self._deadlines.items() if deadline <= now]
        for key in keys:
            del self._deadlines[key]
        self.num_expired += len(keys)
        return keys

    def release(self, key: PinKey) -> None:
        self.num_used -= self._held.pop(key, 0)
        self._deadlines.pop(key, None)

    def release_request(self, request_id: str) -> None:
        """Whatever a request holds: its send pin, its remote prefill's, its pull's blocks."""
        self.release(("send", request_id))
        self.release(("recv", request_id))
        self.release(("pull", request_id))

    def hold(self, key: PinKey, num_blocks: int) -> None:
        assert key not in self._held, f"pin {key} reserved twice"
        self._held[key] = num_blocks
        self.num_used += num_blocks
