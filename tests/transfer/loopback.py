"""In-process fake transport for unit tests: engines in one process "talk" through a shared
`LoopbackFabric` — messages are delivered on a fabric thread, writes are memmoves between
registered regions. It subclasses the real `Transport`, so the connector worker under test is
the production one; only the wire is fake. `fail_writes`, `drop_messages_to` and
`refuse_messages_to` (the sender is told, as by a peer that cannot be reached) inject faults.
"""

from __future__ import annotations

import ctypes
import itertools
import queue
import threading
from collections.abc import Callable

from pdcluster.core.kv_transfer import SideChannelMessage, decode, encode
from pdcluster.transfer.errors import TransferError
from pdcluster.transfer.side_channel import Authorizer, MessageHandler
from pdcluster.transfer.transport import Transport


class LoopbackFabric:
    """The shared "network": addresses -> transports, and one delivery thread."""

    def __init__(self) -> None:
        self._nodes: dict[str, LoopbackTransport] = {}
        self._ids = itertools.count()
        self._queue: queue.Queue = queue.Queue()
        self.drop_messages_to: set[str] = set()
        self.refuse_messages_to: set[str] = set()
        self.drop_kinds: tuple[type, ...] = ()  # messages of these types are lost silently
        # the failure handlers of dropped messages, to report them late (a sender's deadline)
        self.dropped_handlers: list[Callable[[str], None]] = []
        self.fail_writes = False
        self._thread = threading.Thread(target=self._deliver, daemon=True, name="loopback")
        self._thread.start()

    def transport(self) -> LoopbackTransport:
        n = next(self._ids)
        node = LoopbackTransport(self, f"loopback://{n}", f"loopback-session-{n}")
        self._nodes[node.reply_address] = node
        self._nodes[node.session_id] = node
        return node

    def post(self, address: str, msg: SideChannelMessage,
             on_failure: Callable[[str], None] | None = None) -> None:
        # Through the real codec, so a message the wire cannot carry fails here too.
        self._queue.put((address, (encode(msg), on_failure)))

    def node(self, address: str) -> LoopbackTransport | None:
        return self._nodes.get(address)

    def flush(self, timeout: float = 5.0) -> None:
        done = threading.Event()
        self._queue.put((None, done))
        done.wait(timeout)

    def _deliver(self) -> None:
        while True:
            address, payload = self._queue.get()
            if address is None:
                payload.set()
                continue
            encoded, on_failure = payload
            if address in self.refuse_messages_to:
                if on_failure is not None:  # on the delivery thread, as the real sender's
                    on_failure(f"no side-channel peer accepted a message at {address}")
                continue
            node = self._nodes.get(address)
            if address in self.drop_messages_to and on_failure is not None:
                self.dropped_handlers.append(on_failure)
            if node is None or address in self.drop_messages_to or node.closed:
                continue
            msg = decode(encoded)
            if not isinstance(msg, self.drop_kinds):
                node.deliver(msg)


class LoopbackTransport(Transport):
    def __init__(self, fabric: LoopbackFabric, reply_address: str, session_id: str) -> None:
        self._fabric = fabric
        self._reply_address, self._session_id = reply_address, session_id
        self._handler: MessageHandler | None = None
        self._regions: list[tuple[int, int]] = []
        self.closed = False

    @property
    def reply_address(self) -> str:
        return self._reply_address

    @property
    def session_id(self) -> str:
        return self._session_id

    def start(self, on_message: MessageHandler, authorize: Authorizer | None = None) -> None:
        self._handler = on_message  # the fake cannot tell senders apart: all are accepted

    def deliver(self, msg: SideChannelMessage) -> None:
        if self._handler is not None:
            self._handler(msg)

    def register(self, addr: int, nbytes: int) -> None:
        self._regions.append((addr, nbytes))

    def send(self, address: str, msg: SideChannelMessage,
             on_failure: Callable[[str], None] | None = None) -> None:
        # a dropped message is lost silently (the peer times out); a refused one is reported
        self._fabric.post(address, msg, on_failure)

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        peer = self._fabric.node(session)
        if peer is None or peer.closed or self._fabric.fail_writes:
            raise TransferError(f"loopback write to {session} failed")
        for s, d, n in zip(src, dst, lengths, strict=True):
            if not (self._inside(s, n) and peer._inside(d, n)):
                raise TransferError("loopback write outside a registered region")
            ctypes.memmove(d, s, n)

    def _inside(self, addr: int, n: int) -> bool:
        return any(base <= addr and addr + n <= base + size for base, size in self._regions)

    def close(self) -> None:
        self.closed = True
