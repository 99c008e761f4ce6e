"""tests/security's probes against a cluster whose nodes run vLLM: the same attack functions
(imported, so pytest runs them here against this module's `served`), on a real
`pdcluster serve --engine vllm` (local Ray, a prefill and a decode node actor each driving
vLLM's engine core and worker processes, the metadata service, the router, the tiny
`llama-vllm` model). Plus every listener of the process tree — vLLM's own processes
included — on the host address only.

Own-engine-only probes stay in tests/security: the member controls of the side-channel tests
write one contiguous block per address, the own engine's KV layout; a vLLM node's region is
one segment per layer tensor, so those controls do not carry over unchanged. Their stranger
halves run here.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make setup-vllm)")
pytest.importorskip("ray")

from tests.cluster.test_serve_e2e import free_port  # noqa: E402
from tests.security import test_zmq_attacks  # noqa: E402
from tests.security.listeners import listening_sockets, process_tree  # noqa: E402
from tests.security.served import start_served  # noqa: E402
from tests.security.test_identity import (  # noqa: E402, F401
    test_a_decode_node_cannot_send_a_generate_request_to_a_prefill_node,
    test_a_decode_nodes_credential_cannot_register_another_node,
    test_not_even_p0s_own_credential_takes_over_the_live_p0,
    test_only_the_submitter_aborts_a_request,
    test_the_routers_credential_cannot_register_a_node,
)
from tests.security.test_listeners import is_ray_daemon, not_on_host  # noqa: E402
from tests.security.test_zmq_attacks import (  # noqa: E402, F401
    test_a_stranger_cannot_generate_on_a_node,
    test_a_stranger_cannot_poison_a_decode_nodes_cache,
    test_router_api_keys_cannot_be_bypassed,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def served(model_dirs):
    cluster = start_served(model_dirs["llama-vllm"], free_port(), engine="vllm")
    yield cluster
    cluster.stop()


def test_the_side_channel_refuses_strangers(served) -> None:
    """The stranger half of tests/security's side-channel probe (see the docstring above)."""
    test_zmq_attacks.test_side_channel_refuses_strangers(served, member_control=False)


def test_a_vllm_cluster_listens_on_the_host_only(served) -> None:
    """The serve process, the node actors and vLLM's engine-core and worker processes they
    start: every listener on 127.0.0.1 (Ray's own daemons exempt, as in tests/security)."""
    listeners = listening_sockets(served.proc.pid)
    checked = [s for s in listeners if not is_ray_daemon(s)]
    print("checked:\n" + "\n".join(f"  {s}" for s in checked))
    actors = {s.pid for s in checked if s.name in ("ray::PrefillNod", "ray::DecodeNode")}
    assert len(actors) == 2, checked
    for actor in actors:  # vLLM's engine core (and its worker) run under each node actor
        assert len(process_tree(actor)) >= 3, f"no vLLM processes under node actor {actor}"
    assert not not_on_host(checked), "\n".join(not_on_host(checked))
