"""The single wrapper around Mooncake's TransferEngine: the only module that imports `mooncake`.

It owns the C return codes: every non-zero code becomes a `TransferError` (with `.code`), or a
`TransferTimeout` when the call ran into Mooncake's transfer timeout; argument mistakes are
`ValueError`, checked before any C call. `mooncake` is imported lazily, so this module imports
anywhere; using the engine without the package raises `TransferError` with an install hint.

API:
- `MooncakeConfig(hostname, protocol, device_name, metadata_server)`: frozen, validated.
- `MooncakeTransferEngine(config)`: `.session_id` (what peers pass as `peer`),
  `register(addr, length)` / `unregister(addr)`, `write(peer, src_addrs, dst_addrs, lengths)`,
  `read(peer, local_addrs, remote_addrs, lengths)`, `write_async(...) -> batch id` +
  `status(batch_id)`, `close()` (also a context manager).
- Re-exported: `coalesce` (transfer/descriptors.py) and `rdma_available` (transfer/rdma.py):
  Mooncake silently falls back to TCP, so RDMA is detected by hand.

Binding facts (mooncake-transfer-engine 0.3.13): batch calls return 0 or -1 (failure and timeout
alike), busy-wait with the GIL released, and time out after `MC_TRANSFER_TIMEOUT` seconds
(read when the engine is built, at least 5, default 30) plus 1 ns per byte. The binding's own
async status call (`get_batch_transfer_status`) blocks until the batches finish and frees their
ids, so it cannot poll; `write_async` runs the sync call on a small thread pool instead.
Mooncake picks RDMA whenever it finds a device, whatever `protocol` says, so "tcp" sets
`MC_FORCE_TCP`. Destroying an engine takes about 1 s inside Mooncake.

Listeners: Mooncake binds its handshake/RPC port and its TCP data port to the wildcard address
and has no setting to change that; `MC_TCP_BIND_ADDRESS` (set here in every mode) only picks
the address it publishes. transfer/mooncake_bind.py redirects those binds to the configured
host, and the engine refuses to start if a wildcard listener appears anyway. An IPv6 host sets
`MC_USE_IPV6`, without which Mooncake's handshake socket is IPv4-only.
"""

from __future__ import annotations

import bisect
import ipaddress
import itertools
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from pdcluster.transfer.descriptors import coalesce
from pdcluster.transfer.errors import TransferError, TransferTimeout
from pdcluster.transfer.mooncake_bind import pin_binds, wildcard_listeners
from pdcluster.transfer.rdma import has_active_ib_port, rdma_available

logger = logging.getLogger(__name__)

P2P_HANDSHAKE = "P2PHANDSHAKE"
PROTOCOLS = frozenset({"tcp", "rdma"})
METADATA_SCHEMES = frozenset({"etcd", "redis", "http", "https"})
INSTALL_HINT = ("install mooncake-transfer-engine-non-cuda (CPU machines) or "
                "mooncake-transfer-engine (CUDA machines), not both")
BatchStatus = Literal["pending", "done", "failed"]

__all__ = ["BatchStatus", "MooncakeConfig", "MooncakeTransferEngine", "coalesce",
           "has_active_ib_port", "rdma_available"]


