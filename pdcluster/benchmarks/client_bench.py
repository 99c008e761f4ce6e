"""A published load client's view of a served cluster: `pdcluster bench client --url URL
--model NAME --tokenizer DIR [--concurrency C] [--requests N] [--isl I] [--osl O] [--json]`.

Drives `aiperf` (NVIDIA's benchmark for OpenAI-compatible endpoints) against a running
`pdcluster serve` (or any OpenAI-compatible server): synthetic prompts of about `--isl`
tokens (counted with the local tokenizer folder `--tokenizer`), streamed completions of up
to `--osl` tokens, `--concurrency` requests in flight until `--requests` have completed.
It reports aiperf's TTFT, inter-token latency, request latency and throughput, and, as the
baseline measured in the same run, the router's own view of the same requests (its
`router_ttft_seconds` / `router_inter_token_latency_seconds` / `router_e2e_latency_seconds`
histograms, which aiperf scrapes from /metrics during the run): their ratio is what the
HTTP path and the client add.

aiperf lives in its own virtual environment, never the project's: `make peers` installs it
under `.cache/peers/aiperf` (or point `--tool-dir` / `$PDCLUSTER_AIPERF_DIR` at another).
It loads a local tokenizer folder only with `HF_HUB_OFFLINE` unset (set, it takes the path
for a hub id), so it runs with that variable removed; it makes no other network access
than the URL given.

The command's flags are defined in cluster/cli.py (parsing never imports benchmarks).

API: `run(args)`, `aiperf_command`, `summarize`, `find_aiperf`, `load_of`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pdcluster.cluster.cli_common import UsageError
from pdcluster.core.paths import cache_dir

AIPERF_VERSION = "0.13.0"  # the version `make peers` installs and this parser was written for
TOOL_DIR_ENV = "PDCLUSTER_AIPERF_DIR"
_STATS = ("avg", "p50", "p90", "p99")
# aiperf metric -> our name; router histogram -> our name (both reported in ms)
_CLIENT_LATENCIES = {"time_to_first_token": "ttft_ms", "inter_token_latency": "itl_ms",
                     "request_latency": "request_latency_ms"}
_ROUTER_LATENCIES = {"router_ttft_seconds": "ttft_ms_avg",
                     "router_inter_token_latency_seconds": "itl_ms_avg",
                     "router_e2e_latency_seconds": "e2e_ms_avg"}


@dataclass(frozen=True, slots=True)
class Load:
    requests: int = 32
    concurrency: int = 4
    isl: int = 128
    osl: int = 32
    warmup: int = 2


QUICK = Load(requests=8, concurrency=2, isl=64, osl=16, warmup=1)


def load_of(args: argparse.Namespace) -> Load:
    """The load asked for: --quick's or the defaults, overridden by explicit flags."""
    base = QUICK if getattr(args, "quick", False) else Load()
    values = {name: getattr(args, name, None) for name in ("requests", "concurrency", "isl",
                                                          "osl")}
    load = Load(**{name: getattr(base, name) if value is None else value
                   for name, value in values.items()}, warmup=base.warmup)
    for name in ("requests", "concurrency", "isl", "osl"):
        if getattr(load, name) < 1:
            raise UsageError(f"--{name} must be >= 1")
    return load


def find_aiperf(tool_dir: str | None) -> Path:
    """aiperf's executable in its own virtual environment; a usage error naming the install
    command when it is missing."""
    default = cache_dir() / "peers" / "aiperf"
    folder = Path(tool_dir or os.environ.get(TOOL_DIR_ENV) or default)
    executable = folder / "bin" / "aiperf"
    if not executable.is_file():
        raise UsageError(f"aiperf not found at {executable}: install it with `make peers` "
                         f"(python3 -m venv {folder} && {folder}/bin/pip install "
                         f"aiperf=={AIPERF_VERSION}) or give --tool-dir")
    return executable


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def aiperf_command(executable: Path, args: argparse.Namespace, load: Load,
                   artifact_dir: Path) -> list[str]:
    """The aiperf command line for `args` (no shell: every value is one argument)."""
    command = [str(executable), "profile", "--model", args.served_model,
               "--url", base_url(args.url), "--endpoint-type", args.endpoint, "--streaming",
               "--tokenizer", str(Path(args.tokenizer).resolve()),
               "--concurrency", str(load.concurrency), "--request-count", str(load.requests),
               "--warmup-request-count", str(load.warmup),
               "--isl", str(load.isl), "--osl", str(load.osl), "--random-seed", "0",
               "--ui-type", "none", "--artifact-dir", str(artifact_dir)]
    if args.api_key:
        command += ["--api-key", args.api_key]
    return command


