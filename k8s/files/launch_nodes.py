"""The launcher Job (launcher.mode=job): submits pdcluster's node launcher to the chart's Ray
cluster with `ray job submit`, the same command a user would run by hand:

    ray job submit --address http://<head-svc>:8265 --submission-id <id> --no-wait \
        [--working-dir DIR] -- sh -c '<script>'

Steps: wait for the head's dashboard; stop this release's earlier launches (submission ids with
the same prefix, i.e. an older config) so that two generations of node actors never run at
once; submit, unless this config's submission already exists (a retried pod); then wait until
the Ray job is RUNNING (or SUCCEEDED, if the launcher returns once the actors are up).

Environment: RAY_ADDRESS, PDCLUSTER_SUBMISSION_ID, PDCLUSTER_SUBMISSION_PREFIX,
PDCLUSTER_ENTRYPOINT (a shell command line, as a RayJob's entrypoint), PDCLUSTER_WORKING_DIR
(optional), PDCLUSTER_TIMEOUT_S; RAY_AUTH_MODE and
RAY_AUTH_TOKEN when Ray token auth is on. Exit status 0 once the job runs, 1 otherwise.
Every poll touches PDCLUSTER_HEARTBEAT_FILE: the container's liveness probe checks its age, so a
launcher stuck outside its own timeouts is restarted.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
UP = ("RUNNING", "SUCCEEDED")
POLL_S = float(os.environ.get("PDCLUSTER_POLL_S", "5"))
HEARTBEAT = Path(os.environ.get("PDCLUSTER_HEARTBEAT_FILE", "/tmp/launch_nodes.alive"))


class LaunchError(Exception):
    """Reported as one line on stderr; the Job's pod fails and Kubernetes retries it."""


def log(message: str) -> None:
    print(f"launch_nodes: {message}", flush=True)


def beat() -> None:
    HEARTBEAT.touch()


def connect(address: str, deadline: float):
    """A JobSubmissionClient once the dashboard answers (the head may still be starting)."""
    from ray.job_submission import JobSubmissionClient

    while True:
        beat()
        try:
            return JobSubmissionClient(address)
        except Exception as exc:  # a head still starting fails in many ways; all mean "retry"
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            # ...except a refused token, which waiting does not fix (matched by name: the
            # class is missing from Ray versions without token auth).
            if type(exc).__name__ == "AuthenticationError":
                raise LaunchError(f"Ray at {address} refused the token: {reason} "
                                  "(RAY_AUTH_MODE=token and RAY_AUTH_TOKEN must match the "
                                  "cluster's)") from exc
            if time.monotonic() > deadline:
                raise LaunchError(f"Ray dashboard at {address} unreachable: {reason}") from exc
            log(f"waiting for the Ray dashboard at {address} ({reason})")
            time.sleep(POLL_S)


def wait_until(client, submission_id: str, states: tuple[str, ...], deadline: float) -> str:
    while True:
        beat()
        status = str(client.get_job_status(submission_id))
        if status in states or status in TERMINAL:
            return status
        if time.monotonic() > deadline:
            raise LaunchError(f"job {submission_id} still {status} at the deadline")
        time.sleep(POLL_S)


def stop_older(client, prefix: str, keep: str, deadline: float) -> None:
    for job in client.list_jobs():
        sid = job.submission_id or ""
        if not sid.startswith(prefix) or sid == keep or str(job.status) in TERMINAL:
            continue
        log(f"stopping the earlier launch {sid} ({job.status})")
        client.stop_job(sid)
        wait_until(client, sid, TERMINAL, deadline)


def submit(address: str, submission_id: str, entrypoint: str, working_dir: str) -> None:
    command = ["ray", "job", "submit", "--address", address, "--submission-id", submission_id,
               "--no-wait"]
    if working_dir:
        command += ["--working-dir", working_dir]
    # `ray job submit` quotes each word it gets: hand it the words, not one string.
    command += ["--", *shlex.split(entrypoint)]
    log(f"submitting {submission_id}")
    subprocess.run(command, check=True)


def launch(env: dict[str, str]) -> None:
    address, sid = env["RAY_ADDRESS"], env["PDCLUSTER_SUBMISSION_ID"]
    deadline = time.monotonic() + float(env.get("PDCLUSTER_TIMEOUT_S", "1500"))
    client = connect(address, deadline)
    stop_older(client, env["PDCLUSTER_SUBMISSION_PREFIX"], sid, deadline)
    existing = {job.submission_id: str(job.status) for job in client.list_jobs()}
    if sid not in existing:
        submit(address, sid, env["PDCLUSTER_ENTRYPOINT"], env.get("PDCLUSTER_WORKING_DIR", ""))
    elif existing[sid] in ("FAILED", "STOPPED"):
        raise LaunchError(f"job {sid} already ended {existing[sid]}; see `ray job logs {sid}`"
                          " (a new config, or deleting this Job, launches again)")
    status = wait_until(client, sid, UP, deadline)
    if status not in UP:
        logs = client.get_job_logs(sid)[-4000:]
        raise LaunchError(f"job {sid} ended {status}; last log lines:\n{logs}")
    log(f"job {sid} is {status}")


def main() -> int:
    try:
        launch(dict(os.environ))
    except (LaunchError, subprocess.CalledProcessError) as exc:
        print(f"launch_nodes: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
