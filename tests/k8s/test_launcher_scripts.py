"""The launch scripts the chart runs, exercised for real with fakes of what they talk to: the
entrypoint's wait for the current cluster.yaml (under /bin/sh, and through KubeRay's submitter
shell line), launch_nodes.py (the launcher Job) against a fake `ray` CLI and
JobSubmissionClient."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.k8s.chart import CHART, cluster_config_text, needs_helm, one, render

LAUNCH_NODES = CHART / "files" / "launch_nodes.py"
CONFIG_PATH = "/etc/pdcluster/cluster.yaml"


# --- the entrypoint's wait for the mounted config ---------------------------------------------

def local_entrypoint(values: dict, config: Path) -> tuple[str, str]:
    """The rendered entrypoint, pointed at a local file and launching `echo` instead of the
    cluster; and the cluster.yaml it waits for."""
    docs = render(values)
    entrypoint = one(docs, "RayJob")["spec"]["entrypoint"]
    launch = f"exec python -m pdcluster.cluster.launch --config {CONFIG_PATH}"
    assert entrypoint.endswith(launch + "'")
    entrypoint = entrypoint.replace(launch, f"exec echo launched {config}")
    return entrypoint.replace(CONFIG_PATH, str(config)), cluster_config_text(docs)


def run_sh(command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, timeout=30)


@needs_helm
def test_entrypoint_launches_with_the_current_config(tmp_path) -> None:
    config = tmp_path / "cluster.yaml"
    entrypoint, text = local_entrypoint({}, config)
    config.write_text(text)
    proc = run_sh(entrypoint)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"launched {config}"


@needs_helm
def test_entrypoint_refuses_a_stale_config(tmp_path) -> None:
    config = tmp_path / "cluster.yaml"
    entrypoint, _ = local_entrypoint({"launcher": {"configWaitSeconds": 2}}, config)
    _, stale_text = local_entrypoint({"cluster": {"engine": {"maxNumSeqs": 8}}}, config)
    config.write_text(stale_text)
    proc = run_sh(entrypoint)
    assert proc.returncode == 1
    assert "not this launch config yet" in proc.stderr
    assert "launched" not in proc.stdout


@needs_helm
def test_entrypoint_waits_for_the_mount_to_update(tmp_path) -> None:
    config = tmp_path / "cluster.yaml"
    entrypoint, text = local_entrypoint({}, config)
    config.write_text("# pdcluster-launch: 0000000000000000\nmodel: /old\n")
    timer = threading.Timer(1.0, config.write_text, args=(text,))
    timer.start()
    started = time.monotonic()
    try:
        proc = run_sh(entrypoint)
    finally:
        timer.cancel()
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started >= 1.0
    assert proc.stdout.strip() == f"launched {config}"


RECORDING_RAY = """#!/bin/sh
# Records its arguments, one a line; `ray job status` answers "no such job".
printf '%s\\n' "$@" > "$RAY_ARGS_FILE"
[ "$2" = status ] && exit 1
exit 0
"""


@needs_helm
def test_entrypoint_survives_kuberays_submitter_shell(tmp_path) -> None:
    """KubeRay's K8sJobMode submitter joins these words with spaces and runs them with bash -c
    (GetK8sJobCommand): the entrypoint lands unquoted in that shell line. It must reach
    `ray job submit` as the words of one command, which Ray quotes back (shlex.join) into the
    command the head runs."""
    entrypoint = one(render({}), "RayJob")["spec"]["entrypoint"]
    address, sid = "http://head:8265", "rayjob-abc"
    words = ["if", "ray", "job", "status", "--address", address, sid, ">/dev/null", "2>&1", ";",
             "then", "ray", "job", "logs", "--address", address, "--follow", sid, ";",
             "else", "ray", "job", "submit", "--address", address, "--submission-id", sid,
             "--", entrypoint, ";", "fi"]
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ray").write_text(RECORDING_RAY)
    (fake / "ray").chmod(0o755)
    args_file = tmp_path / "args"
    proc = subprocess.run(["/bin/bash", "-ce", "--", " ".join(words)], capture_output=True,
                          text=True, timeout=30,
                          env={"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}",
                               "RAY_ARGS_FILE": str(args_file)})
    assert proc.returncode == 0, proc.stderr
    argv = args_file.read_text().splitlines()
    assert argv[:2] == ["job", "submit"]
    submitted = argv[argv.index("--") + 1:]
    assert submitted[:2] == ["sh", "-c"] and len(submitted) == 3
    assert submitted == shlex.split(entrypoint)
    assert "until grep -qx" in submitted[2]
    assert submitted[2].endswith("exec python -m pdcluster.cluster.launch --config " + CONFIG_PATH)


# --- launch_nodes.py against a fake Ray ---------------------------------------------------------

FAKE_JOB_SUBMISSION = '''
import json, os

STATE = os.environ["FAKE_RAY_STATE"]


def load():
    with open(STATE) as f:
        return json.load(f)


def save(state):
    with open(STATE, "w") as f:
        json.dump(state, f)


class JobDetails:
    def __init__(self, submission_id, status):
        self.submission_id, self.status = submission_id, status


class JobSubmissionClient:
    def __init__(self, address):
        state = load()
        if state["down_polls"] > 0:
            state["down_polls"] -= 1
            save(state)
            raise ConnectionError("dashboard not up")
        state["events"].append(["connect", address])
        save(state)

    def list_jobs(self):
        return [JobDetails(sid, job["status"]) for sid, job in load()["jobs"].items()]

    def get_job_status(self, submission_id):
        state = load()
        job = state["jobs"][submission_id]
        if job["next"]:
            job["status"] = job["next"].pop(0)
        save(state)
        return job["status"]

    def stop_job(self, submission_id):
        state = load()
        state["jobs"][submission_id]["status"] = "STOPPED"
        state["jobs"][submission_id]["next"] = []
        state["events"].append(["stop", submission_id])
        save(state)
        return True

    def get_job_logs(self, submission_id):
        return "Traceback: the launcher failed"
'''

FAKE_RAY_CLI = '''#!{python}
import json, os, sys

with open(os.environ["FAKE_RAY_STATE"]) as f:
    state = json.load(f)
args = sys.argv[1:]
assert args[:2] == ["job", "submit"], args
sid = args[args.index("--submission-id") + 1]
if sid in state["jobs"]:
    sys.exit("submission id already exists")
statuses = list(state["on_submit"])
state["jobs"][sid] = {{"status": statuses.pop(0), "next": statuses}}
state["events"].append(["submit", args[2:]])
with open(os.environ["FAKE_RAY_STATE"], "w") as f:
    json.dump(state, f)
'''

PREFIX = "pd-pdcluster-nodes-"
SID = PREFIX + "aaaaaaaaaa"
ADDRESS = "http://pd-pdcluster-head-svc.serving.svc.cluster.local:8265"
SCRIPT = 'echo "a b"; exec python -m pdcluster.cluster.launch --config /etc/pdcluster/cluster.yaml'
ENTRYPOINT = f"sh -c '{SCRIPT}'"


def run_launcher(tmp_path: Path, jobs: dict | None = None, on_submit=("PENDING", "RUNNING"),
                 down_polls: int = 0, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    fake = tmp_path / "fake"
    (fake / "ray").mkdir(parents=True, exist_ok=True)
    (fake / "bin").mkdir(exist_ok=True)
    (fake / "ray" / "__init__.py").write_text("")
    (fake / "ray" / "job_submission.py").write_text(FAKE_JOB_SUBMISSION)
    cli = fake / "bin" / "ray"
    cli.write_text(FAKE_RAY_CLI.format(python=sys.executable))
    cli.chmod(0o755)
    state_path = tmp_path / "state.json"
    state_path.write_text(json.dumps({
        "jobs": {sid: {"status": status, "next": []} for sid, status in (jobs or {}).items()},
        "on_submit": list(on_submit), "down_polls": down_polls, "events": []}))
    full_env = {
        "PATH": f"{fake / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(fake),
        "FAKE_RAY_STATE": str(state_path),
        "RAY_ADDRESS": ADDRESS,
        "PDCLUSTER_SUBMISSION_ID": SID,
        "PDCLUSTER_SUBMISSION_PREFIX": PREFIX,
        "PDCLUSTER_ENTRYPOINT": ENTRYPOINT,
        "PDCLUSTER_POLL_S": "0.01",
        "PDCLUSTER_TIMEOUT_S": "20",
        "PDCLUSTER_HEARTBEAT_FILE": str(tmp_path / "alive"),
        **env,
    }
    proc = subprocess.run([sys.executable, str(LAUNCH_NODES)], env=full_env,
                          capture_output=True, text=True, timeout=60)
    return proc, json.loads(state_path.read_text())


def events(state: dict, kind: str) -> list:
    return [e[1] for e in state["events"] if e[0] == kind]


def test_launcher_submits_and_waits_until_running(tmp_path) -> None:
    proc, state = run_launcher(tmp_path)
    assert proc.returncode == 0, proc.stderr
    # The entrypoint's words, which `ray job submit` quotes back into the same command line.
    assert events(state, "submit") == [["--address", ADDRESS, "--submission-id", SID,
                                        "--no-wait", "--", "sh", "-c", SCRIPT]]
    assert state["jobs"][SID]["status"] == "RUNNING"
    assert (tmp_path / "alive").exists()  # the liveness probe's heartbeat


def test_launcher_passes_the_working_dir(tmp_path) -> None:
    proc, state = run_launcher(tmp_path, PDCLUSTER_WORKING_DIR="/opt/pdcluster")
    assert proc.returncode == 0, proc.stderr
    (args,) = events(state, "submit")
    assert args[args.index("--working-dir") + 1] == "/opt/pdcluster"
    assert args[-4:] == ["--", "sh", "-c", SCRIPT]


def test_launcher_stops_the_previous_launch_first(tmp_path) -> None:
    jobs = {PREFIX + "0000000000": "RUNNING", PREFIX + "1111111111": "SUCCEEDED",
            "someone-elses-job": "RUNNING"}
    proc, state = run_launcher(tmp_path, jobs=jobs)
    assert proc.returncode == 0, proc.stderr
    kinds = [e[0] for e in state["events"]]
    assert kinds.index("stop") < kinds.index("submit")
    assert events(state, "stop") == [PREFIX + "0000000000"]
    assert state["jobs"]["someone-elses-job"]["status"] == "RUNNING"


def test_launcher_waits_for_the_dashboard(tmp_path) -> None:
    proc, state = run_launcher(tmp_path, down_polls=3)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("waiting for the Ray dashboard") == 3
    assert len(events(state, "submit")) == 1


def test_retried_launcher_does_not_submit_twice(tmp_path) -> None:
    proc, state = run_launcher(tmp_path, jobs={SID: "RUNNING"})
    assert proc.returncode == 0, proc.stderr
    assert not events(state, "submit") and not events(state, "stop")


def test_launcher_reports_an_earlier_failure_of_the_same_launch(tmp_path) -> None:
    proc, state = run_launcher(tmp_path, jobs={SID: "FAILED"})
    assert proc.returncode == 1
    assert f"job {SID} already ended FAILED" in proc.stderr
    assert not events(state, "submit")


def test_launcher_fails_with_the_job_logs(tmp_path) -> None:
    proc, _ = run_launcher(tmp_path, on_submit=("PENDING", "FAILED"))
    assert proc.returncode == 1
    assert "ended FAILED" in proc.stderr and "the launcher failed" in proc.stderr


def test_launcher_gives_up_at_the_deadline(tmp_path) -> None:
    proc, _ = run_launcher(tmp_path, on_submit=("PENDING",), PDCLUSTER_TIMEOUT_S="0.3")
    assert proc.returncode == 1
    assert "still PENDING at the deadline" in proc.stderr
