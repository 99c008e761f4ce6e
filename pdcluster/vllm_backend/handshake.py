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
  mode of `curve`).
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
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.identity import Directory, Peer

_CURVE = "curve"
_KV_ADDRESS = "kv-address"
_KV_SESSION = "kv-session"
_PEERS = "peers"


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
    """The connector's side: a key directory that follows the node's `peers` file (None when
    the node runs in the shared-key mode)."""
    path = Path(folder) / _PEERS
    if not path.is_file():
        return None

    def peers() -> list[Peer]:
        return [Peer(p["principal"], p["public_key"].encode(), p["request_address"],
                     p["kv_address"], p["kv_session"], bytes.fromhex(p.get("ticket_key", "")))
                for p in json.loads(path.read_text())]

    directory = Directory(refresh=peers, min_refresh_s=0.05)
    directory.refresh_now(force=True)
    return directory.follow(0.5)


def _write_private(path: Path, text: str) -> None:
    # Written under another name, then renamed: a reader never sees half a file.
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
