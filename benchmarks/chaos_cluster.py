"""The cluster the chaos benchmark breaks: every part a real process it can signal.

`ChaosCluster(settings).start()` runs, on 127.0.0.1:
- optionally etcd (`backend="etcd"`), on fixed ports and its own data folder, so it can be
  killed and started again in place;
- the metadata service, `pdcluster metadata serve`, as its own process on a fixed port (a
  restart keeps the address every node and the router know);
- prefill and decode node actors on a local Ray (`cluster.ray_cluster.RayCluster`, Ray
  restarting a killed actor under the same node id), running the own engine or vLLM
  (`engine="vllm"`: every node, with vLLM's block size and hashes, which the router takes
  from their registrations);
- the router, `pdcluster router serve`, as its own process, on a port picked as it starts
  and found up when HTTP answers there.

Processes are found by pid for signals and RSS (`pids()`); `stop()` ends what it started. The
cluster secret is made here and handed to the subprocesses in their environment.

API: `ChaosSettings`, `ChaosCluster`.
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.chaos_procs import descendants, reap
from pdcluster.benchmarks.ports import free_port
from pdcluster.core.credentials import ROUTER_TOKEN_ENV, SECRET_ENV, SERVICE, ClusterSecret

if TYPE_CHECKING:
    from pdcluster.cluster.ray_cluster import RayCluster

ENGINES = ("pdcluster", "vllm")
# the own engine takes any block size; vLLM's CPU kernels a multiple of 32
BLOCK_SIZES = {"pdcluster": 16, "vllm": 32}
NODE_START_S = {"pdcluster": 120.0, "vllm": 600.0}


@dataclass(frozen=True, slots=True)
class ChaosSettings:
    model: str
    num_prefill: int = 2
    num_decode: int = 2
    backend: str = "memory"  # the metadata service's: "memory" or "etcd"
    lease_ttl_s: int = 4
    kv_timeout_s: float = 30.0
    kv_blocks: int = 512
    local_prefill_threshold: int = 16
    global_reuse_min_tokens: int = 64
    node_cpus: float = 0.25
    engine: str = "pdcluster"  # the nodes' engine: "pdcluster" or "vllm"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")

    @property
    def block_size(self) -> int:
        return BLOCK_SIZES[self.engine]

    @property
    def node_start_s(self) -> float:
        """How long a node may take to start (or restart after a kill): a vLLM node starts
        three processes that each import torch and vLLM, a minute or more on a busy CPU."""
        return NODE_START_S[self.engine]

    def engine_options(self) -> dict[str, object]:
        """The nodes' `engine` section (cluster.config.ClusterConfig)."""
        options: dict[str, object] = {"block_size": self.block_size,
                                      "num_kv_blocks": self.kv_blocks}
        if self.engine != "pdcluster":
            options["backend"] = self.engine
        return options


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdcluster.cluster.cli", *args]