def tool_env() -> dict[str, str]:
    """Our environment without the offline switches that make aiperf take a local folder
    for a hub id (it still downloads nothing: the tokenizer is local)."""
    return {k: v for k, v in os.environ.items()
            if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}


def run(args: argparse.Namespace) -> dict:
    if not Path(args.tokenizer, "tokenizer.json").is_file() and \
            not Path(args.tokenizer, "tokenizer_config.json").is_file():
        raise UsageError(f"no tokenizer in {args.tokenizer}")
    executable, load = find_aiperf(args.tool_dir), load_of(args)
    with tempfile.TemporaryDirectory(prefix="pdcluster-bench-client-") as tmp:
        artifact_dir = Path(args.artifact_dir or tmp).resolve()
        artifact_dir.mkdir(parents=True, exist_ok=True)
        log = artifact_dir / "aiperf-console.log"
        with log.open("w") as out:
            done = subprocess.run(aiperf_command(executable, args, load, artifact_dir),
                                  env=tool_env(), stdout=out, stderr=subprocess.STDOUT,
                                  timeout=args.timeout, check=False)
        if done.returncode != 0:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"aiperf exited with {done.returncode}:\n{tail}")
        profile = json.loads((artifact_dir / "profile_export_aiperf.json").read_text())
        server_file = artifact_dir / "server_metrics_export.json"
        server = json.loads(server_file.read_text()) if server_file.is_file() else {}
    return {"url": base_url(args.url), "model": args.served_model, "endpoint": args.endpoint,
            "concurrency": load.concurrency, "isl": load.isl, "osl": load.osl,
            **summarize(profile, server)}


def summarize(profile: dict, server: dict) -> dict:
    """aiperf's exports (profile_export_aiperf.json, server_metrics_export.json) -> our
    figures: client latencies in ms, throughputs, errors, and the router's own averages
    over the same run with the client/router ratios."""
    result: dict = {"tool": "aiperf", "tool_version": profile.get("aiperf_version"),
                    "requests": int(_avg(profile, "request_count") or 0),
                    "completed": int(_avg(profile, "completed_request_count") or 0),
                    "errors": sum(int(e.get("count", 1)) for e in
                                  profile.get("error_summary") or []),
                    "request_throughput_per_s": _avg(profile, "request_throughput"),
                    "output_tokens_per_s": _avg(profile, "output_token_throughput"),
                    "output_tokens_per_s_per_user": _avg(profile,
                                                         "output_token_throughput_per_user"),
                    "duration_s": _avg(profile, "benchmark_duration")}
    for metric, name in _CLIENT_LATENCIES.items():
        stats = profile.get(metric) or {}
        result[name] = {s: stats.get(s) for s in _STATS}
    router = {name: _histogram_avg_ms(server, metric)
              for metric, name in _ROUTER_LATENCIES.items()}
    result["baseline_router"] = router
    result["ttft_client_over_router"] = _ratio(result["ttft_ms"]["avg"], router["ttft_ms_avg"])
    result["itl_client_over_router"] = _ratio(result["itl_ms"]["avg"], router["itl_ms_avg"])
    return result


def _avg(profile: dict, metric: str) -> float | None:
    return (profile.get(metric) or {}).get("avg")


def _histogram_avg_ms(server: dict, metric: str) -> float | None:
    """The mean over the run of a router histogram aiperf scraped (seconds -> ms)."""
    series = ((server.get("metrics") or {}).get(metric) or {}).get("series") or []
    stats = series[0].get("stats", {}) if series else {}
    count, total = stats.get("count"), stats.get("sum")
    return 1000.0 * total / count if count and total is not None else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
