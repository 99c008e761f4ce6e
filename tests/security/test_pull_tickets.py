"""Pull tickets (core.pull_ticket), against real nodes: holder h0 and puller p0 (engine, node
server, their own keys, registered with a real metadata service; Mooncake over TCP and the
KV side channel on 127.0.0.1), a registered router's ticket signer, and member m0, a
registered decode node with its own key, side channel and Mooncake memory.

Before tickets, a member could send a holder its own `PrefixPullRequest` for any tokens and
salt and read `XferDone.num_blocks_sent`: how much of that prompt the holder caches (and get
the KV written into its memory). Now the holder serves a pull only with a ticket a
registered router signed for exactly that holder, puller and chain, unexpired; any other is
answered at once as failed (no blocks, `num_blocks_sent` 0) and counted. Each refusal is
paired with the move that is served: the router-arranged pull (its tokens equal the unpulled
run's), and the member's own pull with a ticket made out to it."""

from __future__ import annotations

import secrets
import time
from dataclasses import replace

import pytest

from pdcluster.core.node_wire import GenerateRequest, PrefixSource, SamplingSpec
from pdcluster.node.client import BlockingNodeClient, tokens_of
from tests.models import random_prompts
from tests.security.pull_plane import BLOCK, NUM_BLOCKS, counters, member_pull, pull_plane

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingSpec(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def plane(model_dirs):
    with pull_plane(model_dirs["llama-gqa"]) as made:
        yield made


def _generate(client: BlockingNodeClient, request_id: str, prompt: list[int],
              source: PrefixSource | None = None) -> list[int]:
    client.send(GenerateRequest(request_id, prompt, GREEDY, prefix_source=source))
    return tokens_of(client.collect({request_id})[request_id])


def _hold(plane, prompt: list[int]) -> None:
    """h0 computes `prompt`: its blocks are in h0's prefix cache."""
    _generate(plane.clients["h0"], f"hold-{secrets.token_hex(3)}", prompt)


def _ticket(plane, prompt: list[int], puller: str = "m0", holder: str = "h0", **kw):
    return plane.signer.sign("r", puller, holder, prompt, BLOCK, NUM_BLOCKS, kw.pop("salt", None),
                             **kw)


def test_a_member_cannot_start_its_own_pull_and_the_routers_pull_still_works(
        plane, hf_reference):
    prompt = random_prompts(1, 6 * BLOCK, 6 * BLOCK, seed=91)[0]
    _hold(plane, prompt)
    h0 = plane.nodes["h0"]
    before = counters(h0)
    # the attack: m0 asks h0 for the prompt's blocks without a ticket
    done, touched = member_pull(plane, "h0", prompt)
    assert (done.ok, done.num_blocks_sent, touched) == (False, 0, False)
    after = counters(h0)
    assert after["pull_requests_refused"] - before["pull_requests_refused"] == 1
    assert after["blocks_served"] == before["blocks_served"]
    # the control: the router arranges p0's pull with its ticket; the tokens equal the
    # unpulled run's, and the blocks came from h0
    pulled_before = counters(plane.nodes["p0"])["blocks_pulled"]
    source = PrefixSource(h0.kv_address, NUM_BLOCKS,
                          plane.signer.sign("pulled", "p0", "h0", prompt, BLOCK, NUM_BLOCKS,
                                            None))
    got = _generate(plane.clients["p0"], "pulled", prompt, source)
    assert counters(plane.nodes["p0"])["blocks_pulled"] - pulled_before == NUM_BLOCKS
    assert got == hf_reference(plane.model, prompt, GREEDY.max_tokens)
    # and the same pull, made out to m0, is served to m0: the ticket is what decides
    done, touched = member_pull(plane, "h0", prompt, _ticket(plane, prompt))
    assert (done.ok, done.num_blocks_sent, touched) == (True, NUM_BLOCKS, True)


def test_a_ticket_for_another_chain_puller_or_holder_is_refused(plane):
    prompt, other = random_prompts(2, 6 * BLOCK, 6 * BLOCK, seed=92)
    for held in (prompt, other):
        _hold(plane, held)
        _generate(plane.clients["p0"], f"p0-holds-{secrets.token_hex(3)}", held)
    ticket = _ticket(plane, prompt)
    replays = {
        "another chain": ("h0", other, ticket),
        "another salt": ("h0", prompt, ticket, "tenant-x"),
        "another holder": ("p0", prompt, ticket),
        "made out to p0": ("h0", prompt, _ticket(plane, prompt, puller="p0")),
        "a forged signature": ("h0", prompt, replace(ticket, signature=bytes(64))),
        "a longer chain claimed": ("h0", prompt, replace(ticket, num_blocks=NUM_BLOCKS + 1)),
    }
    for name, (holder, tokens, bad, *salt) in replays.items():
        done, touched = member_pull(plane, holder, tokens, bad, *salt)
        assert (done.ok, done.num_blocks_sent, touched) == (False, 0, False), name
    done, touched = member_pull(plane, "h0", prompt, ticket)  # as made out: served
    assert (done.ok, done.num_blocks_sent, touched) == (True, NUM_BLOCKS, True)


def test_an_expired_ticket_is_refused(plane):
    prompt = random_prompts(1, 6 * BLOCK, 6 * BLOCK, seed=93)[0]
    _hold(plane, prompt)
    expired = _ticket(plane, prompt, now=time.time() - plane.signer.ttl_s - 60)
    done, touched = member_pull(plane, "h0", prompt, expired)
    assert (done.ok, done.num_blocks_sent, touched) == (False, 0, False)
    fresh = _ticket(plane, prompt)
    done, touched = member_pull(plane, "h0", prompt, fresh)
    assert (done.ok, done.num_blocks_sent, touched) == (True, NUM_BLOCKS, True)
