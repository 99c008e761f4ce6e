"""Side channel over real ZMQ sockets on 127.0.0.1: round trips (in-process and across two
spawned processes), rejection and counting of bad frames, handler failures, dead peers,
prompt close, and concurrent senders."""

from __future__ import annotations

import logging
import multiprocessing
import socket
import threading
import time
from collections.abc import Callable

import msgpack
import pytest
import zmq

from pdcluster.core.curve import secure_client
from pdcluster.core.kv_transfer import (
    MAX_MESSAGE_BYTES,
    WIRE_VERSION,
    SideChannelMessage,
    WireError,
    XferAbort,
    XferDone,
    XferRequest,
    encode,
)
from pdcluster.transfer import side_channel_client
from pdcluster.transfer.errors import TransferError
from pdcluster.transfer.side_channel import SideChannelClient, SideChannelServer, _Throttle
from tests.cluster_secret import TEST_CURVE

pytestmark = pytest.mark.timeout(30)


def make_request(transfer_id: str = "t-1", num_addrs: int = 3) -> XferRequest:
    return XferRequest(transfer_id=transfer_id, request_id="req-1",
                       reply_addr="tcp://127.0.0.1:5601", dest_session="127.0.0.1:15000",
                       block_nbytes=4096, num_blocks=num_addrs + 1, skip_blocks=1,
                       dest_block_addrs=[0x7F00_0000_0000 + i * 4096 for i in range(num_addrs)])


MESSAGES: list[SideChannelMessage] = [
    make_request(),
    XferAbort("t-2"),
    XferDone("t-3", ok=True, first_token=42, first_logprob=-0.25, num_blocks_sent=3,
             num_descriptors=1),
    XferDone("t-4", ok=False, error="peer went away"),
]


def wait_until(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


class Collector:
    """A handler that records what it got, thread-safely."""

    def __init__(self) -> None:
        self.messages: list[SideChannelMessage] = []
        self._lock = threading.Lock()

    def __call__(self, msg: SideChannelMessage) -> None:
        with self._lock:
            self.messages.append(msg)

    def wait_for(self, count: int, timeout_s: float = 5.0) -> list[SideChannelMessage]:
        assert wait_until(lambda: len(self.messages) >= count, timeout_s), (
            f"got {len(self.messages)} of {count} messages")
        return list(self.messages)


@pytest.fixture
def collector() -> Collector:
    return Collector()


@pytest.fixture
def server(collector: Collector):
    with SideChannelServer(collector, curve=TEST_CURVE) as srv:
        yield srv


@pytest.fixture
def client():
    with SideChannelClient(curve=TEST_CURVE) as cli:
        yield cli


@pytest.fixture
def raw_sender(server: SideChannelServer):
    """A bare DEALER (a cluster member) that can put arbitrary frames on the wire."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client(sock, TEST_CURVE)
    sock.connect(server.address)
    yield sock
    sock.close()


def test_address_is_a_concrete_loopback_port(server: SideChannelServer) -> None:
    host_port = server.address.removeprefix("tcp://")
    host, port = host_port.rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536


def test_each_message_type_round_trips(server, client, collector) -> None:
    for msg in MESSAGES:
        client.send(server.address, msg)
    assert collector.wait_for(len(MESSAGES)) == MESSAGES
    assert (server.num_received, server.num_rejected, server.num_handler_errors) == (4, 0, 0)


def _echo_peer(conn) -> None:
    """Child process: a server whose handler echoes every message to the parent's server."""
    with SideChannelClient(curve=TEST_CURVE) as cli:
        reply_to = conn.recv()
        with SideChannelServer(lambda msg: cli.send(reply_to, msg), curve=TEST_CURVE) as srv:
            conn.send(srv.address)
            conn.recv()  # parent says it has everything: only now may queued frames go


def test_round_trip_across_processes(server, client, collector) -> None:
    ctx = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_echo_peer, args=(child_end,), daemon=True)
    child.start()
    try:
        parent_end.send(server.address)
        assert parent_end.poll(20), "child did not start its side channel"
        child_address = parent_end.recv()
        for msg in MESSAGES:
            client.send(child_address, msg)
        assert collector.wait_for(len(MESSAGES), timeout_s=10) == MESSAGES
        parent_end.send("done")
        child.join(10)
        assert child.exitcode == 0
    finally:
        child.kill()


def _envelope(body: object, type_name: str = "XferAbort", version: object = WIRE_VERSION):
    return msgpack.packb({"v": version, "type": type_name, "body": body})


MALFORMED: dict[str, list[bytes]] = {
    "garbage": [b"\x00\xffnot msgpack at all\xc1"],
    "empty": [b""],
    "not a map": [msgpack.packb([1, 2, 3])],
    "wrong version": [_envelope({"transfer_id": "t"}, version=WIRE_VERSION + 1)],
    "unknown type": [_envelope({"transfer_id": "t"}, type_name="XferPickle")],
    "wrong field type": [_envelope({"transfer_id": 7})],
    "bool for int": [msgpack.packb({"v": WIRE_VERSION, "type": "XferDone", "body": {
        "transfer_id": "t", "ok": True, "num_blocks_sent": True}})],
    "missing field": [_envelope({})],
    "extra field": [_envelope({"transfer_id": "t", "pickle": b"x"})],
    "oversize": [b"\x00" * (MAX_MESSAGE_BYTES + 1)],
    "two frames": [encode(XferAbort("t")), encode(XferAbort("t"))],
}


