"""Per-workload identity on the ZMQ planes: which principal a CURVE public key is.

Every node and every router makes its own CURVE key pair when it starts and never exports the
private key; it registers the public key with the metadata service, which is the authority on
key -> principal. A `Directory` is one process's copy of that mapping:

    directory = Directory(refresh=lambda: peers_from_the_metadata_service())
    directory.principal_of(z85_key)         # "node/d0", "router/4f1c…", or None
    directory.peer("node/d0").kv_address     # what node d0 registered
    directory.by_kv_address("tcp://…")       # the node serving that side channel

Principals: `node/<id>` (a node: its request socket, its KV side channel, its Mooncake
session, all registered under its id), `router/<instance>` (a router: client keys only) and
`MEMBER`, the wildcard of the shared-key mode that unit tests use (one key pair for
everyone, trusted for everything; production never grants it).

The ZAP handler (core.curve) admits a client whose key the directory names, and the servers
read the key back from each message (ZMQ's `User-Id` property) to authorise it per message
type. At a handshake, a key the directory does not know makes it ask the authority again,
with a refresh that starts after the miss (so a key registered before its handshake is always
found: libzmq does not retry a handshake its ZAP handler refused) but at most once per
`min_refresh_s` (so a stranger's handshakes cannot turn into a flood of lookups; they wait
instead), and the same key missing again before the next refresh is refused at once (a
negative answer). Per message (`principal_of(key, wait=False)`) a miss never waits: the key
passed its handshake, so it was revoked since, and is refused. `follow()` refreshes in a
background thread too, so that revoked keys leave. Thread-safe.

API: `Peer`, `Directory`, `MEMBER`, `is_router`, `node_id_of`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MEMBER = "member"  # the shared-key test mode's principal: allowed everything
_MAX_UNKNOWN = 4096  # negative answers kept
ROUTER_PREFIX = "router/"
NODE_PREFIX = "node/"


@dataclass(frozen=True, slots=True)
class Peer:
    """One registered principal and what it registered (empty strings where it has none:
    a router registers no addresses)."""

    principal: str
    public_key: bytes  # Z85, 40 bytes
    request_address: str = ""
    kv_address: str = ""
    kv_session: str = ""
    ticket_key: bytes = b""  # a router's Ed25519 key for pull tickets (core.pull_ticket)


def is_router(principal: str | None) -> bool:
    return principal is not None and principal.startswith(ROUTER_PREFIX)


def node_id_of(principal: str | None) -> str | None:
    if principal is None or not principal.startswith(NODE_PREFIX):
        return None
    return principal[len(NODE_PREFIX):]


class Directory:
    def __init__(self, refresh: Callable[[], Iterable[Peer]] | None = None,
                 min_refresh_s: float = 0.2, clock: Callable[[], float] = time.monotonic,
                 grace_s: float = 15.0) -> None:
        self._refresh = refresh
        self._min_refresh_s = min_refresh_s
        self._grace_s = grace_s
        self._seen: dict[bytes, tuple[Peer, float]] = {}
        self._clock = clock
        self._lock = threading.Lock()
        self._refreshing = threading.Lock()
        self._static: dict[bytes, Peer] = {}
        self._by_key: dict[bytes, Peer] = {}
        self._by_principal: dict[str, Peer] = {}
        self._by_kv_address: dict[str, Peer] = {}
        self._last_refresh = float("-inf")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._listeners: list[Callable[[list[Peer]], None]] = []
        self.num_refreshes = 0
        self.num_refresh_errors = 0
        self.num_misses = 0  # lookups refused without asking the authority
        # keys that missed after a refresh, with the refresh count then: until the next
        # refresh, a key that named nobody is refused at once (a stranger's retries cost
        # no wait)
        self._unknown: OrderedDict[bytes, int] = OrderedDict()

    def grant(self, peer: Peer) -> None:
        """Know `peer` whatever the refreshes say (this process's own keys, test modes)."""
        with self._lock:
            self._static[peer.public_key] = peer
            self._index(list(self._by_key.values()))

    def replace_all(self, peers: Iterable[Peer]) -> None:
        """The registry as the authority sees it now (granted peers are kept). A key that
        leaves it stays known for `grace_s` more: an authority that restarts empty (the
        memory backend) is re-filled by renewals within seconds, and must not cut off every
        live connection meanwhile; revocation takes that much longer."""
        now = self._clock()
        with self._lock:
            for peer in peers:
                self._seen[peer.public_key] = (peer, now)
            self._seen = {key: (peer, seen) for key, (peer, seen) in self._seen.items()
                          if now - seen <= self._grace_s}
            self._index([peer for peer, _ in self._seen.values()])

    def _index(self, peers: list[Peer]) -> None:
        by_key = {p.public_key: p for p in peers if p.public_key}
        by_key.update(self._static)
        self._by_key = by_key
        self._by_principal = {p.principal: p for p in by_key.values()}
        self._by_kv_address = {p.kv_address: p for p in by_key.values() if p.kv_address}
        for listener in self._listeners:
            listener(list(by_key.values()))

    def subscribe(self, listener: Callable[[list[Peer]], None]) -> None:
        """Call `listener(every peer)` now and after every change (a vLLM node copies its
        directory to its connector's processes this way)."""
        with self._lock:
            self._listeners.append(listener)
            listener(list(self._by_key.values()))

    def unsubscribe(self, listener: Callable[[list[Peer]], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    @property
    def peers(self) -> list[Peer]:
        return list(self._by_key.values())

    def principal_of(self, public_key: bytes, wait: bool = True) -> str | None:
        """The key's principal. A miss asks the authority again (`refresh_since`) unless
        `wait` is False (a per-message check: a miss there refuses at once) or the same key
        already missed since the last refresh (a negative answer, kept until the next one)."""
        peer = self._by_key.get(public_key)
        if peer is not None:
            return peer.principal
        if not wait or self._unknown.get(public_key) == self.num_refreshes:
            self.num_misses += 1
            return None
        if self.refresh_since(self._clock()):
            peer = self._by_key.get(public_key)
        if peer is None:
            self._remember_unknown(public_key)
            return None
        return peer.principal

    def _remember_unknown(self, public_key: bytes) -> None:
        with self._lock:
            self._unknown[public_key] = self.num_refreshes
            self._unknown.move_to_end(public_key)
            while len(self._unknown) > _MAX_UNKNOWN:
                self._unknown.popitem(last=False)

    def peer(self, principal: str) -> Peer | None:
        return self._by_principal.get(principal)

    def by_kv_address(self, address: str) -> Peer | None:
        peer = self._by_kv_address.get(address)
        if peer is None and self.refresh_since(self._clock()):
            peer = self._by_kv_address.get(address)
        return peer

    def server_key_for(self, kv_address: str) -> bytes | None:
        """The CURVE server key of the node serving the side channel at `kv_address`."""
        peer = self.by_kv_address(kv_address)
        return None if peer is None else peer.public_key

    def refresh_since(self, missed_at: float) -> bool:
        """Make sure the authority was asked after `missed_at` (a lookup missed then): wait
        for a refresh under way, or for `min_refresh_s` since the last one, then ask. So a key
        registered before a client's handshake is always found, and a flood of unknown keys
        costs the authority one call per `min_refresh_s`. True if the registry was read."""
        if self._refresh is None:
            return False
        with self._refreshing:
            if self._last_refresh >= missed_at:
                return True  # another caller's refresh started after the miss
            wait_s = self._last_refresh + self._min_refresh_s - self._clock()
            if wait_s > 0:
                self._stop.wait(wait_s)
            return self._refresh_locked()

    def refresh_now(self, force: bool = False) -> bool:
        """Ask the authority again, unless it was asked less than `min_refresh_s` ago (or
        another thread is asking now). True if this call refreshed."""
        if self._refresh is None:
            return False
        if not self._refreshing.acquire(blocking=False):
            return False
        try:
            if not force and self._clock() - self._last_refresh < self._min_refresh_s:
                return False
            return self._refresh_locked()
        finally:
            self._refreshing.release()

    def _refresh_locked(self) -> bool:
        assert self._refresh is not None, "no authority to refresh from"
        self._last_refresh = self._clock()
        try:
            peers = list(self._refresh())
        except Exception as exc:  # the authority is down: keep what we know
            self.num_refresh_errors += 1
            logger.warning("could not refresh the key directory: %s", exc)
            return False
        self.replace_all(peers)
        self.num_refreshes += 1
        return True

    def follow(self, interval_s: float = 2.0) -> Directory:
        """Refresh every `interval_s` in a daemon thread until `close()`."""
        def run() -> None:
            while not self._stop.wait(interval_s):
                self.refresh_now(force=True)

        self._thread = threading.Thread(target=run, daemon=True, name="key-directory")
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
