"""The transport a connector worker uses: a side channel for control messages and a data
plane that writes bytes into a peer's registered memory.

`Transport` is the interface; `MooncakeTransport` is the real one (ZMQ + msgpack side
channel, Mooncake Transfer Engine for bytes); the in-process fake for unit tests,
`LoopbackTransport`, lives in tests/transfer/loopback.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.identity import Directory
from pdcluster.core.kv_ranks import RankAgentSpec
from pdcluster.core.kv_transfer import SideChannelMessage
from pdcluster.transfer.mooncake_engine import MooncakeConfig, MooncakeTransferEngine
from pdcluster.transfer.side_channel import (
    Authorizer,
    MessageHandler,
    SideChannelClient,
    SideChannelServer,
)

# What the other tensor-parallel ranks of a node run (an installed name: it is resolved in
# their processes)
RANK_AGENT = "pdcluster.transfer.rank_agent:MooncakeRankAgent"


class Transport(ABC):
    @property
    @abstractmethod
    def reply_address(self) -> str:
        """Where peers send side-channel messages for this node."""

    @property
    @abstractmethod
    def session_id(self) -> str:
        """How peers address this node's registered memory."""

    @property
    def public_key(self) -> bytes | None:
        """This end's CURVE public key (None: it has none)."""
        return None

    def rank_agent(self) -> RankAgentSpec | None:
        """The agent each other tensor-parallel rank of this node runs (core.kv_ranks): its
        own transfer engine like this one's; None: this transport cannot span ranks."""
        return None

    @abstractmethod
    def start(self, on_message: MessageHandler, authorize: Authorizer | None = None) -> None:
        """Begin delivering incoming messages to `on_message` (from a background thread),
        those `authorize(msg, sender principal)` accepts (a transport that cannot tell the
        sender delivers everything)."""

    @abstractmethod
    def register(self, addr: int, nbytes: int) -> None: ...

    @abstractmethod
    def send(self, address: str, msg: SideChannelMessage,
             on_failure: Callable[[str], None] | None = None) -> None:
        """Fire and forget; never blocks. A message that cannot be delivered later calls
        `on_failure(reason)` from another thread (a transport that cannot tell drops it)."""

    @abstractmethod
    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """Synchronous write into the peer's memory; raises TransferError on failure."""

    @abstractmethod
    def close(self) -> None: ...


class MooncakeTransport(Transport):
    """The real transport: ZMQ + msgpack side channel, Mooncake Transfer Engine for bytes
    (RDMA on a GPU cluster, TCP here). `curve`: this node's CURVE key pair, `directory` the
    registered nodes (core.identity): the side channel admits and writes to those only
    (without a directory, `curve` is the shared pair of the test mode; None: plaintext, for
    unit tests only)."""

    def __init__(self, mooncake: MooncakeConfig | None = None, host: str = "127.0.0.1",
                 port: int = 0, *, curve: CurveKeys | None,
                 directory: Directory | None = None) -> None:
        self._engine = MooncakeTransferEngine(mooncake)
        self._client = SideChannelClient(
            curve=curve, server_key_for=None if directory is None else directory.server_key_for)
        self._host, self._port, self._curve = host, port, curve
        self._directory = directory
        self._server: SideChannelServer | None = None

    @property
    def reply_address(self) -> str:
        if self._server is None:
            raise RuntimeError("start() the transport before asking its address")
        return self._server.address

    @property
    def session_id(self) -> str:
        return self._engine.session_id

    @property
    def public_key(self) -> bytes | None:
        return None if self._curve is None else self._curve.public

    def rank_agent(self) -> RankAgentSpec | None:
        config = self._engine.config
        return RankAgentSpec(RANK_AGENT, {"hostname": config.hostname,
                                          "protocol": config.protocol,
                                          "device_name": config.device_name,
                                          "metadata_server": config.metadata_server})

    def start(self, on_message: MessageHandler, authorize: Authorizer | None = None) -> None:
        self._server = SideChannelServer(on_message, self._host, self._port, curve=self._curve,
                                         directory=self._directory, authorize=authorize)

    def register(self, addr: int, nbytes: int) -> None:
        self._engine.register(addr, nbytes)

    def send(self, address: str, msg: SideChannelMessage,
             on_failure: Callable[[str], None] | None = None) -> None:
        self._client.send(address, msg, on_failure)

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        self._engine.write(session, src, dst, lengths)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._client.close()
        self._engine.close()