@pytest.mark.parametrize("frames", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_frame_is_rejected_and_serving_goes_on(server, collector, raw_sender,
                                                         frames) -> None:
    raw_sender.send_multipart(frames)
    raw_sender.send(encode(XferAbort("after")))
    assert collector.wait_for(1) == [XferAbort("after")]
    assert server.num_rejected == 1
    assert server.num_received == 2
    assert server.num_handler_errors == 0


def test_rejection_warnings_are_rate_limited(server, collector, raw_sender, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="pdcluster.transfer.side_channel"):
        for _ in range(50):
            raw_sender.send(b"\xc1garbage")
        raw_sender.send(encode(XferAbort("after")))
        collector.wait_for(1)
    warnings = [r for r in caplog.records if r.name == "pdcluster.transfer.side_channel"]
    assert server.num_rejected == 50
    assert 1 <= len(warnings) <= 2, [r.getMessage() for r in warnings]
    assert "not msgpack" in warnings[0].getMessage()


def test_handler_exception_is_counted_and_loop_survives(caplog) -> None:
    got = Collector()

    def handler(msg: SideChannelMessage) -> None:
        if isinstance(msg, XferAbort) and msg.transfer_id.startswith("boom"):
            raise RuntimeError("handler bug")
        got(msg)

    with caplog.at_level(logging.ERROR, logger="pdcluster.transfer.side_channel"), \
            SideChannelServer(handler, curve=TEST_CURVE) as srv, \
            SideChannelClient(curve=TEST_CURVE) as cli:
        for i in range(3):
            cli.send(srv.address, XferAbort(f"boom-{i}"))
        cli.send(srv.address, XferAbort("fine"))
        assert got.wait_for(1) == [XferAbort("fine")]
        assert (srv.num_received, srv.num_rejected, srv.num_handler_errors) == (4, 0, 3)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and errors[0].exc_info is not None
    assert len(errors) == 1  # the other two were suppressed by the rate limit


def test_send_to_nobody_fails_through_on_failure_and_never_blocks(client) -> None:
    with socket.socket() as reserved:  # bound, never listening: connections are refused
        reserved.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{reserved.getsockname()[1]}"
        for _ in range(2):  # the second send reuses the cached socket
            failures: list[str] = []
            start = time.monotonic()
            client.send(address, XferAbort("t"), failures.append)
            assert time.monotonic() - start < 0.05  # queued, not waited on
            assert wait_until(lambda failures=failures: bool(failures), timeout_s=2)
            assert "no side-channel peer" in failures[0]
            assert time.monotonic() - start < 1.0


def test_a_dead_peer_holds_up_no_other_peer(server, client, collector) -> None:
    with socket.socket() as reserved:
        reserved.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{reserved.getsockname()[1]}"
        client.send(server.address, XferAbort("warm"))
        collector.wait_for(1)
        failures: list[str] = []
        for i in range(20):
            client.send(dead, XferAbort(f"dead-{i}"), failures.append)
        start = time.monotonic()
        client.send(server.address, XferAbort("live"))
        collector.wait_for(2)
        assert time.monotonic() - start < 0.1  # not behind the dead peer's 0.5 s
        assert wait_until(lambda: len(failures) == 20, timeout_s=3)


def test_ten_thousand_reply_addresses_cost_a_bounded_number_of_sockets(server, collector):
    # Messages wait 5 s, not 0.5: the sender meets each address within its deadline however
    # slowly its thread gets the GIL beside this loop, so the sockets pile up and some must
    # be evicted (one met after its deadline fails and closes without ever counting).
    client = SideChannelClient(5.0, curve=TEST_CURVE, max_peers=64)
    failures: list[str] = []
    try:
        client.send(server.address, XferAbort("warm"))  # peers keep their connections
        collector.wait_for(1)
        for port in range(1, 10_001):  # nothing listens on 127.0.0.2:1..10000
            try:
                client.send(f"tcp://127.0.0.2:{port}", XferAbort(f"t-{port}"),
                            failures.append)
            except TransferError as exc:  # the queue is bounded too: refused at once
                failures.append(str(exc))
            assert client.num_sockets <= 64
        start = time.monotonic()
        client.send(server.address, XferAbort("live"))
        assert collector.wait_for(2)[-1] == XferAbort("live")
        assert time.monotonic() - start < 0.5
        assert wait_until(lambda: len(failures) == 10_000, timeout_s=30), len(failures)
        assert client.num_sockets <= 64 and client.num_evicted > 0
    finally:
        client.close()


def test_a_flood_of_dead_addresses_leaves_room_for_the_live_peers(server, collector):
    """Messages to addresses that delivered nothing take at most half the queue: with the
    queue full of them, a peer that is live still gets its message through."""
    client = SideChannelClient(send_timeout_s=30, curve=TEST_CURVE, max_queued=100)
    refused = 0
    try:
        client.send(server.address, XferAbort("warm"))
        collector.wait_for(1)
        for port in range(1, 201):  # nothing listens there: each waits 30 s for a peer
            try:
                client.send(f"tcp://127.0.0.2:{port}", XferAbort(f"t-{port}"))
            except TransferError:
                refused += 1
        assert refused == 150  # half the queue for addresses that never delivered
        for i in range(50):  # the other half: the live peer's
            client.send(server.address, XferAbort(f"live-{i}"))
        assert collector.wait_for(51)[-1] == XferAbort("live-49")
        with pytest.raises(TransferError, match="already wait"):
            client.send("tcp://127.0.0.2:999", XferAbort("one more dead"))
    finally:
        client.close()


def test_sends_resume_when_a_peer_comes_back_at_the_same_address(client, collector) -> None:
    with SideChannelServer(Collector(), curve=TEST_CURVE) as first:
        address = first.address
        client.send(address, XferAbort("to the first"))
    port = int(address.rsplit(":", 1)[1])
    assert wait_until(lambda: _refused(client, address), timeout_s=3)
    with rebind(collector, port):
        assert wait_until(lambda: not _refused(client, address), timeout_s=5)
        assert collector.wait_for(1)[0] == XferAbort("again")


def _refused(client: SideChannelClient, address: str) -> bool:
    failed = threading.Event()
    client.send(address, XferAbort("again"), lambda reason: failed.set())
    return failed.wait(1.0)


def test_close_is_prompt_and_releases_the_port(collector) -> None:
    srv = SideChannelServer(collector, curve=TEST_CURVE)
    port = int(srv.address.rsplit(":", 1)[1])
    start = time.monotonic()
    srv.close()
    assert time.monotonic() - start < 1.0
    assert not srv._thread.is_alive()
    srv.close()  # idempotent
    with rebind(collector, port) as again:
        assert again.address.endswith(f":{port}")


def rebind(handler: Callable[[SideChannelMessage], None], port: int) -> SideChannelServer:
    """A server on `port` once the previous one's listener is gone: ZMQ closes sockets on its
    I/O thread, shortly after close() returns."""
    deadline = time.monotonic() + 2.0
    while True:
        try:
            return SideChannelServer(handler, port=port, curve=TEST_CURVE)
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def test_close_leaves_the_shared_context_usable(collector) -> None:
    with SideChannelServer(collector, curve=TEST_CURVE) as srv, \
            SideChannelClient(curve=TEST_CURVE) as cli:
        cli.send(srv.address, XferAbort("one"))
        collector.wait_for(1)
    assert not zmq.Context.instance().closed
    with SideChannelServer(collector, curve=TEST_CURVE) as srv, \
            SideChannelClient(curve=TEST_CURVE) as cli:
        cli.send(srv.address, XferAbort("two"))
        assert collector.wait_for(2)[-1] == XferAbort("two")


def test_many_messages_from_several_threads_all_arrive(server, client, collector) -> None:
    num_threads, per_thread = 4, 200

    def sender(t: int) -> None:
        for i in range(per_thread):
            client.send(server.address, XferAbort(f"{t}-{i}"))

    threads = [threading.Thread(target=sender, args=(t,)) for t in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    got = collector.wait_for(num_threads * per_thread, timeout_s=20)
    expected = {f"{t}-{i}" for t in range(num_threads) for i in range(per_thread)}
    assert sorted(m.transfer_id for m in got) == sorted(expected)
    for t in range(num_threads):  # one socket per address keeps each sender's order
        ids = [m.transfer_id for m in got if m.transfer_id.startswith(f"{t}-")]
        assert ids == [f"{t}-{i}" for i in range(per_thread)]


def test_client_refuses_oversize_messages_and_sends_after_close(server, monkeypatch) -> None:
    cli = SideChannelClient(curve=TEST_CURVE)
    monkeypatch.setattr(side_channel_client, "MAX_MESSAGE_BYTES", 1000)  # 16 MiB is slow
    cli.send(server.address, make_request(num_addrs=50))
    with pytest.raises(WireError, match="exceeds"):
        cli.send(server.address, make_request(num_addrs=200))
    cli.close()
    cli.close()
    with pytest.raises(TransferError, match="closed"):
        cli.send(server.address, XferAbort("t"))


def test_bad_arguments_raise_value_error(client, collector) -> None:
    with pytest.raises(ValueError):
        client.send("127.0.0.1:5600", XferAbort("t"))
    with pytest.raises(ValueError):
        SideChannelClient(send_timeout_s=0, curve=TEST_CURVE)
    with pytest.raises(ValueError):
        SideChannelServer(collector, port=70000, curve=TEST_CURVE)


def test_throttle_allows_one_line_per_interval() -> None:
    now = [0.0]
    throttle = _Throttle(interval_s=10.0, clock=lambda: now[0])
    assert throttle.ready()
    assert not throttle.ready() and not throttle.ready()
    now[0] = 10.0
    assert throttle.ready()
    assert throttle.take_suppressed() == 2
    assert throttle.take_suppressed() == 0
