"""The private folder a node shares with the vLLM processes it starts.

vLLM runs its scheduler in an engine-core process and its model (with pdcluster's connector
worker) in a worker process; the node talks to them through vLLM's own channels, and to its
connector through this folder (mode 0700, files 0600, removed when the engine closes):

- `curve`: the node's CURVE key pair, which the connector's side channel serves and connects
  with. Passing it through vLLM's config would print it in vLLM's start-up log. The worker
  takes it once (`take_curve`) and leaves a marker in its place: a node killed later (no
  `close`, so the folder stays behind) leaves no key on disk, and a second reader fails
  instead of silently serving without CURVE.
- `kv-address`: written by the connector's worker once its side channel is bound: the
  address peers send KV requests to, which the node registers in the metadata service.
- `kv-events`, `kv-replay`: the `ipc://` endpoints of vLLM's KV event publisher.
- `wake` (the node listens) and `lookups` (the connector's scheduler side listens): the
  connector's worker announces a peer's prefix pull, which vLLM's scheduler must look up,
  while vLLM's engine may be asleep (vllm_backend/pulls.py).

The folder lives under the system temp folder with a short name: a `ipc://` path must fit in
a Unix socket address (107 bytes).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from pdcluster.core.credentials import CurveKeys

_CURVE = "curve"
_KV_ADDRESS = "kv-address"


class Handshake:
    """The node's side: makes the folder, leaves the keys, waits for the KV address."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pdv-"))  # mkdtemp makes it 0700

    def write_curve(self, keys: CurveKeys | None) -> None:
        if keys is None:
            return
        payload = json.dumps({"public": keys.public.decode(), "secret": keys.secret.decode()})
        _write_private(self.dir / _CURVE, payload)

    def wait_kv_address(self, timeout_s: float, alive=lambda: True) -> str:
        """The connector's side-channel address, once its worker has bound it. `alive`: a
        check that the engine is still starting (False ends the wait early)."""
        path = self.dir / _KV_ADDRESS
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and alive():
            if path.is_file():
                return path.read_text().strip()
            time.sleep(0.05)
        raise TimeoutError(f"the vLLM connector did not report its KV address in {timeout_s:g} s")

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def endpoint(folder: str | Path, name: str) -> str:
    """The `ipc://` endpoint `name` of the folder (`kv-events`, `wake`, `lookups`, ...)."""
    return f"ipc://{Path(folder) / name}"


def take_curve(folder: str | Path) -> CurveKeys | None:
    """The connector's side: the node's keys (None if the node runs without CURVE), read
    once: the file keeps only a marker afterwards."""
    path = Path(folder) / _CURVE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data.get("taken"):
        raise RuntimeError(f"the node's CURVE keys in {folder} were taken already (by pid "
                           f"{data['taken']}): one connector worker per node")
    _write_private(path, json.dumps({"taken": os.getpid()}))
    return CurveKeys(public=data["public"].encode(), secret=data["secret"].encode())


def write_kv_address(folder: str | Path, address: str) -> None:
    _write_private(Path(folder) / _KV_ADDRESS, address)


def _write_private(path: Path, text: str) -> None:
    # Written under another name, then renamed: a reader never sees half a file.
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
