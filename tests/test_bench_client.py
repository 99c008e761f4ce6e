"""`pdcluster bench client`: its flags become the aiperf command line, aiperf runs without
the offline switches in its environment, and its exports become our JSON line. aiperf
itself is stood in for by a script that writes exports shaped like aiperf 0.13's (the real
tool runs against a served cluster outside the suite: docs/router.md)."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from pdcluster.benchmarks import client_bench
from pdcluster.cluster import cli
from pdcluster.cluster.cli_common import UsageError

PROFILE = {
    "aiperf_version": "0.13.0",
    "request_count": {"avg": 4.0}, "completed_request_count": {"avg": 4.0},
    "request_throughput": {"unit": "requests/sec", "avg": 0.25},
    "output_token_throughput": {"unit": "tokens/sec", "avg": 3.75},
    "output_token_throughput_per_user": {"avg": 4.9},
    "benchmark_duration": {"unit": "sec", "avg": 17.0},
    "time_to_first_token": {"unit": "ms", "avg": 2727.7, "p50": 2940.0, "p90": 4563.3,
                            "p99": 4567.4, "min": 463.0},
    "inter_token_latency": {"unit": "ms", "avg": 380.2, "p50": 388.1, "p90": 638.1,
                            "p99": 638.3},
    "request_latency": {"unit": "ms", "avg": 8430.7, "p50": 8524.4, "p90": 14129.8,
                        "p99": 14130.6},
    "error_summary": [{"error_details": {"code": 503}, "count": 2}],
}
SERVER = {"metrics": {
    "router_ttft_seconds": {"type": "histogram", "series": [{"stats": {"count": 4,
                                                                        "sum": 10.0}}]},
    "router_inter_token_latency_seconds": {"series": [{"stats": {"count": 60, "sum": 21.0}}]},
    "router_e2e_latency_seconds": {"series": [{"stats": {"count": 4, "sum": 33.6}}]}}}
FAKE_AIPERF = """#!{python}
import json, os, sys
argv = sys.argv[1:]
out = argv[argv.index("--artifact-dir") + 1]
open(os.path.join(out, "profile_export_aiperf.json"), "w").write({profile!r})
open(os.path.join(out, "server_metrics_export.json"), "w").write({server!r})
open(os.path.join(out, "seen.json"), "w").write(json.dumps(
    {{"argv": argv, "offline": "HF_HUB_OFFLINE" in os.environ}}))
print("a table nobody parses")
"""


def parse(*extra: str, tokenizer: str = "tok"):
    return cli.build_parser().parse_args(
        ["bench", "client", "--url", "http://127.0.0.1:8000/v1/", "--model", "smol",
         "--tokenizer", tokenizer, *extra])


def test_flags_become_the_aiperf_command() -> None:
    args = parse("--concurrency", "3", "--requests", "12", "--api-key", "sk-x")
    load = client_bench.load_of(args)
    assert load == client_bench.Load(requests=12, concurrency=3)
    command = client_bench.aiperf_command(Path("/t/bin/aiperf"), args, load, Path("/out"))
    flags = {flag: command[i + 1] for i, flag in enumerate(command[:-1])
             if flag.startswith("--")}
    assert command[:2] == ["/t/bin/aiperf", "profile"] and "--streaming" in command
    assert flags["--url"] == "http://127.0.0.1:8000" and flags["--model"] == "smol"
    assert flags["--concurrency"] == "3" and flags["--request-count"] == "12"
    assert flags["--api-key"] == "sk-x" and flags["--endpoint-type"] == "chat"
    assert Path(command[command.index("--tokenizer") + 1]).is_absolute()
    quick = client_bench.load_of(parse("--quick", "--osl", "5"))
    assert quick == client_bench.Load(requests=8, concurrency=2, isl=64, osl=5, warmup=1)
    with pytest.raises(UsageError, match="--requests"):
        client_bench.load_of(parse("--requests", "0"))


def test_exports_become_our_figures() -> None:
    result = client_bench.summarize(PROFILE, SERVER)
    assert result["requests"] == 4 and result["errors"] == 2
    assert result["ttft_ms"] == {"avg": 2727.7, "p50": 2940.0, "p90": 4563.3, "p99": 4567.4}
    assert result["baseline_router"] == {"ttft_ms_avg": 2500.0, "itl_ms_avg": 350.0,
                                         "e2e_ms_avg": 8400.0}
    assert result["ttft_client_over_router"] == pytest.approx(2727.7 / 2500.0)
    assert client_bench.summarize(PROFILE, {})["ttft_client_over_router"] is None


def test_a_missing_aiperf_is_a_usage_error(tmp_path, capsys, model_dir) -> None:
    argv = ["bench", "client", "--url", "http://x", "--model", "m", "--tokenizer",
            str(model_dir), "--tool-dir", str(tmp_path)]
    assert cli.main(argv) == 2
    assert "make peers" in capsys.readouterr().err


def test_the_command_runs_aiperf_and_prints_json_last(tmp_path, capsys, model_dir,
                                                      monkeypatch) -> None:
    tool = tmp_path / "aiperf-venv"
    (tool / "bin").mkdir(parents=True)
    script = tool / "bin" / "aiperf"
    script.write_text(FAKE_AIPERF.format(python=sys.executable, profile=json.dumps(PROFILE),
                                         server=json.dumps(SERVER)))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    artifacts = tmp_path / "artifacts"
    assert cli.main(["bench", "client", "--url", "http://127.0.0.1:9/v1", "--model", "m",
                     "--tokenizer", str(model_dir), "--tool-dir", str(tool), "--json",
                     "--artifact-dir", str(artifacts)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tool"] == "aiperf" and result["itl_ms"]["p50"] == 388.1
    assert result["url"] == "http://127.0.0.1:9" and result["concurrency"] == 4
    seen = json.loads((artifacts / "seen.json").read_text())
    assert seen["offline"] is False and "--streaming" in seen["argv"]


@pytest.fixture
def model_dir(tmp_path) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    return folder