@dataclass(frozen=True, slots=True)
class MooncakeConfig:
    """How the transfer engine starts. With P2P handshake the hostname is a bare host (Mooncake
    picks the RPC port); with a metadata server it names this engine's segment and may carry
    ":port" to stay unique among engines on one host."""

    hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device_name: str = ""  # RDMA devices, comma-separated ("mlx5_0,mlx5_1"); "" = all
    metadata_server: str = P2P_HANDSHAKE  # or "etcd://host:port", "redis://…", "http://…"

    def __post_init__(self) -> None:
        if not self.hostname or any(c.isspace() for c in self.hostname):
            raise ValueError(f"hostname must be a non-empty host name, got {self.hostname!r}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {sorted(PROTOCOLS)}, got "
                             f"{self.protocol!r}")
        if any(c.isspace() for c in self.device_name):
            raise ValueError(f"device_name must not contain spaces: {self.device_name!r}")
        if self.is_p2p:
            if ":" in self.hostname and not _is_ipv6(self.hostname):
                raise ValueError("with P2PHANDSHAKE the hostname is a bare host (Mooncake "
                                 f"picks the port), got {self.hostname!r}")
        else:
            _check_metadata_url(self.metadata_server)

    @property
    def is_p2p(self) -> bool:
        return self.metadata_server == P2P_HANDSHAKE


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def _check_metadata_url(url: str) -> None:
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in METADATA_SCHEMES or not rest or any(c.isspace() for c in url):
        raise ValueError(f"metadata_server must be {P2P_HANDSHAKE!r} or <scheme>://<address> "
                         f"with scheme in {sorted(METADATA_SCHEMES)}, got {url!r}")


def _load_binding() -> type:
    try:
        from mooncake.engine import TransferEngine
    except (ImportError, OSError) as exc:  # the CUDA build raises OSError without a driver
        raise TransferError(f"cannot import Mooncake ({exc}): {INSTALL_HINT}") from exc
    return TransferEngine


def _binding_timeout_s() -> float:
    # Mirrors the binding's constructor: atoi(MC_TRANSFER_TIMEOUT) clamped to >= 5, default 30.
    raw = os.environ.get("MC_TRANSFER_TIMEOUT")
    if raw is None:
        return 30.0
    digits = re.match(r"\s*[+-]?\d+", raw)
    return float(max(5, int(digits.group()) if digits else 0))


