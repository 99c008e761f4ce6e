"""The transport a connector worker uses: a side channel for control messages and a data
plane that writes bytes into a peer's registered memory.

`Transport` is the interface; `MooncakeTransport` is the real one (ZMQ + msgpack side
channel, Mooncake Transfer Engine for bytes); `transfer.loopback.LoopbackTransport` is the
in-process fake for unit tests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from core.kv_transfer import SideChannelMessage

MessageHandler = Callable[[SideChannelMessage], None]


class Transport(ABC):
    @property
    @abstractmethod
    def reply_address(self) -> str:
        """Where peers send side-channel messages for this node."""

    @property
    @abstractmethod
    def session_id(self) -> str:
        """How peers address this node's registered memory."""

    @abstractmethod
    def start(self, on_message: MessageHandler) -> None:
        """Begin delivering incoming messages to `on_message` (from a background thread)."""

    @abstractmethod
    def register(self, addr: int, nbytes: int) -> None: ...

    @abstractmethod
    def send(self, address: str, msg: SideChannelMessage) -> None:
        """Fire and forget; never blocks on a dead peer."""

    @abstractmethod
    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """Synchronous write into the peer's memory; raises TransferError on failure."""

    @abstractmethod
    def close(self) -> None: ...
