"""The engine on CPU against an earlier revision of itself: `bench peers`' four workloads
(benchmarks/peers_workloads.py: W1 32 x (256 -> 64) tok/s, W2 batch-1 decode ms/token, W3
TTFT of 2,048 tokens, W4 W1 behind a shared 1,024-token prefix), the same settings, the same
token ids, each revision's engine in a process of its own (benchmarks/peers_driver.py with the
revision's checkout first on PYTHONPATH), repeats interleaved, in one run:

    python -m benchmarks regress --baseline f09da38^ --json

The baseline is checked out (detached) under the cache folder's `regress/<commit>` once. The
JSON holds both revisions' medians and spread, `current / baseline` per workload for each
repeat's back-to-back pair (W1 and W4 are rates, higher is better; W2 and W3 are times, lower
is better), and whether their greedy tokens agree: a no-regression check for changes that
reach the CPU path (e.g. the GPU engine's).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.peers_machine import LoadGate, LoadMonitor
from benchmarks.peers_process import EngineProcess
from benchmarks.peers_report import greedy_match, paired_ratios, spread
from benchmarks.peers_settings import Launch, PeerSettings
from benchmarks.peers_workloads import QUICK, PeerSizes, make_workloads
from pdcluster.core.paths import builtin_model_dir, cache_dir

CHECKOUT = Path(__file__).resolve().parents[1]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", required=True, metavar="REV",
                        help="the git revision to compare against (e.g. a commit before a change)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of both engines")
    parser.add_argument("--model", default=None, help="model folder (default: the built-in one)")
    parser.add_argument("--max-load", type=float, default=None,
                        help="the highest 1-minute load average to start at (default: the "
                        "cores the engines leave free, at least 0.5)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="wait up to this long for the load to drop before refusing")
    parser.add_argument("--allow-busy", action="store_true",
                        help="run on a busy machine anyway, flagging the result")


def baseline_checkout(rev: str) -> tuple[str, Path]:
    """The commit `rev` names and a detached checkout of it under the cache folder."""
    commit = subprocess.run(["git", "-C", str(CHECKOUT), "rev-parse", "--verify",
                             f"{rev}^{{commit}}"], check=True, capture_output=True,
                            text=True).stdout.strip()
    path = cache_dir() / "regress" / commit[:12]
    if not (path / "pdcluster").is_dir():
        subprocess.run(["git", "-C", str(CHECKOUT), "worktree", "add", "--detach", str(path),
                        commit], check=True, capture_output=True)
    return commit, path


def _engine(root: Path, launch: Launch, log: Path) -> EngineProcess:
    """`launch`'s engine, importing pdcluster from the checkout at `root`."""
    env = {**launch.env, "PYTHONPATH": str(root)}
    return EngineProcess(sys.executable, "pdcluster", Launch(launch.options, launch.sampling, env),
                         log)


def run(args: argparse.Namespace) -> dict:
    sizes = QUICK if args.quick else PeerSizes(repeats=args.repeats)
    model = str(args.model or builtin_model_dir())
    settings = PeerSettings(threads=args.threads, max_num_seqs=sizes.num_requests)
    gate = LoadGate.for_threads(settings.threads, args.max_load, args.wait_quiet,
                                args.allow_busy).check()
    commit, base_root = baseline_checkout(args.baseline)
    launch = settings.launch("pdcluster", model)
    logs = cache_dir() / "regress"
    engines = {"baseline": _engine(base_root, launch, logs / "baseline-run.log"),
               "current": _engine(CHECKOUT, launch, logs / "current-run.log")}
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    try:
        for engine in engines.values():
            engine.start()
        windows = []
        with LoadMonitor() as monitor:
            for repeat in range(sizes.repeats):
                work = make_workloads(sizes, repeat)
                for name, engine in engines.items():
                    print(f"repeat {repeat + 1}/{sizes.repeats}: {name}", file=sys.stderr,
                          flush=True)
                    monitor.window()
                    runs[name].append(engine.measure(work, sizes.to_dict()))
                    windows.append(monitor.window())
    finally:
        for engine in engines.values():
            engine.close()
    return {"baseline": {"rev": args.baseline, "commit": commit}, "model": Path(model).name,
            "threads": settings.threads, "sizes": sizes.to_dict(), "load_at_start": gate,
            "load_busy_windows": sum(w["busy"] for w in windows),
            "medians": {name: _medians(r) for name, r in runs.items()},
            "spread": {name: spread(r) for name, r in runs.items()},
            "current_over_baseline": paired_ratios(runs["current"], runs["baseline"]),
            "greedy_match": greedy_match(runs["current"], runs["baseline"])}


def _medians(runs: list[dict]) -> dict[str, float]:
    keys = [k for k, v in runs[0].items() if isinstance(v, float)]
    return {k: round(statistics.median(r[k] for r in runs), 2) for k in keys}
