"""The Mooncake wrapper: `coalesce` (examples and properties), config validation, return codes
turned into exceptions (with a fake binding where the real one cannot be made to fail), and
real transfers over TCP on 127.0.0.1 between this process and spawned peer processes."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import multiprocessing
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.transfer import mooncake_bind, mooncake_engine
from pdcluster.transfer.errors import TransferError, TransferTimeout
from pdcluster.transfer.mooncake_engine import (
    MooncakeConfig,
    MooncakeTransferEngine,
    coalesce,
    has_active_ib_port,
    rdma_available,
)
from pdcluster.transfer.rdma import IB_SYSFS

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[2]
PEER_NBYTES = 64 << 20
BLOCK = 4096
MC_TIMEOUT_S = 5  # the binding's minimum; keeps the hung-peer test short


# ---- coalesce --------------------------------------------------------------------------

def test_coalesce_merges_runs_contiguous_on_both_sides() -> None:
    src = [0, 10, 20, 30, 40, 80]
    dst = [500, 510, 520, 900, 910, 300]
    assert coalesce(src, dst, 10) == ([0, 30, 80], [500, 900, 300], [30, 20, 10])


def test_coalesce_keeps_runs_contiguous_on_one_side_only_apart() -> None:
    assert coalesce([0, 10, 20], [0, 50, 60], 10) == ([0, 10], [0, 50], [10, 20])
    assert coalesce([0, 40, 50], [0, 10, 20], 10) == ([0, 40], [0, 10], [10, 20])
    assert coalesce([], [], 10) == ([], [], [])


def test_coalesce_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        coalesce([0, 10], [0], 10)
    with pytest.raises(ValueError):
        coalesce([0], [0], 0)


# Runs of blocks contiguous on both sides; each run starts at a gap from the end of the one
# before, per side. Gap 0 (half the time per side) makes runs adjacent on one side or both.
_gaps = st.sampled_from([0, 0, 0, 1, 3, -7])
_runs = st.lists(st.tuples(_gaps, _gaps, st.integers(1, 5)), max_size=10)


def _pairs_from_runs(runs: list[tuple[int, int, int]], length_each: int) -> list[tuple[int, int]]:
    pairs: list[tuple[int, int]] = []
    src_block = dst_block = 64
    for src_gap, dst_gap, n in runs:
        src_block, dst_block = src_block + src_gap, dst_block + dst_gap
        pairs += [((src_block + k) * length_each, (dst_block + k) * length_each)
                  for k in range(n)]
        src_block, dst_block = src_block + n, dst_block + n
    return pairs


@given(runs=_runs, length_each=st.integers(1, 4096))
def test_coalesce_properties(runs: list[tuple[int, int, int]], length_each: int) -> None:
    pairs = _pairs_from_runs(runs, length_each)
    src, dst, lengths = coalesce([p[0] for p in pairs], [p[1] for p in pairs], length_each)
    assert sum(lengths) == len(pairs) * length_each  # total bytes preserved
    assert all(n % length_each == 0 for n in lengths)
    expanded = [(s + k * length_each, d + k * length_each)
                for s, d, n in zip(src, dst, lengths, strict=True)
                for k in range(n // length_each)]
    assert expanded == pairs  # the same bytes go to the same places, in the same order
    for i in range(len(src) - 1):  # maximal: no two neighbours could merge
        assert not (src[i + 1] == src[i] + lengths[i] and dst[i + 1] == dst[i] + lengths[i])


# ---- config, detection, import -----------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"hostname": ""}, {"hostname": "a host"}, {"protocol": "udp"}, {"protocol": "RDMA"},
    {"metadata_server": "etcd"}, {"metadata_server": "etcd://"},
    {"metadata_server": "zookeeper://127.0.0.1:2181"}, {"metadata_server": "p2phandshake"},
    {"hostname": "127.0.0.1:1234"},  # P2P picks the port itself
    {"device_name": "mlx5_0, mlx5_1"},
])
def test_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        MooncakeConfig(**kwargs)


def test_config_accepts_good_values() -> None:
    default = MooncakeConfig()
    assert (default.hostname, default.protocol, default.device_name) == ("127.0.0.1", "tcp", "")
    assert default.metadata_server == "P2PHANDSHAKE" and default.is_p2p
    assert MooncakeConfig(hostname="::1").hostname == "::1"  # IPv6: colons but no port
    rdma = MooncakeConfig(protocol="rdma", device_name="mlx5_0,mlx5_1")
    assert (rdma.protocol, rdma.device_name) == ("rdma", "mlx5_0,mlx5_1")
    etcd = MooncakeConfig(hostname="10.0.0.5:17001", metadata_server="etcd://127.0.0.1:2379")
    assert etcd.hostname == "10.0.0.5:17001" and not etcd.is_p2p
    assert etcd.metadata_server == "etcd://127.0.0.1:2379"


def test_active_ib_port_detection(tmp_path: Path) -> None:
    assert not has_active_ib_port(tmp_path / "missing")
    assert not has_active_ib_port(tmp_path)
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("1: DOWN\n")
    assert not has_active_ib_port(tmp_path)
    (port / "state").write_text("4: ACTIVE\n")
    assert has_active_ib_port(tmp_path)


def test_rdma_unavailable_without_infiniband_devices() -> None:
    if has_active_ib_port(IB_SYSFS):
        pytest.skip("this machine has an active InfiniBand/RoCE port")
    assert rdma_available() is False


def test_module_imports_without_mooncake() -> None:
    code = ("import sys; sys.modules['mooncake'] = None\n"
            "import pdcluster.transfer.mooncake_engine as m\n"
            "try:\n    m.MooncakeTransferEngine()\n"
            "except m.TransferError as exc:\n    print('hint:', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "hint:" in out.stdout and "mooncake-transfer-engine-non-cuda" in out.stdout


# ---- the wrapper around a fake binding ----------------------------------------------------

class FakeBinding:
    """Stands in for mooncake.engine.TransferEngine where the real one cannot fail on cue."""

    init_rc = 0
    seen_env: dict[str, str | None] = {}

    def initialize(self, hostname: str, metadata: str, protocol: str, device: str) -> int:
        type(self).seen_env = {k: os.environ.get(k) for k in ("MC_FORCE_TCP",
                                                              "MC_TCP_BIND_ADDRESS",
                                                              "MC_USE_IPV6")}
        return self.init_rc

    def get_rpc_port(self) -> int:
        return 15555


@pytest.fixture
def fake_binding(monkeypatch):
    monkeypatch.setattr(mooncake_engine, "_load_binding", lambda: FakeBinding)
    for name in ("MC_FORCE_TCP", "MC_TCP_BIND_ADDRESS", "MC_USE_IPV6"):
        # setenv first, so that what the engine sets is undone too (an IPv6 host's
        # MC_USE_IPV6 would turn later real engines in this process to IPv6)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    FakeBinding.init_rc = 0
    return FakeBinding


def test_initialize_failure_raises_with_code(fake_binding) -> None:
    fake_binding.init_rc = -1
    with pytest.raises(TransferError, match="initialize") as info:
        MooncakeTransferEngine()
    assert info.value.code == -1


def test_metadata_server_mode_binds_to_the_configured_host(fake_binding) -> None:
    config = MooncakeConfig(hostname="127.0.0.1:17001", metadata_server="etcd://127.0.0.1:1")
    engine = MooncakeTransferEngine(config)
    assert fake_binding.seen_env == {"MC_FORCE_TCP": "1", "MC_TCP_BIND_ADDRESS": "127.0.0.1",
                                     "MC_USE_IPV6": None}
    assert engine.session_id == "127.0.0.1:17001"


def test_p2p_session_id_is_host_and_rpc_port(fake_binding) -> None:
    assert MooncakeTransferEngine().session_id == "127.0.0.1:15555"
    assert fake_binding.seen_env["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"
    assert MooncakeTransferEngine(MooncakeConfig(hostname="::1")).session_id == "[::1]:15555"
    assert fake_binding.seen_env["MC_TCP_BIND_ADDRESS"] == "::1"
    assert fake_binding.seen_env["MC_USE_IPV6"] == "1"


def test_a_wildcard_listener_after_initialize_is_refused(fake_binding, monkeypatch) -> None:
    seen = iter([{("0.0.0.0", 80)}, {("0.0.0.0", 80), ("::", 15556)}])
    monkeypatch.setattr(mooncake_engine, "wildcard_listeners", lambda: next(seen))
    with pytest.raises(TransferError, match=r"\('::', 15556\)"):
        MooncakeTransferEngine()


def test_rdma_without_a_device_warns_that_tcp_is_used(fake_binding, monkeypatch,
                                                      caplog) -> None:
    monkeypatch.setattr(mooncake_engine, "rdma_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="pdcluster.transfer.mooncake_engine"):
        MooncakeTransferEngine(MooncakeConfig(protocol="rdma"))
    assert any("over TCP" in r.getMessage() for r in caplog.records)
    assert fake_binding.seen_env["MC_FORCE_TCP"] is None
    caplog.clear()
    monkeypatch.setattr(mooncake_engine, "rdma_available", lambda: True)
    MooncakeTransferEngine(MooncakeConfig(protocol="rdma"))
    assert not caplog.records


def test_missing_package_raises_install_hint(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(TransferError, match="mooncake-transfer-engine-non-cuda"):
        MooncakeTransferEngine()


# ---- real engines ----------------------------------------------------------------------

def _peer_main(conn, nbytes: int) -> None:
    """Child process: an engine with one registered buffer, driven over a Pipe."""
    engine = MooncakeTransferEngine()
    buf = np.zeros(nbytes, dtype=np.uint8)
    engine.register(buf.ctypes.data, nbytes)
    conn.send((engine.session_id, buf.ctypes.data))
    while True:
        cmd, *args = conn.recv()
        if cmd == "sha256":
            offset, length = args
            conn.send(hashlib.sha256(buf[offset:offset + length]).hexdigest())
        elif cmd == "bytes":
            offset, length = args
            conn.send(buf[offset:offset + length].tobytes())
        elif cmd == "fill":
            offset, data = args
            buf[offset:offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
            conn.send("ok")
        else:
            engine.close()
            conn.send("bye")
            return


class Peer:
    """Parent-side handle of a `_peer_main` process."""

    def __init__(self, nbytes: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_end = ctx.Pipe()
        self.process = ctx.Process(target=_peer_main, args=(child_end, nbytes), daemon=True)
        self.process.start()
        self.session, self.addr = self._recv(timeout_s=30)

    def ask(self, *cmd):
        self._conn.send(cmd)
        return self._recv(timeout_s=10)

    def _recv(self, timeout_s: float):
        assert self._conn.poll(timeout_s), f"peer did not answer (exit {self.process.exitcode})"
        return self._conn.recv()

    def stop(self) -> None:
        assert self.ask("exit") == "bye"
        self.process.join(10)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)


@pytest.fixture(scope="module")
def engine():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MC_TRANSFER_TIMEOUT", str(MC_TIMEOUT_S))
        mp.delenv("MC_FORCE_TCP", raising=False)  # so the engine's setting is undone after
        eng = MooncakeTransferEngine()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def local(engine: MooncakeTransferEngine) -> np.ndarray:
    buf = np.zeros(PEER_NBYTES + 8 * BLOCK, dtype=np.uint8)
    engine.register(buf.ctypes.data, buf.nbytes)
    return buf


@pytest.fixture(scope="module")
def peer():
    handle = Peer(PEER_NBYTES)
    yield handle
    handle.kill()


def addr_of(buf: np.ndarray, offset: int = 0) -> int:
    return buf.ctypes.data + offset


def test_session_id_names_this_engine(engine) -> None:
    host, port = engine.session_id.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) == engine.rpc_port > 0


def test_write_64mib_lands_byte_identical(engine, local, peer) -> None:
    pattern = np.random.default_rng(0).integers(0, 256, PEER_NBYTES, dtype=np.uint8)
    local[:PEER_NBYTES] = ~pattern
    # Untimed first: connection set-up and the peer's first touch of its pages.
    engine.write(peer.session, [addr_of(local)], [peer.addr], [PEER_NBYTES])
    local[:PEER_NBYTES] = pattern
    start = time.perf_counter()
    engine.write(peer.session, [addr_of(local)], [peer.addr], [PEER_NBYTES])
    elapsed = time.perf_counter() - start
    assert peer.ask("sha256", 0, PEER_NBYTES) == hashlib.sha256(pattern).hexdigest()
    print(f"64 MiB write: {PEER_NBYTES / elapsed / 1e9:.2f} GB/s")


def test_scattered_blocks_write_through_coalesce(engine, local, peer) -> None:
    src_blocks = [0, 1, 2, 5, 6, 9]
    dst_blocks = [10, 11, 12, 3, 4, 20]
    for b in src_blocks:
        local[b * BLOCK:(b + 1) * BLOCK] = b + 1
    src, dst, lengths = coalesce([addr_of(local, b * BLOCK) for b in src_blocks],
                                 [peer.addr + b * BLOCK for b in dst_blocks], BLOCK)
    assert len(src) == 3
    engine.write(peer.session, src, dst, lengths)
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        assert peer.ask("bytes", d * BLOCK, BLOCK) == bytes([s + 1]) * BLOCK


def test_read_copies_peer_bytes_into_local_memory(engine, local, peer) -> None:
    data = bytes(range(256)) * 64
    assert peer.ask("fill", 7 * BLOCK, data) == "ok"
    target = PEER_NBYTES  # past what other tests write
    engine.read(peer.session, [addr_of(local, target)], [peer.addr + 7 * BLOCK], [len(data)])
    assert local[target:target + len(data)].tobytes() == data


def test_write_async_reports_done_once(engine, local, peer) -> None:
    local[:BLOCK] = 0xAB
    batch_id = engine.write_async(peer.session, [addr_of(local)], [peer.addr + 40 * BLOCK],
                                  [BLOCK])
    deadline = time.monotonic() + 10
    while (state := engine.status(batch_id)) == "pending" and time.monotonic() < deadline:
        time.sleep(0.001)
    assert state == "done"
    assert peer.ask("bytes", 40 * BLOCK, BLOCK) == b"\xab" * BLOCK
    with pytest.raises(ValueError, match="already reported"):
        engine.status(batch_id)


def test_write_async_failure_is_reported_and_logged(engine, local, peer, caplog) -> None:
    with caplog.at_level(logging.ERROR, logger="pdcluster.transfer.mooncake_engine"):
        batch_id = engine.write_async(peer.session, [addr_of(local)],
                                      [peer.addr + PEER_NBYTES], [BLOCK])
        deadline = time.monotonic() + 10
        while (state := engine.status(batch_id)) == "pending" and time.monotonic() < deadline:
            time.sleep(0.001)
    assert state == "failed"
    assert any(f"batch {batch_id} failed" in r.getMessage() for r in caplog.records)


def test_write_outside_peer_memory_raises_with_code(engine, local, peer) -> None:
    start = time.monotonic()
    with pytest.raises(TransferError) as info:  # straddles the end of the peer's region
        engine.write(peer.session, [addr_of(local)], [peer.addr + PEER_NBYTES - 100], [BLOCK])
    assert info.value.code == -1 and not isinstance(info.value, TransferTimeout)
    assert time.monotonic() - start < 2.0
    engine.write(peer.session, [addr_of(local)], [peer.addr], [BLOCK])  # still usable


def test_unknown_and_dead_peers_raise_promptly(engine, local) -> None:
    with pytest.raises(TransferError):
        engine.write("127.0.0.1:1", [addr_of(local)], [4096], [BLOCK])
    doomed = Peer(BLOCK)
    try:
        engine.write(doomed.session, [addr_of(local)], [doomed.addr], [BLOCK])
        doomed.stop()
        start = time.monotonic()
        with pytest.raises(TransferError):
            engine.write(doomed.session, [addr_of(local)], [doomed.addr], [BLOCK])
        assert time.monotonic() - start < 2.0
    finally:
        doomed.kill()


@pytest.mark.slow
def test_hung_peer_raises_transfer_timeout(engine, local) -> None:
    frozen = Peer(BLOCK)
    try:
        engine.write(frozen.session, [addr_of(local)], [frozen.addr], [BLOCK])
        os.kill(frozen.process.pid, signal.SIGSTOP)
        stat = Path(f"/proc/{frozen.process.pid}/stat")
        deadline = time.monotonic() + 5
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":  # delivery is async
            assert time.monotonic() < deadline, "the peer did not stop"
            time.sleep(0.01)
        start = time.monotonic()
        with pytest.raises(TransferTimeout):
            engine.write(frozen.session, [addr_of(local)], [frozen.addr], [BLOCK])
        assert MC_TIMEOUT_S <= time.monotonic() - start < MC_TIMEOUT_S + 3
    finally:
        frozen.kill()


def test_bad_arguments_raise_value_error(engine, local, peer) -> None:
    src, dst = addr_of(local), peer.addr
    bad_calls = [
        (peer.session, [src, src], [dst], [BLOCK]),
        (peer.session, [src], [dst], [0]),
        (peer.session, [src], [dst], [-BLOCK]),
        (peer.session, [src], [-1], [BLOCK]),
        ("", [src], [dst], [BLOCK]),
        (peer.session, [src + local.nbytes - 10], [dst], [BLOCK]),  # overruns local region
    ]
    for args in bad_calls:
        for call in (engine.write, engine.read, engine.write_async):
            with pytest.raises(ValueError):
                call(*args)
    unregistered = np.ones(BLOCK, dtype=np.uint8)
    with pytest.raises(ValueError, match="registered"):
        engine.write(peer.session, [addr_of(unregistered)], [dst], [BLOCK])
    engine.write(peer.session, [], [], [])  # nothing to move is fine


def test_registration_errors_carry_the_return_code(engine, local) -> None:
    with pytest.raises(ValueError):
        engine.register(addr_of(local), 0)
    with pytest.raises(TransferError) as info:  # overlaps the registered local buffer
        engine.register(addr_of(local, BLOCK), BLOCK)
    assert info.value.code not in (None, 0)
    with pytest.raises(ValueError):
        engine.unregister(addr_of(local, BLOCK))


def test_close_unregisters_and_is_idempotent() -> None:
    eng = MooncakeTransferEngine()
    bufs = [np.zeros(BLOCK, dtype=np.uint8) for _ in range(2)]
    for buf in bufs:
        eng.register(addr_of(buf), BLOCK)
    eng.unregister(addr_of(bufs[0]))
    assert eng.registered_regions == {addr_of(bufs[1]): BLOCK}
    eng.close()
    eng.close()
    assert eng.registered_regions == {}
    with pytest.raises(TransferError, match="closed"):
        eng.register(addr_of(bufs[0]), BLOCK)
    with pytest.raises(TransferError, match="closed"):
        eng.unregister(addr_of(bufs[1]))
    for call in (eng.write, eng.read, eng.write_async):
        with pytest.raises(TransferError, match="closed"):
            call("127.0.0.1:1", [addr_of(bufs[1])], [4096], [BLOCK])


# ---- listeners pinned to the host (transfer/mooncake_bind.py) ------------------------------

def _call_pinned_bind(sock: socket.socket, address: str) -> int:
    family = sock.family
    if family == socket.AF_INET:
        raw = struct.pack("<H", family) + struct.pack(">H", 0) + socket.inet_pton(family, address)
        raw += bytes(8)
    else:
        raw = (struct.pack("<H", family) + struct.pack(">HI", 0, 0)
               + socket.inet_pton(family, address) + bytes(4))
    buf = ctypes.create_string_buffer(raw, len(raw))
    return mooncake_bind._CALLBACK(sock.fileno(), ctypes.addressof(buf), len(raw))


@pytest.mark.parametrize(("family", "wildcard", "bound"), [
    (socket.AF_INET, "0.0.0.0", "127.0.0.1"),
    (socket.AF_INET6, "::", "::ffff:127.0.0.1"),  # a dual-stack socket: IPv4 peers still reach it
])
def test_pinned_bind_swaps_a_wildcard_for_the_host(family, wildcard, bound) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mooncake_bind, "_target", mooncake_bind._targets_for("127.0.0.1"))
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            assert _call_pinned_bind(sock, wildcard) == 0
            assert sock.getsockname()[0] == bound
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            assert _call_pinned_bind(sock, "127.0.0.2") == 0  # a specific address stays
            assert sock.getsockname()[0] == "127.0.0.2"


def test_pinned_bind_reports_bind_errors_to_the_caller() -> None:
    with socket.socket() as taken, socket.socket() as sock:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        raw = (struct.pack("<H", socket.AF_INET) + struct.pack(">H", port)
               + socket.inet_pton(socket.AF_INET, "127.0.0.1") + bytes(8))
        buf = ctypes.create_string_buffer(raw, len(raw))
        assert mooncake_bind._CALLBACK(sock.fileno(), ctypes.addressof(buf), len(raw)) == -1


def test_engine_binary_imports_bind_through_a_patchable_slot() -> None:
    from mooncake import engine as binding

    assert mooncake_bind._import_slots(os.path.realpath(binding.__file__), b"bind")


def test_real_engine_listens_on_the_host_only() -> None:
    from tests.security.listeners import listening_sockets

    before = {(s.address, s.port) for s in listening_sockets(os.getpid())}
    with MooncakeTransferEngine() as eng:
        new = [s for s in listening_sockets(os.getpid()) if (s.address, s.port) not in before]
        assert eng.rpc_port in {s.port for s in new}
        assert len(new) >= 2, new  # the handshake/RPC port and the TCP data port
        assert {s.address for s in new} == {"127.0.0.1"}, new
