"""A prefill node killed after its part, before and after the decode node's load is
registered (tests/chaos/prefill_lost.py: a schedule made by stopping processes), on a served
own-engine cluster of one prefill and one decode node: the router tells the decode node,
which resumes the request at once — its receive failed as lost, never timed out. (The same
schedules on vLLM nodes: tests/vllm_backend/test_vllm_faults.py.)"""

from __future__ import annotations

import pytest

from tests.chaos.conftest import start_chaos
from tests.chaos.prefill_lost import kill_prefill_after_its_part

pytestmark = pytest.mark.timeout(600)
# The goal is 1 s; a loaded 2-core CI machine gets this much more. The KV timeout is 30 s.
RESUMED_WITHIN_S = 3.0


@pytest.fixture(scope="module")
def chaos(model_dirs):
    running = start_chaos(model_dirs, num_prefill=1, num_decode=1, lease_ttl_s=4)
    yield running
    running.cluster.stop()


@pytest.mark.parametrize("registered", [False, True])
def test_a_prefill_node_killed_after_its_part_is_reported_and_recomputed_at_once(
        chaos, registered):
    result = kill_prefill_after_its_part(chaos, registered, seed=11 + registered)
    shown = str(result)  # whole in a failure's message (a dict's repr is cut short)
    assert result["error"] is None and result["num_tokens"] == 8, shown
    assert result["resumed_after_s"] is not None, shown
    assert result["resumed_after_s"] < RESUMED_WITHIN_S, shown
    # its source gone: told by the router, or found by the side channel (prefill_lost.py)
    assert result["sources_lost"] + result["sources_unreachable"] == 1, shown
    assert result["timeouts"] == 0 and result["receive_failed"], shown
