"""`pdcluster serve` as a real process for end-to-end tests: start it, wait until the router
answers, stop it with SIGINT (as Ctrl-C would)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_serve(args: list[str], env: dict[str, str] | None = None,
                timeout_s: float = 180.0, log_path: Path | None = None
                ) -> tuple[subprocess.Popen, str]:
    """`pdcluster serve ARGS` from the repository root, once it prints "serving": the process
    and that line. Fails the test with the process's last output if it never does. With
    `log_path`, the output goes to that file (a chatty engine such as vLLM would fill a pipe
    nobody reads once the server is up, and block on it)."""
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "pdcluster.cluster.cli", "serve", *args]
    if log_path is not None:
        return _start_logged(command, env, timeout_s, log_path)
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "serving" in line or time.monotonic() > deadline:
            break
    if "serving" not in "".join(lines[-1:]):
        proc.kill()
        raise AssertionError("pdcluster serve did not start:\n" + "".join(lines[-40:]))
    return proc, lines[-1]


def _start_logged(command: list[str], env: dict[str, str], timeout_s: float,
                  log_path: Path) -> tuple[subprocess.Popen, str]:
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        ready = [line for line in log_path.read_text(errors="replace").splitlines()
                 if line.startswith("pdcluster: serving")]
        if ready:
            return proc, ready[0]
        time.sleep(0.5)
    proc.kill()
    tail = log_path.read_text(errors="replace").splitlines()[-60:]
    raise AssertionError("pdcluster serve did not start:\n" + "\n".join(tail))


def stop_serve(proc: subprocess.Popen, timeout_s: float = 60.0) -> bool:
    """SIGINT, then wait; kills it if it does not exit in time. True if it exited by itself."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout_s)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        return False


def wait_until_answering(client, model: str, timeout_s: float = 60.0) -> None:
    """Until the router answers a completion (503 while it sees no healthy node yet)."""
    import openai

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.completions.create(model=model, prompt="warm up", max_tokens=1)
            return
        except openai.APIStatusError as exc:
            if exc.status_code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
