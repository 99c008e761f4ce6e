"""pdcluster as users get it, run as they run it: from a folder outside the checkout, with the
checkout nowhere on `sys.path` (tests/installed.py), for both installs — the wheel in a fresh
venv, and the project's editable venv that `make run` uses.

Each install builds a tiny model and generates with it (`pdcluster make-tiny-model`,
`pdcluster generate`), runs the README's Python API (`LLM(...)`) and reports every module it
loaded (all from that install's package folder, none under a second name), and serves a chat
request through `pdcluster serve` to the `openai` client. From the wheel also: the offline
replay, and a benchmark that spawns `python -m pdcluster…` service processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pdcluster.benchmarks.ports import free_port
from tests.installed import MODULE_REPORT, REPO_ROOT, Installed, editable_install

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["editable", "wheel"])
def install(request) -> Installed:
    if request.param == "editable":
        return editable_install()
    return request.getfixturevalue("wheel_install")


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    """A working folder that is not in the checkout."""
    folder = tmp_path_factory.mktemp("user")
    assert not folder.resolve().is_relative_to(REPO_ROOT)
    return folder


@pytest.fixture(scope="module")
def tiny_model(install: Installed, outside: Path) -> Path:
    folder = outside / f"tiny-{install.name}"
    proc = install.run(["pdcluster", "make-tiny-model", str(folder)], cwd=outside)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (folder / "config.json").is_file()
    return folder


def loaded_modules(stdout: str) -> dict:
    line = next(x for x in stdout.splitlines() if x.startswith("MODULES "))
    return json.loads(line[len("MODULES "):])


def assert_one_name_per_module(install: Installed, report: dict) -> None:
    assert report["bare"] == [], f"modules loaded under a bare room name: {report['bare']}"
    elsewhere = {name: path for name, path in report["ours"].items()
                 if path and not Path(path).resolve().is_relative_to(install.package_dir)}
    assert not elsewhere, f"loaded from outside {install.package_dir}: {elsewhere}"
    assert "pdcluster.engine.models.llama" in report["ours"]


def test_generate_from_another_folder(install: Installed, tiny_model: Path,
                                      outside: Path) -> None:
    proc = install.run(["pdcluster", "generate", "--model", str(tiny_model), "--prompt",
                        "Hello there", "--max-tokens", "4"], cwd=outside)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), "no output"


def test_python_api_from_another_folder(install: Installed, tiny_model: Path,
                                        outside: Path) -> None:
    code = ("from pdcluster.engine import LLM, SamplingParams\n"
            f"llm = LLM({str(tiny_model)!r})\n"
            "out = llm.generate(['Hello there'], SamplingParams(temperature=0, max_tokens=4))[0]\n"
            "assert len(out.token_ids) == 4, out\n"
            + MODULE_REPORT)
    proc = install.run(["python", "-c", code], cwd=outside)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_one_name_per_module(install, loaded_modules(proc.stdout))


def test_serve_answers_a_chat_from_another_folder(install: Installed, tiny_model: Path,
                                                  outside: Path) -> None:
    import openai
    port = free_port()
    command = [str(install.bin / "pdcluster"), "serve", "--model", str(tiny_model),
               "--num-prefill", "1", "--num-decode", "1", "--port", str(port),
               "--kv-cache-gib", "0.05", "--local-prefill-threshold", "0"]
    proc = subprocess.Popen(command, cwd=outside, env=install.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line or time.monotonic() > deadline:
                break
        assert "serving" in "".join(lines[-1:]), "".join(lines[-40:])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=120)
        reply = _chat_when_ready(client, tiny_model.name, openai)
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 4
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _chat_when_ready(client, model: str, openai, timeout_s: float = 90.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.chat.completions.create(
                model=model, max_tokens=4, temperature=0,
                messages=[{"role": "user", "content": "What is the capital of France?"}])
        except openai.APIStatusError as exc:  # 503 until both nodes registered
            if exc.status_code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


# ---- the wheel only: offline tools and benchmarks ------------------------------------------


def test_replay_runs_from_the_wheel(wheel_install: Installed, tmp_path: Path) -> None:
    proc = wheel_install.run(["pdcluster", "replay", "--synthetic", "chat", "--scale", "0.1",
                              "--json"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["trace"] == "chat" and 0 < result["ideal_hit_ratio"] <= 1


def test_a_benchmark_spawning_services_runs_from_the_wheel(wheel_install: Installed,
                                                           tmp_path: Path) -> None:
    """`bench metadata` starts the metadata service as `python -m pdcluster.cluster.cli` with
    its own interpreter, and etcd beside it."""
    proc = wheel_install.run(["pdcluster", "bench", "metadata", "--quick", "--json"],
                             cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result, proc.stdout[-2000:]
