"""The connector worker's bookkeeping (plain data, no behaviour beyond lookups): its
statistics, the state of each transfer it takes part in, keyed by transfer id, and
`WorkerState`, what the worker's two parts (`ConnectorWorker` and its `PullWorker`) share.

Bounds (`PeerBudget`): what a peer's message makes this node hold — a transfer request that
came before its prefill finished, a pull waiting for the engine's lookup or its write — is
held at most `timeout_s`, and counted per peer (its reply address, which the side channel's
rules check is the sender's registered KV address) and in all, by entries and by weight (the
addresses and token ids it carries). A request past a cap is answered at once as failed (the
requester computes instead), so no peer can make a node hold more than its share, and all
peers together no more than the total."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdcluster.core.kv_connector import ConnectorResults, KVRegion, SendJob
from pdcluster.core.kv_transfer import (
    MAX_PULL_TOKENS,
    MAX_TRANSFER_BLOCKS,
    KVGroup,
    PrefixPullRequest,
    TransferId,
    XferRequest,
)
from pdcluster.core.types import ReqId
from pdcluster.transfer.transport import Transport

_FORGET_AFTER = 4096  # finished transfer ids remembered to answer late messages
_LATENCIES_KEPT = 4096  # transfer latencies kept until drained (oldest dropped)


@dataclass(slots=True)
class WorkerStats:
    """Counters of one node's worker. The send/receive ones cover prefill -> decode
    transfers; pulls (global prefix reuse) have their own: `pulls_*` and `blocks_pulled` on
    the requesting node, `pull_requests_served` / `blocks_served` / `pull_serves_failed` on
    the holder (`pull_requests_refused`: without a valid ticket). `timeouts` and
    `late_messages` count both kinds. `latencies` keeps the
    seconds of the latest finished transfers as (kind, seconds) — "send": P's write to D,
    "recv": D's request to P's done, "pull": a pull's request to its done — until
    `ConnectorWorker.take_latencies` drains them (node metrics)."""

    sends_ok: int = 0
    sends_failed: int = 0
    recvs_ok: int = 0
    recvs_failed: int = 0
    timeouts: int = 0
    sources_lost: int = 0  # receives given up because their source died (`fail_receive`)
    # receives failed because the side channel could not hand their request to the source
    # (a dead node whose death the router has not reported yet: whichever comes first wins)
    sources_unreachable: int = 0
    late_messages: int = 0
    blocks_sent: int = 0
    descriptors_sent: int = 0
    bytes_sent: int = 0
    blocks_received: int = 0
    descriptors_received: int = 0
    bytes_received: int = 0
    pulls_ok: int = 0
    pulls_failed: int = 0
    blocks_pulled: int = 0
    bytes_pulled: int = 0
    pull_requests_served: int = 0
    pull_serves_failed: int = 0
    # peers' pulls answered as failed at once: no valid router ticket (core.pull_ticket)
    pull_requests_refused: int = 0
    blocks_served: int = 0
    bytes_served: int = 0
    latencies: deque = field(default_factory=lambda: deque(maxlen=_LATENCIES_KEPT))
    # seconds of the data-plane write of each of the latest sends (benchmarks, metrics)
    recent_write_s: deque = field(default_factory=lambda: deque(maxlen=1024))


# One largest message's worth per peer (a pull of MAX_PULL_TOKENS tokens into the most blocks
# a transfer names: ~36 MB of Python ints at most), four in all; entries by count likewise.
MAX_PEER_WEIGHT = MAX_PULL_TOKENS + MAX_TRANSFER_BLOCKS
MAX_TOTAL_WEIGHT = 4 * MAX_PEER_WEIGHT
MAX_PEER_ENTRIES = 256
MAX_TOTAL_ENTRIES = 1024
OVER_BUDGET = "the node holds too many pending requests from this peer (or in all): retry later"


def weight_of(msg: XferRequest | PrefixPullRequest) -> int:
    """What holding `msg` costs, in list items (addresses, segment offsets, token ids)."""
    tokens = len(msg.token_ids) if isinstance(msg, PrefixPullRequest) else 0
    return 1 + len(msg.dest_block_addrs) + len(msg.dest_segment_offsets) + tokens


class PeerBudget:
    """Entries and weight held for each peer and in all, within caps. Not thread-safe: the
    worker holds its lock."""

    def __init__(self, max_peer_entries: int = MAX_PEER_ENTRIES,
                 max_entries: int = MAX_TOTAL_ENTRIES, max_peer_weight: int = MAX_PEER_WEIGHT,
                 max_weight: int = MAX_TOTAL_WEIGHT) -> None:
        self._caps = (max_peer_entries, max_entries, max_peer_weight, max_weight)
        self._held: dict[str, list[int]] = {}  # peer -> [entries, weight]
        self.num_entries = self.weight = 0
        self.num_refused = 0

    def admit(self, peer: str, weight: int) -> bool:
        per_entries, entries, per_weight, total = self._caps
        held = self._held.get(peer, [0, 0])
        if (held[0] + 1 > per_entries or self.num_entries + 1 > entries
                or held[1] + weight > per_weight or self.weight + weight > total):
            self.num_refused += 1
            return False
        held[0] += 1
        held[1] += weight
        self._held[peer] = held
        self.num_entries += 1
        self.weight += weight
        return True

    def release(self, peer: str, weight: int) -> None:
        held = self._held[peer]
        held[0] -= 1
        held[1] -= weight
        if not held[0]:
            del self._held[peer]
        self.num_entries -= 1
        self.weight -= weight


@dataclass(slots=True)
class Recv:
    """A receive in flight: prefill -> decode KV, or a prefix pull (`is_pull`)."""

    request_id: ReqId
    source_addr: str
    deadline: float
    is_pull: bool = False
    started: float = 0.0  # the worker's clock when the request went out


@dataclass(slots=True)
class Send:
    """A prefill -> decode send: complete once both the job and D's request are here."""

    job: SendJob | None = None
    request: XferRequest | None = None
    deadline: float = 0.0
    started: bool = False
    weight: int = 0  # of `request`, while the peer's budget holds it


