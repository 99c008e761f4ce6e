"""The private folder a node shares with the vLLM processes it starts.

vLLM runs its scheduler in an engine-core process and its model (with pdcluster's connector
worker) in a worker process; the node talks to them through vLLM's own channels, and to its
connector through this folder (mode 0700, files 0600, removed when the engine closes):

- `curve`: where to find the node's CURVE key pair, which the connector's side channel
  serves and connects with — not the keys. The keys live in an anonymous in-memory file of
  the node process (`memfd_create`), never linked into any folder; `curve` names it as
  `/proc/<node pid>/fd/<n>`, which only this user's processes may open. A node that dies
  at any moment (SIGKILL before the worker took them included) leaves no key anywhere: the
  kernel frees the file with the last process holding it, and vLLM's processes die with the
  node (lifeline.py). Passing the keys through vLLM's config would print them in vLLM's
  start-up log; an environment variable would reach every process vLLM starts. The worker
  takes them once (`take_curve`), overwriting them with a marker, and the node closes its
  file once the worker reported its KV address: a second reader fails instead of silently
  serving without CURVE.
- `kv-address`, `kv-session`: written by the connector's worker once its side channel is
  bound: the address peers send KV requests to and its transfer-engine session, which the
  node registers in the metadata service.
- `peers`: the node's key directory (core.identity), rewritten whenever it changes: whom the
  connector's side channel admits and which principal may send what (absent: the shared-key
  mode of `curve`). `directory` (the node listens, `DirectoryServer`): the connector's copy
  (`read_directory`) asks the node on a miss, and the node asks the metadata service, as
  the own engine's connector does itself; the copy then reads the rewritten file. Without
  it, a node registered after the node's last periodic refresh (every 2 s) stayed unknown
  to the connector until the next one, and its KV was refused.
- `kv-events`, `kv-replay`: the `ipc://` endpoints of vLLM's KV event publisher.
- `wake` (the node listens) and `lookups` (the connector's scheduler side listens): the
  connector's worker announces a peer's prefix pull, which vLLM's scheduler must look up,
  while vLLM's engine may be asleep (vllm_backend/pulls.py).
- `lost` (the connector's scheduler side listens): the node passes on the router's word that
  a transfer's prefill node is lost (vllm_backend/lost.py).

The folder lives under the system temp folder with a short name: a `ipc://` path must fit in
a Unix socket address (107 bytes). It is removed by `close` and, failing that, when the
node's interpreter exits; a SIGKILLed node leaves it behind, holding no secret.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path

import zmq

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.identity import Directory, Peer

_CURVE = "curve"
_KV_ADDRESS = "kv-address"
_KV_SESSION = "kv-session"
_PEERS = "peers"
_DIRECTORY = "directory"
ASK_TIMEOUT_S = 2.0  # the connector's wait for the node's refresh (then it reads what is there)

logger = logging.getLogger(__name__)


class Handshake:
    """The node's side: makes the folder, leaves the keys, waits for the KV address."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pdv-"))  # mkdtemp makes it 0700
        self._curve_fd = -1
        # Removed at interpreter exit too, when nobody called close
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)

    def write_curve(self, keys: CurveKeys | None) -> None:
        if keys is None:
            return
        payload = json.dumps({"public": keys.public.decode(), "secret": keys.secret.decode()})
        self._curve_fd = os.memfd_create("pdv-curve")  # close-on-exec; Linux only
        os.write(self._curve_fd, payload.encode())
        _write_private(self.dir / _CURVE, json.dumps({"pid": os.getpid(),
                                                      "fd": self._curve_fd}))

    def forget_curve(self) -> None:
        """Close the node's in-memory key file (the worker took the keys)."""
        if self._curve_fd >= 0:
            os.close(self._curve_fd)
            self._curve_fd = -1

    def write_peers(self, peers: list[Peer]) -> None:
        payload = json.dumps([{"principal": p.principal, "public_key": p.public_key.decode(),
                               "request_address": p.request_address,
                               "kv_address": p.kv_address, "kv_session": p.kv_session,
                               "ticket_key": p.ticket_key.hex()}
                              for p in peers])
        _write_private(self.dir / _PEERS, payload)

    def kv_session(self) -> str:
        """The connector's transfer-engine session (once the KV address is there)."""
        path = self.dir / _KV_SESSION
        return path.read_text().strip() if path.is_file() else ""

    def wait_kv_address(self, timeout_s: float, alive=lambda: True) -> str:
        """The connector's side-channel address, once its worker has bound it. `alive`: a
        check that the engine is still starting (False ends the wait early)."""
        path = self.dir / _KV_ADDRESS
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and alive():
            if path.is_file():  # bound after it took the keys: the node's copy can go
                self.forget_curve()
                return path.read_text().strip()
            time.sleep(0.05)
        raise TimeoutError(f"the vLLM connector did not report its KV address in {timeout_s:g} s")

    def close(self) -> None:
        self.forget_curve()
        self._cleanup()