class ChaosCluster:
    def __init__(self, settings: ChaosSettings) -> None:
        self.settings = settings
        self.secret = ClusterSecret.generate()
        self._tmp = tempfile.TemporaryDirectory(prefix="pdcluster-chaos-")
        self.tmp = Path(self._tmp.name)
        self.etcd_port, self.etcd_peer_port = free_port(), free_port()
        self.metadata_port, self.router_port = free_port(), 0  # router: as it starts
        self.etcd: subprocess.Popen | None = None
        self.metadata: subprocess.Popen | None = None
        self.router: subprocess.Popen | None = None
        self.ray: RayCluster | None = None
        self.left_running: list[str] = []  # node processes that outlived stop(), killed

    @property
    def metadata_address(self) -> str:
        return f"127.0.0.1:{self.metadata_port}"

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def actors(self) -> dict:
        return self.ray.actors if self.ray is not None else {}

    def _env(self) -> dict[str, str]:
        return {**os.environ, SECRET_ENV: self.secret.to_text(),
                # the router's client credential (it needs no secret)
                ROUTER_TOKEN_ENV: self.secret.metadata_token(SERVICE)}

    def start(self) -> ChaosCluster:
        from pdcluster.cluster.config import ClusterConfig
        from pdcluster.cluster.ray_cluster import RayCluster

        s = self.settings
        if s.backend == "etcd":
            self.start_etcd()
        self.start_metadata()
        config = ClusterConfig(
            model=s.model, num_prefill=s.num_prefill, num_decode=s.num_decode,
            engine=s.engine_options(),
            kv_timeout_s=s.kv_timeout_s, metadata_address=self.metadata_address,
            node_cpus=s.node_cpus, max_restarts=100, lease_ttl_s=s.lease_ttl_s)
        self.ray = RayCluster(config, cluster_secret=self.secret).start(
            timeout_s=s.node_start_s)
        self.start_router()
        return self

    def start_etcd(self) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed (Debian package etcd-server)")
        url = f"http://127.0.0.1:{self.etcd_port}"
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        self.etcd = subprocess.Popen(
            [binary, "--name", "chaos", "--data-dir", str(self.tmp / "etcd"),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"chaos={peer}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.etcd_port, self.etcd, "etcd")

    def start_metadata(self) -> None:
        s = self.settings
        args = ["metadata", "serve", "--port", str(self.metadata_port), "--backend", s.backend,
                "--lease-ttl", str(s.lease_ttl_s), "--etcd", f"127.0.0.1:{self.etcd_port}"]
        self.metadata = subprocess.Popen(_cli(*args), env=self._env(),
                                         stdout=subprocess.DEVNULL, stderr=self._log("metadata"))
        _wait_port(self.metadata_port, self.metadata, "the metadata service")

    def start_router(self, attempts: int = 3) -> None:
        """Its port is picked as it starts, not with the others: Ray's processes, started
        meanwhile, bind free ports of their own (once a Ray gRPC server answered on the
        router's port, the router itself gone). It is ready when HTTP answers there; a port
        taken before the router bound it means another port."""
        s = self.settings
        for attempt in range(1, attempts + 1):
            self.router_port = free_port()
            args = ["router", "serve", "--port", str(self.router_port), "--model", s.model,
                    "--metadata", self.metadata_address,
                    "--local-prefill-threshold", str(s.local_prefill_threshold),
                    "--global-reuse-min-tokens", str(s.global_reuse_min_tokens),
                    "--max-migrations", "1"]
            self.router = subprocess.Popen(_cli(*args), env=self._env(),
                                           stdout=subprocess.DEVNULL, stderr=self._log("router"))
            try:
                _wait_http(f"{self.router_url}/health", self.router, "the router")
                return
            except RuntimeError:
                taken = "address already in use" in self.log_tail("router").lower()
                if not taken or attempt == attempts:
                    raise

    def _log(self, name: str):
        return open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 (the child owns it)

    def log_tail(self, name: str, num_chars: int = 2000) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""

    def node_pids(self, timeout_s: float = 60.0) -> dict[str, int]:
        import ray

        return dict(zip(self.actors, ray.get([a.pid.remote() for a in self.actors.values()],
                                             timeout=timeout_s), strict=True))

    def pids(self) -> dict[str, int]:
        """The processes whose memory the soak samples: router, metadata service, nodes."""
        assert self.router is not None and self.metadata is not None, "the cluster is not up"
        pids = {"router": self.router.pid, "metadata": self.metadata.pid}
        return {**pids, **self.node_pids()}

    def kill_metadata(self) -> None:
        _kill(self.metadata)

    def kill_etcd(self) -> None:
        _kill(self.etcd)

    def stop(self) -> None:
        """End everything started here. Node processes (and their children: vLLM's) still
        running once Ray has shut down are killed and named in `left_running`."""
        for proc in (self.router, self.metadata):
            _kill(proc)
        if self.ray is not None:
            node_procs = self._node_processes()
            self.ray.stop(drain_timeout_s=5)
            self.ray = None
            self.left_running = reap(node_procs).orphans_killed
        _kill(self.etcd)
        self._tmp.cleanup()

    def _node_processes(self) -> list[int]:
        try:
            pids = list(self.node_pids(timeout_s=10).values())
        except Exception:  # a node restarting: its processes are Ray's to end
            return []
        return pids + [child for pid in pids for child in descendants(pid)]


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGCONT)  # a stopped process cannot die until it runs
        proc.kill()
        proc.wait(timeout=30)


def _wait_http(url: str, proc: subprocess.Popen, what: str) -> None:
    """Until `proc` answers HTTP at `url` (any status, not merely a connection)."""
    def answers() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return True
        except urllib.error.HTTPError:  # an HTTP answer all the same
            return True
        except (OSError, http.client.HTTPException):  # not listening yet, or not HTTP
            return False

    _wait(answers, proc, what, f"answer HTTP at {url}")


def _wait_port(port: int, proc: subprocess.Popen, what: str) -> None:
    def listens() -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0

    _wait(listens, proc, what, f"listen on port {port}")


def _wait(ready: Callable[[], bool], proc: subprocess.Popen, what: str, doing: str,
          timeout_s: float = 60.0) -> None:
    """Until `ready()`; an error once `proc` has exited, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        if ready():
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not {doing} within {timeout_s} s")
        time.sleep(0.05)