class SendTable:
    """The prefill side's sends by transfer id; a request that comes before its job is held
    within the requester's budget. Not thread-safe: the worker holds its lock."""

    def __init__(self, budget: PeerBudget) -> None:
        self._budget = budget
        self._sends: dict[TransferId, Send] = {}

    def __len__(self) -> int:
        return len(self._sends)

    def get(self, tid: TransferId) -> Send | None:
        return self._sends.get(tid)

    def for_job(self, tid: TransferId) -> Send:
        return self._sends.setdefault(tid, Send())

    def for_request(self, msg: XferRequest) -> Send | None:
        """The entry `msg` belongs to (created for it, within the requester's budget, when its
        job has not come yet); None: refused, over budget."""
        entry = self._sends.get(msg.transfer_id)
        if entry is not None:
            return entry
        weight = weight_of(msg)
        if not self._budget.admit(msg.reply_addr, weight):
            return None
        entry = self._sends[msg.transfer_id] = Send(weight=weight)
        return entry

    def pop(self, tid: TransferId) -> Send | None:
        entry = self._sends.pop(tid, None)
        if entry is not None and entry.weight:
            assert entry.request is not None, "a weighed entry holds its request"
            self._budget.release(entry.request.reply_addr, entry.weight)
        return entry

    def expired(self, now: float) -> list[tuple[TransferId, Send]]:
        """The sends whose deadline passed before they started, removed."""
        due = [t for t, e in self._sends.items() if not e.started and e.deadline <= now]
        return [(t, e) for t in due if (e := self.pop(t)) is not None]


@dataclass(slots=True)
class Serve:
    """A peer's pull on the holder: waiting for the engine's lookup, then being written."""

    request: PrefixPullRequest
    deadline: float
    started: bool = False


