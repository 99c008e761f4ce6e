"""The price of pull tickets: `python -m benchmarks.pull_ticket_bench [--rounds N]`.

On the plane of tests/security/test_pull_tickets.py (a real metadata service, holder h0 with
its own key, Mooncake over TCP on 127.0.0.1), a registered member pulls 4 cached blocks of
a 48-token prompt from h0 with a router's ticket, and the round trip (request sent ->
`XferDone` received: the holder's checks, its engine's lookup, the write, the reply) is
timed with the holder's ticket check on, and off (the baseline: the check bypassed in the
same process), alternating per round. Prints a table, then one JSON object: medians and
their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from pdcluster.core.node_wire import GenerateRequest, SamplingSpec
from pdcluster.transfer.peer_rules import PeerRules
from tests.models import build_model_dirs, random_prompts
from tests.security.pull_plane import BLOCK, NUM_BLOCKS, member_pull, pull_plane


def _timed_pull(plane, prompt: list[int]) -> float:
    ticket = plane.signer.sign("bench", "m0", "h0", prompt, BLOCK, NUM_BLOCKS, None)
    start = time.perf_counter()
    done, _ = member_pull(plane, "h0", prompt, ticket)
    elapsed = time.perf_counter() - start
    assert done.ok and done.num_blocks_sent == NUM_BLOCKS, done
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pull_ticket_bench")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        model = build_model_dirs(Path(folder))["llama-gqa"]
        with pull_plane(model) as plane:
            prompt = random_prompts(1, 6 * BLOCK, 6 * BLOCK, seed=7)[0]
            client = plane.clients["h0"]
            client.send(GenerateRequest("hold", prompt, SamplingSpec(max_tokens=1)))
            client.collect({"hold"})
            _timed_pull(plane, prompt)  # warm: the first transfer to a peer sets it up
            checked, unchecked = [], []
            for _ in range(args.rounds):
                checked.append(_timed_pull(plane, prompt))
                with mock.patch.object(PeerRules, "_check_ticket", lambda *a: None):
                    unchecked.append(_timed_pull(plane, prompt))
    with_check, without = statistics.median(checked), statistics.median(unchecked)
    print(f"{'pull round trip':<24}{'p50 ms':>10}")
    print(f"{'without ticket check':<24}{without * 1e3:>10.3f}")
    print(f"{'with ticket check':<24}{with_check * 1e3:>10.3f}")
    print(json.dumps({"rounds": args.rounds, "blocks": NUM_BLOCKS,
                      "pull_ms_p50_unchecked": round(without * 1e3, 3),
                      "pull_ms_p50_checked": round(with_check * 1e3, 3),
                      "ticket_check_ratio": round(with_check / without, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
