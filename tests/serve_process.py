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
                timeout_s: float = 180.0) -> tuple[subprocess.Popen, str]:
    """`pdcluster serve ARGS` from the repository root, once it prints "serving": the process
    and that line. Fails the test with the process's last output if it never does."""
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pdcluster.cluster.cli", "serve", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
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