class ServeTable:
    """The holder's pulls by transfer id. Not thread-safe: the worker holds its lock."""

    def __init__(self, budget: PeerBudget) -> None:
        self._budget = budget
        self._serves: dict[TransferId, Serve] = {}

    def __contains__(self, transfer_id: TransferId) -> bool:
        return transfer_id in self._serves

    @property
    def num_waiting(self) -> int:
        """Pulls the engine has not resolved yet."""
        return sum(1 for s in self._serves.values() if not s.started)

    def add(self, msg: PrefixPullRequest, deadline: float) -> bool | None:
        """False for a duplicate request (harmless, ignored); None: refused, over the
        requester's budget (answer it as failed)."""
        if msg.transfer_id in self._serves:
            return False
        if not self._budget.admit(msg.reply_addr, weight_of(msg)):
            return None
        self._serves[msg.transfer_id] = Serve(msg, deadline)
        return True

    def _pop(self, transfer_id: TransferId) -> Serve | None:
        serve = self._serves.pop(transfer_id, None)
        if serve is not None:
            self._budget.release(serve.request.reply_addr, weight_of(serve.request))
        return serve

    def start(self, transfer_id: TransferId) -> PrefixPullRequest | None:
        """The engine's blocks are here: the pull's request, or None if it expired or was
        aborted meanwhile (the blocks are to be released at once)."""
        serve = self._serves.get(transfer_id)
        if serve is None or serve.started:
            return None
        serve.started = True
        return serve.request

    def finish(self, transfer_id: TransferId) -> None:
        self._pop(transfer_id)

    def requester(self, transfer_id: TransferId) -> str | None:
        """The reply address of the peer whose pull this is, or None."""
        serve = self._serves.get(transfer_id)
        return None if serve is None else serve.request.reply_addr

    def cancel(self, transfer_id: TransferId) -> PrefixPullRequest | None:
        """Forget a pull not yet being written; returns its request (to answer), or None if
        it is unknown or its write is under way (the write answers)."""
        serve = self._serves.get(transfer_id)
        if serve is None or serve.started:
            return None
        self._pop(transfer_id)
        return serve.request

    def expire(self, now: float) -> list[PrefixPullRequest]:
        expired = [t for t, s in self._serves.items() if not s.started and s.deadline <= now]
        return [serve.request for t in expired if (serve := self._pop(t)) is not None]


class WorkerState:
    """What the worker's parts share. `transport`, `timeout_s` and `clock` are fixed; the
    rest is guarded by `lock`: the statistics, the results for the engine's next step, the
    receives in flight (transfers and pulls), the recently finished transfer ids (to answer
    late messages), the receives given up before they started, and the registered KV
    region and group."""

    def __init__(self, transport: Transport, timeout_s: float,
                 clock: Callable[[], float]) -> None:
        self.transport = transport
        self.timeout_s = timeout_s
        self.clock = clock
        self.lock = threading.Lock()
        self.stats = WorkerStats()
        self.results = ConnectorResults()
        self.recvs: dict[TransferId, Recv] = {}
        self.finished: OrderedDict[TransferId, str] = OrderedDict()
        # receives given up before they started (their source reported lost), with why
        self.given_up: OrderedDict[TransferId, str] = OrderedDict()
        self.region: KVRegion | None = None
        self.budget = PeerBudget()  # what peers' pending requests may make this node hold
        self.group: KVGroup | None = None  # this node's group, named in its requests

    def deadline(self) -> float:
        return self.clock() + self.timeout_s

    def take_results(self) -> ConnectorResults:
        results, self.results = self.results, ConnectorResults()
        return results

    def remember(self, tid: TransferId, reason: str) -> None:
        self.finished[tid] = reason
        while len(self.finished) > _FORGET_AFTER:
            self.finished.popitem(last=False)

    def give_up(self, tid: TransferId, reason: str) -> None:
        self.given_up[tid] = reason
        while len(self.given_up) > _FORGET_AFTER:
            self.given_up.popitem(last=False)

    @property
    def region_nbytes_per_block(self) -> int:
        """Bytes one block takes on this node: every segment, every tensor-parallel rank."""
        region = self.require_region()
        ranks = self.group.tp_size if self.group is not None else 1
        return region.block_nbytes * region.num_segments * ranks

    def require_region(self) -> KVRegion:
        if self.region is None:
            raise RuntimeError("register_kv_region() must be called before transfers")
        return self.region
