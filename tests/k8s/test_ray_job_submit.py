"""`ray job submit` launches the cluster on a running Ray cluster: a real `ray start --head` on
127.0.0.1 (token auth on, as the chart runs it), the launcher Job's script (files/
launch_nodes.py) submitting the chart's entrypoint with a cluster.yaml of the chart's shape,
pointed at a tiny model on CPU, with the cluster secret as a 0400 file named by
$PDCLUSTER_CLUSTER_SECRET_FILE in the Ray processes' environment, as the chart mounts it. The
launched router must answer a completion; then the job is
stopped and the Ray head's processes are ended by their process group (never `ray stop`, which
would end every Ray on the machine).

As on a cluster, nothing runs from the checkout: the head, the launcher and so the job start in a
temporary folder with `PYTHONSAFEPATH` set, once with the project's editable venv and once with
the wheel installed into a fresh venv (tests/installed.py), whose `python` is then the one on
the job's PATH and the one Ray starts the node actors' workers with."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from ray.job_submission import JobSubmissionClient

from pdcluster.benchmarks.ports import free_port
from tests.installed import Installed, editable_install
from tests.k8s.chart import CHART, REPO_ROOT, cluster_config_text, needs_helm, one, render

pytestmark = [needs_helm, pytest.mark.slow]
CONFIG_PATH = "/etc/pdcluster/cluster.yaml"


WORKER_PORTS = 200


def head_ports() -> tuple[list[int], int]:
    """Four distinct free ports (GCS, dashboard, client server, dashboard agent) and the first of
    a worker-port range that holds none of them: `ray start` refuses to start when one of its
    ports falls inside the worker range, which independently drawn free ports sometimes do."""
    while True:
        singles = [free_port() for _ in range(4)]
        workers = free_port()
        if (len(set(singles)) == len(singles) and workers + WORKER_PORTS <= 65535
                and not any(workers <= port <= workers + WORKER_PORTS for port in singles)):
            return singles, workers


def ray_env(install: Installed, token: str, secret_file: Path) -> dict[str, str]:
    return install.env(
        # Keeps every Ray listener on 127.0.0.1 (pdcluster/cluster/ray_cluster.py says why).
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token,
        PDCLUSTER_CLUSTER_SECRET_FILE=str(secret_file))


def wait_for_dashboard(address: str, env: dict[str, str], head: subprocess.Popen,
                       cwd: str, log: Path) -> None:
    probe = ("from ray.job_submission import JobSubmissionClient as C; "
             f"C({address!r}).list_jobs()")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise AssertionError(f"ray start --head exited ({head.returncode}):\n"
                                 + log.read_text(errors="replace")[-4000:])
        if subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          cwd=cwd, timeout=60).returncode == 0:
            return
        time.sleep(1)
    raise AssertionError(f"Ray dashboard at {address} did not come up")


@pytest.fixture(params=["editable", "wheel"])
def install(request) -> Installed:
    if request.param == "editable":
        return editable_install()
    return request.getfixturevalue("wheel_install")


@pytest.fixture
def ray_head(install: Installed):
    token = secrets.token_hex(16)
    temp_dir = tempfile.mkdtemp(prefix="pdk8s-ray-")  # short: Ray's socket paths have a limit
    assert not Path(temp_dir).resolve().is_relative_to(REPO_ROOT)
    secret_file = Path(temp_dir) / "cluster-secret"
    secret_file.write_text(secrets.token_hex(32))  # what the chart's Secret holds
    secret_file.chmod(0o400)
    env = ray_env(install, token, secret_file)
    (gcs, dashboard, client_server, agent), workers = head_ports()
    # `python -m` the Ray CLI of this install's interpreter: Ray starts the workers with it.
    command = [str(install.python), "-m", "ray.scripts.scripts", "start", "--head", "--block",
               "--node-ip-address", "127.0.0.1",
               "--port", str(gcs), "--dashboard-host", "127.0.0.1",
               "--dashboard-port", str(dashboard), "--ray-client-server-port", str(client_server),
               "--dashboard-agent-listen-port", str(agent),
               "--min-worker-port", str(workers), "--max-worker-port", str(workers + WORKER_PORTS),
               "--num-cpus", "4", "--temp-dir", temp_dir, "--disable-usage-stats"]
    log = Path(temp_dir) / "ray-start.log"
    with log.open("wb") as out:
        head = subprocess.Popen(command, env=env, cwd=temp_dir, start_new_session=True,
                                stdout=out, stderr=subprocess.STDOUT)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        wait_for_dashboard(address, env, head, temp_dir, log)
        yield address, env, temp_dir
    finally:
        stop_group(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def stop_group(head: subprocess.Popen) -> None:
    """End the processes `ray start` started: its own process group, politely first."""
    # gcs_server and raylet take their time over SIGTERM: a short grace, then SIGKILL.
    for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):
        try:
            os.killpg(head.pid, sig)
        except ProcessLookupError:
            return
        try:
            head.wait(grace)
        except subprocess.TimeoutExpired:
            continue
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(head.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def local_cluster_yaml(model_dir: str, router_port: int, path: Path) -> tuple[str, str]:
    """The chart's cluster.yaml and entrypoint, re-pointed at this machine: a tiny model on
    CPU, no GPUs per node, any free request ports, the launcher's embedded metadata service,
    the router on loopback."""
    docs = render({"model": {"name": Path(model_dir).name}})
    text = cluster_config_text(docs)
    stamp = text.splitlines()[0]
    config = yaml.safe_load(text)
    config.update(model=model_dir, num_prefill=1, num_decode=1, host="127.0.0.1",
                  router={"host": "127.0.0.1", "port": router_port})
    config["engine"].update(dtype="float32", kv_cache_memory_gib=0.05)
    config["transfer"]["protocol"] = "tcp"
    config["node"]["gpus"] = 0
    # both nodes share this one address, where a pod has its own: any free request port
    config["node"]["request_port"] = 0
    del config["metadata"]  # no metadata service here: the launcher embeds one
    path.write_text(stamp + "\n" + yaml.safe_dump(config))
    entrypoint = one(docs, "RayJob")["spec"]["entrypoint"]
    assert CONFIG_PATH in entrypoint
    return entrypoint.replace(CONFIG_PATH, str(path)), Path(model_dir).name


def http_json(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def wait_for_router(base: str, deadline_s: float = 180) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            if http_json(f"{base}/health")[0] == 200:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise AssertionError(f"{base}/health never answered 200")


def test_ray_job_submit_launches_the_cluster(ray_head, model_dirs, tmp_path) -> None:
    address, env, cwd = ray_head
    router_port = free_port()
    entrypoint, model_name = local_cluster_yaml(model_dirs["llama-gqa"], router_port,
                                                tmp_path / "cluster.yaml")
    sid = "pd-pdcluster-nodes-0123456789"
    launcher_env = {**env, "RAY_ADDRESS": address, "PDCLUSTER_SUBMISSION_ID": sid,
                    "PDCLUSTER_SUBMISSION_PREFIX": "pd-pdcluster-nodes-",
                    "PDCLUSTER_ENTRYPOINT": entrypoint, "PDCLUSTER_TIMEOUT_S": "120",
                    "PDCLUSTER_POLL_S": "0.5",
                    "PDCLUSTER_HEARTBEAT_FILE": str(tmp_path / "alive")}
    proc = subprocess.run([sys.executable, str(CHART / "files" / "launch_nodes.py")],
                          env=launcher_env, cwd=cwd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"job {sid} is RUNNING" in proc.stdout


    client = JobSubmissionClient(
        address, headers={"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"})
    base = f"http://127.0.0.1:{router_port}"
    try:
        wait_for_router(base)
        status, body = http_json(f"{base}/v1/completions",
                                 {"model": model_name, "prompt": "Hello", "max_tokens": 4,
                                  "temperature": 0})
        assert status == 200, body
        assert isinstance(body["choices"][0]["text"], str)
        assert body["usage"]["completion_tokens"] == 4
    except AssertionError:
        print(client.get_job_logs(sid)[-4000:])
        raise
    finally:
        client.stop_job(sid)
        deadline = time.monotonic() + 60
        while str(client.get_job_status(sid)) not in ("STOPPED", "SUCCEEDED", "FAILED"):
            assert time.monotonic() < deadline, "the launch did not stop"
            time.sleep(0.5)