class MooncakeTransferEngine:
    """One Mooncake engine per process: registered local memory, batch writes and reads.

    Thread-safe: the binding serialises its own state; registrations are guarded here."""

    def __init__(self, config: MooncakeConfig | None = None, *, async_workers: int = 2) -> None:
        if async_workers < 1:
            raise ValueError(f"async_workers must be >= 1, got {async_workers}")
        self.config = config or MooncakeConfig()
        self._lock = threading.Lock()
        self._regions: dict[int, int] = {}  # start address -> length
        self._region_starts: list[int] = []  # sorted, for bisect
        self._batches: dict[int, Future[None]] = {}
        self._batch_ids = itertools.count(1)
        self._async_workers = async_workers
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        self._prepare_environment()
        self._timeout_s = _binding_timeout_s()
        binding = _load_binding()
        _pin_listeners(binding, _host_part(self.config.hostname))
        listeners_before = wildcard_listeners()
        self._engine = binding()
        cfg = self.config
        rc = self._engine.initialize(cfg.hostname, cfg.metadata_server, cfg.protocol,
                                     cfg.device_name)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({cfg}) failed", code=rc)
        exposed = wildcard_listeners() - listeners_before
        if exposed:
            self._engine = None
            raise TransferError(f"Mooncake listens on {sorted(exposed)}, not only on "
                                f"{_host_part(cfg.hostname)}: refusing to expose its memory")
        self._rpc_port = int(self._engine.get_rpc_port())
        logger.info("Mooncake engine up: session %s, protocol %s", self.session_id, cfg.protocol)

    def _prepare_environment(self) -> None:
        # Mooncake reads these with getenv while initialising, so they are process-wide.
        cfg = self.config
        if cfg.protocol == "rdma" and not rdma_available():
            logger.warning("protocol 'rdma' requested but no usable RDMA device was found: "
                           "Mooncake will run over TCP")
        elif cfg.protocol == "rdma" and os.environ.get("MC_FORCE_TCP"):
            logger.warning("protocol 'rdma' requested but MC_FORCE_TCP is set: TCP it is")
        if cfg.protocol == "tcp":
            # Mooncake picks its transport from the devices it finds, not from `protocol`.
            os.environ["MC_FORCE_TCP"] = "1"
        # Otherwise Mooncake publishes its first non-loopback address (metadata-server mode;
        # P2P mode publishes the hostname and ignores it). It binds nothing: see _pin_listeners.
        os.environ["MC_TCP_BIND_ADDRESS"] = _host_part(cfg.hostname)
        if _is_ipv6(_host_part(cfg.hostname)):
            # Its handshake socket is IPv4-only otherwise: a wildcard no host can replace.
            os.environ["MC_USE_IPV6"] = "1"

    @property
    def session_id(self) -> str:
        """What peers pass as `peer`: "host:rpc_port" with P2P handshake, else the hostname."""
        if not self.config.is_p2p:
            return self.config.hostname
        host = self.config.hostname
        return f"[{host}]:{self._rpc_port}" if _is_ipv6(host) else f"{host}:{self._rpc_port}"

    @property
    def rpc_port(self) -> int:
        return self._rpc_port

    def register(self, addr: int, length: int) -> None:
        """Register [addr, addr + length) for transfers; overlapping an earlier region fails."""
        if addr <= 0 or length <= 0:
            raise ValueError(f"cannot register addr={addr:#x} length={length}")
        engine = self._live_engine()
        with self._lock:
            rc = engine.register_memory(addr, length)
            if rc != 0:
                raise TransferError(f"register_memory({addr:#x}, {length}) failed", code=rc)
            self._regions[addr] = length
            bisect.insort(self._region_starts, addr)

    def unregister(self, addr: int) -> None:
        engine = self._live_engine()
        with self._lock:
            if addr not in self._regions:
                raise ValueError(f"{addr:#x} is not the start of a registered region")
            rc = engine.unregister_memory(addr)
            if rc != 0:
                raise TransferError(f"unregister_memory({addr:#x}) failed", code=rc)
            del self._regions[addr]
            self._region_starts.remove(addr)

    @property
    def registered_regions(self) -> dict[int, int]:
        with self._lock:
            return dict(self._regions)

    def write(self, peer: str, src_addrs: Sequence[int], dst_addrs: Sequence[int],
              lengths: Sequence[int]) -> None:
        """Copy local `src_addrs[i]` to the peer's `dst_addrs[i]`, `lengths[i]` bytes each;
        returns when all bytes have landed. Empty lists are a no-op."""
        self._check_args(peer, src_addrs, dst_addrs, lengths)
        self._run("write", peer, src_addrs, dst_addrs, lengths)

    def read(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
             lengths: Sequence[int]) -> None:
        """Copy the peer's `remote_addrs[i]` into local `local_addrs[i]`."""
        self._check_args(peer, local_addrs, remote_addrs, lengths)
        self._run("read", peer, local_addrs, remote_addrs, lengths)

    def write_async(self, peer: str, src_addrs: Sequence[int], dst_addrs: Sequence[int],
                    lengths: Sequence[int]) -> int:
        """Start `write` in the background and return a batch id for `status`."""
        self._check_args(peer, src_addrs, dst_addrs, lengths)
        args = (peer, list(src_addrs), list(dst_addrs), list(lengths))
        with self._lock:
            if self._closed:
                raise TransferError("the transfer engine is closed")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._async_workers,
                                                    thread_name_prefix="mooncake-write")
            batch_id = next(self._batch_ids)
            future = self._executor.submit(self._write_logged, batch_id, *args)
            self._batches[batch_id] = future
        return batch_id

    def _write_logged(self, batch_id: int, peer: str, src_addrs: list[int],
                      dst_addrs: list[int], lengths: list[int]) -> None:
        # Logged inside the batch, so the error is in the log before `status` can say "failed".
        try:
            self._run("write", peer, src_addrs, dst_addrs, lengths)
        except Exception as exc:
            logger.error("async write batch %s failed: %s", batch_id, exc)
            raise

    def status(self, batch_id: int) -> BatchStatus:
        """"pending", "done" or "failed" (the error was logged at ERROR). A terminal status is
        reported once; the id is forgotten afterwards."""
        with self._lock:
            future = self._batches.get(batch_id)
            if future is None:
                raise ValueError(f"unknown or already reported batch id {batch_id}")
            if not future.done():
                return "pending"
            del self._batches[batch_id]
        return "failed" if future.exception() is not None else "done"

    def close(self) -> None:
        """Wait for background writes, unregister all memory, release the engine. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)  # memory must stay registered until writes end
        for addr, length in self.registered_regions.items():
            rc = self._engine.unregister_memory(addr)
            if rc != 0:
                logger.error("unregister_memory(%#x, %s) failed at close: rc=%s",
                             addr, length, rc)
        with self._lock:
            self._regions.clear()
            self._region_starts.clear()
        self._engine = None

    def __enter__(self) -> MooncakeTransferEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _live_engine(self):  # -> mooncake.engine.TransferEngine, not importable here
        if self._closed or self._engine is None:
            raise TransferError("the transfer engine is closed")
        return self._engine

    def _run(self, op: Literal["write", "read"], peer: str, local: Sequence[int],
             remote: Sequence[int], lengths: Sequence[int]) -> None:
        if not lengths:
            return
        engine = self._live_engine()
        call: Callable[..., int] = (engine.batch_transfer_sync_write if op == "write"
                                    else engine.batch_transfer_sync_read)
        started = time.monotonic()
        rc = call(peer, list(local), list(remote), list(lengths))
        if rc != 0:
            raise self._failure(op, peer, rc, time.monotonic() - started, sum(lengths))

    def _failure(self, op: str, peer: str, rc: int, elapsed_s: float,
                 nbytes: int) -> TransferError:
        # The binding returns -1 for both failure and timeout; only the clock tells them apart.
        what = f"{op} of {nbytes} bytes with peer {peer} after {elapsed_s:.3f}s"
        if elapsed_s >= self._timeout_s:
            return TransferTimeout(f"{what}: timed out ({self._timeout_s:g}s)", code=rc)
        return TransferError(f"{what} failed (unreachable peer, or an address outside its "
                             "registered memory)", code=rc)

    def _check_args(self, peer: str, local: Sequence[int], remote: Sequence[int],
                    lengths: Sequence[int]) -> None:
        self._live_engine()
        if not isinstance(peer, str) or not peer:
            raise ValueError(f"peer must be a session id 'host:port', got {peer!r}")
        if not len(local) == len(remote) == len(lengths):
            raise ValueError(f"{len(local)} local addresses, {len(remote)} remote addresses "
                             f"and {len(lengths)} lengths")
        if any(n <= 0 for n in lengths) or any(a <= 0 for a in remote):
            raise ValueError("lengths and remote addresses must be positive")
        for addr, n in zip(local, lengths, strict=True):
            self._check_local(addr, n)

    def _check_local(self, addr: int, length: int) -> None:
        # TCP would happily read unregistered memory; RDMA would not: fail the same way on both.
        with self._lock:
            i = bisect.bisect_right(self._region_starts, addr) - 1
            start = self._region_starts[i] if i >= 0 else None
            inside = start is not None and addr + length <= start + self._regions[start]
        if not inside:
            raise ValueError(f"local range [{addr:#x}, +{length}) is not inside a registered "
                             "region")


def _pin_listeners(binding: type, host: str) -> None:
    module = sys.modules.get(binding.__module__)
    path = getattr(module, "__file__", None)
    if path is None or not binding.__module__.startswith("mooncake"):
        return  # a stand-in binding (tests) opens no sockets
    try:
        pin_binds(os.path.dirname(path), host)
    except (OSError, ValueError, IndexError) as exc:  # wildcard_listeners() still guards
        logger.error("cannot pin Mooncake's listeners to %s: %s", host, exc)


def _host_part(hostname: str) -> str:
    if _is_ipv6(hostname):
        return hostname
    return hostname.rsplit(":", 1)[0] if ":" in hostname else hostname