def endpoint(folder: str | Path, name: str) -> str:
    """The `ipc://` endpoint `name` of the folder (`kv-events`, `wake`, `lookups`, ...)."""
    return f"ipc://{Path(folder) / name}"


def take_curve(folder: str | Path) -> CurveKeys | None:
    """The connector's side: the node's keys (None if the node runs without CURVE), read
    once: the file keeps only a marker afterwards."""
    path = Path(folder) / _CURVE
    if not path.is_file():
        return None
    where = json.loads(path.read_text())
    source = f"/proc/{where['pid']}/fd/{where['fd']}"
    try:
        fd = os.open(source, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise RuntimeError(f"the node's CURVE keys ({source}) are gone: taken already, or the "
                           f"node is gone ({exc}); one connector worker per node") from exc
    try:
        data = json.loads(os.pread(fd, 1 << 16, 0))
        if data.get("taken"):
            raise RuntimeError(f"the node's CURVE keys in {folder} were taken already (by pid "
                               f"{data['taken']}): one connector worker per node")
        os.ftruncate(fd, 0)  # the secret leaves the node's file as this worker takes it
        os.pwrite(fd, json.dumps({"taken": os.getpid()}).encode(), 0)
    finally:
        os.close(fd)
    return CurveKeys(public=data["public"].encode(), secret=data["secret"].encode())


def write_kv_address(folder: str | Path, address: str, session: str = "") -> None:
    _write_private(Path(folder) / _KV_SESSION, session)  # before the address: read after it
    _write_private(Path(folder) / _KV_ADDRESS, address)


def read_directory(folder: str | Path) -> Directory | None:
    """The connector's side: a key directory that follows the node's `peers` file and asks
    the node on a miss (None when the node runs in the shared-key mode)."""
    path = Path(folder) / _PEERS
    if not path.is_file():
        return None

    def peers() -> list[Peer]:
        return [Peer(p["principal"], p["public_key"].encode(), p["request_address"],
                     p["kv_address"], p["kv_session"], bytes.fromhex(p.get("ticket_key", "")))
                for p in json.loads(path.read_text())]

    directory = NodeCopy(peers, endpoint(folder, _DIRECTORY))
    directory.refresh_now(force=True)
    return directory.follow(0.5)


class NodeCopy(Directory):
    """The connector's copy of the node's directory. A lookup that misses asks the node to
    ask the service (`DirectoryServer`), waits for its answer (at most `ASK_TIMEOUT_S`), then
    reads the node's file again."""

    def __init__(self, refresh: Callable[[], Iterable[Peer]], ask_address: str) -> None:
        super().__init__(refresh=refresh, min_refresh_s=0.05)
        self._ask_address = ask_address
        self._ask_lock = threading.Lock()  # misses come from several threads; one socket

    def refresh_since(self, missed_at: float) -> bool:
        self._ask_node()
        # read after the node's answer: a periodic read between the miss and the node's
        # rewrite would otherwise count as fresh
        return super().refresh_since(max(missed_at, self._clock()))

    def _ask_node(self) -> None:
        with self._ask_lock:
            sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(self._ask_address)
                sock.send(b"refresh")
                if not sock.poll(int(ASK_TIMEOUT_S * 1000)):
                    logger.warning("the node did not refresh its key directory within %g s",
                                   ASK_TIMEOUT_S)
                    return
                sock.recv()
            finally:
                sock.close()


class DirectoryServer:
    """The node's side of `NodeCopy`: a thread answering the connector's misses. Each asks the
    service once more (`Directory.refresh_since`: at most one call per the directory's
    `min_refresh_s`, so a flood of strangers' keys costs the service no more than the node's
    own misses); the node's subscription has rewritten the `peers` file before the answer."""

    def __init__(self, folder: str | Path, directory: Directory) -> None:
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint(folder, _DIRECTORY))
        self._directory, self._stop = directory, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="vllm-directory")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            self._sock.recv()
            refreshed = self._directory.refresh_since(time.monotonic())
            self._sock.send(b"1" if refreshed else b"0")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


def _write_private(path: Path, text: str) -> None:
    # Written under another name, then renamed: a reader never sees half a file.
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
