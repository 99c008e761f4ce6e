"""A `pdcluster serve` process for benchmarks that go through the router: start it (the cluster
secret in its environment, its output in a log file), wait until it answers, open clients,
add a second router on the same cluster, stop it all with SIGINT."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdcluster.benchmarks.ports import free_port
from pdcluster.core.credentials import ROUTER_TOKEN_ENV, SECRET_ENV, SERVICE, ClusterSecret


class ServedCluster:
    """1 prefill + 1 decode node of `engine`, every prompt through the prefill node."""

    def __init__(self, model: str, engine: str, start_timeout_s: float = 900.0) -> None:
        self.model, self.engine, self.name = model, engine, Path(model).name
        self.port = free_port()
        self.secret = ClusterSecret.generate()
        self.env = {**os.environ, SECRET_ENV: self.secret.to_text(),
                    "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}
        self._dir = tempfile.TemporaryDirectory(prefix="pdc-served-")
        self.log = Path(self._dir.name) / "serve.log"
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.metadata = ""

    def __enter__(self) -> ServedCluster:
        command = [sys.executable, "-m", "pdcluster.cluster.cli", "serve", "--engine",
                   self.engine, "--model", self.model, "--num-prefill", "1", "--num-decode",
                   "1", "--port", str(self.port), "--kv-cache-gib", "0.5",
                   "--local-prefill-threshold", "0"]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(command, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=self._dir.name)
        self.metadata = self._wait_ready()
        return self

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                break
            found = re.search(r"metadata service at (\S+?)\)", self.log.read_text())
            if found:
                return found.group(1)
            time.sleep(0.5)
        tail = "\n".join(self.log.read_text().splitlines()[-40:])
        self.__exit__()
        raise RuntimeError(f"pdcluster serve --engine {self.engine} did not start:\n{tail}")

    def client(self, port: int | None = None):
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{port or self.port}/v1",
                             api_key="none", max_retries=0, timeout=1200)

    def warm_up(self, client, timeout_s: float = 300.0) -> None:
        import openai

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.completions.create(model=self.name, prompt="warm up", max_tokens=2)
                return
            except (openai.APIStatusError, openai.APIConnectionError) as exc:
                # not listening yet, or 503 until both nodes are registered
                if getattr(exc, "status_code", 503) != 503 or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    @contextmanager
    def extra_router(self, local_prefill_threshold: int) -> Iterator[int]:
        """A second router on this cluster's nodes (same metadata service), its port."""
        port = free_port()
        command = [sys.executable, "-m", "pdcluster.cluster.cli", "router", "serve",
                   "--model", self.model, "--metadata", self.metadata, "--port", str(port),
                   "--engine", self.engine, "--local-prefill-threshold",
                   str(local_prefill_threshold)]
        # a router holds its client credential only (docs/security.md), not the secret
        env = {**self.env, ROUTER_TOKEN_ENV: self.secret.metadata_token(SERVICE)}
        env.pop(SECRET_ENV, None)
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            self.warm_up(self.client(port))
            yield port
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dir.cleanup()
