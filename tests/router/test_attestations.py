"""The attestation table (router.routing.attestations), the claims mirror that feeds it, and a
MetadataLink using them against a real metadata service:
only blocks the router gave a node count for routing; bounds; attestations leave with the
block (and wait, bounded, for a request in flight to store it again); host moves keep them;
a resync re-sorts them; a removed node loses them."""

from __future__ import annotations

import asyncio

import pytest

from pdcluster.benchmarks.ports import free_port
from pdcluster.core.events import DEVICE, HOST
from pdcluster.core.hashing import DEFAULT_HASH_CONFIG, BlockExtra, hash_block_tokens
from pdcluster.metadata_service.client import MetadataClient
from pdcluster.metadata_service.server import ServerThread
from pdcluster.router.routing.attestations import (
    Attestations,
    ClaimsMirror,
    cut_unattested,
    output_blocks,
)
from pdcluster.router.routing.metadata_link import MetadataLink
from tests.metadata_service.helpers import make_chain, make_config, make_publisher
from tests.router.test_metadata_link import until


def chain(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode().ljust(32, b".") for i in range(n)]


def mirror_with(table: Attestations, *nodes: str) -> ClaimsMirror:
    mirror = ClaimsMirror()
    for node in nodes:
        mirror.add_node(node)
    table.rebase(mirror)
    mirror.attestations = table
    return mirror


def hits_of(mirror: ClaimsMirror, table: Attestations, blocks: list[bytes]) -> dict:
    hits, lower = dict(mirror.query(blocks)), {}
    for node in hits:
        host, disk = mirror.lower_tiers(node, blocks[:hits[node]])
        if host or disk:
            lower[node] = (host, disk)
    cut_unattested(table, hits, lower, blocks, mirror)
    # the mirror's path (a walk of the attested index) and the walk node by node agree
    assert dict(table.held.query(blocks)) == hits
    table.held.check_invariants()
    return {node: (k, lower.get(node)) for node, k in hits.items()}


def test_only_claims_the_router_attested_are_routed_on() -> None:
    seen = []
    table = Attestations(on_unattested=lambda node, n: seen.append((node, n)))
    mirror = mirror_with(table, "honest", "liar")
    victim = chain("victim", 6)
    table.attest("honest", victim)  # the router sent the victim's prompt here
    mirror.add_blocks("honest", victim)
    mirror.add_blocks("liar", victim)  # claimed without ever being sent it
    assert hits_of(mirror, table, victim) == {"honest": (6, None)}
    assert table.unattested_claims == {"liar": 6} and seen == [("liar", 6)]
    assert table.num_held("honest") == 6 and table.num_pending("honest") == 0


def test_a_run_is_cut_at_its_first_unattested_block() -> None:
    table = Attestations()
    mirror = mirror_with(table, "n")
    blocks = chain("p", 8)
    table.attest("n", blocks[:5])
    mirror.add_blocks("n", blocks[:3], HOST)
    mirror.add_blocks("n", blocks[3:])  # 3 more than it was given
    assert hits_of(mirror, table, blocks) == {"n": (5, (3, 0))}
    assert table.unattested_claims == {"n": 3}


def test_a_claim_made_before_the_dispatch_counts_once_the_router_sends_it() -> None:
    """A router that restarted: the node held the blocks before; the first request the new
    router sends there attests them (the node hits its own cache, no new event)."""
    table = Attestations()
    mirror = mirror_with(table, "n")
    blocks = chain("old", 4)
    mirror.add_blocks("n", blocks)
    assert hits_of(mirror, table, blocks) == {}
    table.attest("n", blocks)
    assert hits_of(mirror, table, blocks) == {"n": (4, None)}
    assert table.num_held("n") == 4 and table.num_pending("n") == 0


def test_host_moves_keep_the_attestation_and_removal_releases_it() -> None:
    table = Attestations()
    mirror = mirror_with(table, "n")
    blocks = chain("m", 4)
    table.attest("n", blocks)
    mirror.add_blocks("n", blocks)
    mirror.move_blocks("n", blocks[2:], DEVICE, HOST)
    assert hits_of(mirror, table, blocks) == {"n": (4, (2, 0))}
    assert table.num_held("n") == 4 and not table.unattested_claims
    mirror.remove_blocks("n", blocks[3:], HOST)  # its only copy: it leaves the node
    assert table.num_held("n") == 3 and table.num_pending("n") == 1
    mirror.remove_blocks("n", blocks[:1], HOST)  # not on the host: it stays
    assert table.num_held("n") == 3


def test_a_request_in_flight_stores_a_block_again_after_its_eviction() -> None:
    """REMOVED (an eviction) can overtake the STORED of the request the router just sent:
    the released attestation waits in `pending`."""
    table = Attestations()
    mirror = mirror_with(table, "n")
    blocks = chain("r", 3)
    table.attest("n", blocks)
    mirror.add_blocks("n", blocks)
    table.attest("n", blocks)  # the next request, routed on the hit
    mirror.clear_node("n")  # evicted before that request ran
    mirror.add_blocks("n", blocks)  # the request computes them again
    assert hits_of(mirror, table, blocks) == {"n": (3, None)}
    assert not table.unattested_claims


def test_pending_attestations_are_bounded_per_node() -> None:
    table = Attestations(max_pending=10)
    mirror = mirror_with(table, "n")
    blocks = chain("b", 25)
    table.attest("n", blocks)
    assert table.num_pending("n") == 10
    assert not table.attested("n", blocks[14]) and table.attested("n", blocks[15])
    mirror.add_blocks("n", blocks)  # the oldest fell out: their claims are not vouched for
    assert table.num_held("n") == 10 and table.unattested_claims == {"n": 15}
    mirror.remove_blocks("n", blocks)
    assert table.num_held("n") == 0 and table.num_pending("n") == 10
    with pytest.raises(ValueError, match="max_pending"):
        Attestations(max_pending=0)


def test_held_attestations_are_bounded_by_the_mirror() -> None:
    table = Attestations(max_pending=4)
    mirror = mirror_with(table, "n")
    for round_ in range(20):  # a node that stores and evicts a prompt after another
        blocks = chain(f"t{round_}", 8)
        table.attest("n", blocks)
        mirror.add_blocks("n", blocks)
        mirror.remove_blocks("n", blocks)
    assert table.num_held("n") == 0 and table.num_pending("n") == 4
    mirror.check_invariants()


def test_a_removed_node_loses_its_attestations() -> None:
    table = Attestations()
    mirror = mirror_with(table, "n")
    blocks = chain("x", 3)
    table.attest("n", blocks)
    mirror.add_blocks("n", blocks)
    mirror.remove_node("n")
    mirror.add_node("n")  # registered again (a new epoch): it proves nothing it held
    mirror.add_blocks("n", blocks)
    assert hits_of(mirror, table, blocks) == {} and table.unattested_claims == {"n": 3}


def test_a_resync_keeps_attestations_against_the_new_snapshot() -> None:
    table = Attestations()
    old = mirror_with(table, "n")
    kept, gone = chain("k", 3), chain("g", 3)
    table.attest("n", kept + gone)
    old.add_blocks("n", kept + gone)
    table.claims = None  # the watch broke
    fresh = ClaimsMirror()  # the new snapshot: "gone" was evicted meanwhile, a lie added
    fresh.add_node("n")
    fresh.add_blocks("n", kept + chain("lie", 2))
    table.rebase(fresh)
    fresh.attestations = table
    assert table.num_held("n") == 3 and table.num_pending("n") == 3
    assert hits_of(fresh, table, kept) == {"n": (3, None)}
    assert hits_of(fresh, table, chain("lie", 2)) == {}


def test_without_a_mirror_attestations_wait_and_cut_the_services_answer() -> None:
    table = Attestations()
    blocks = chain("q", 6)
    table.attest("n", blocks[:2])
    hits, lower = {"n": 6, "m": 4}, {"n": (5, 1), "m": (1, 0)}
    assert cut_unattested(table, hits, lower, blocks, None) == 2
    assert hits == {"n": 2} and lower == {"n": (2, 0)}


def test_output_blocks_continue_the_prompts_chain() -> None:
    extra = BlockExtra(cache_salt="tenant")
    prompt, generated = list(range(1, 38)), list(range(100, 130))
    whole = hash_block_tokens(prompt + generated, 16, extra, DEFAULT_HASH_CONFIG)
    prompt_chain = hash_block_tokens(prompt, 16, extra, DEFAULT_HASH_CONFIG)
    assert output_blocks(prompt_chain, prompt, generated, 16, extra,
                         DEFAULT_HASH_CONFIG) == whole[len(prompt_chain):]
    assert len(whole) == 4 and len(prompt_chain) == 2
    assert output_blocks([], prompt[:5], generated[:3], 16, extra, DEFAULT_HASH_CONFIG) == []


def test_the_link_keeps_attestations_across_a_service_restart() -> None:
    """A real metadata service (memory backend) restarts empty and the nodes publish again:
    the router's attestations survive the resync; meanwhile the last mirror's answers and the
    per-request Query's are cut to them too."""
    port = free_port()
    config = make_config(port=port)
    sent, lie = make_chain("sent", 8), make_chain("lie", 8)

    async def in_sync_with(link: MetadataLink, blocks: dict[str, int]) -> None:
        async def check() -> bool:
            return link.mirror_in_sync and link.mirror_node_blocks() == blocks
        await until(check, what=f"the mirror to hold {blocks}")

    async def scenario() -> None:
        table = Attestations()
        link = MetadataLink(f"127.0.0.1:{port}", timeout_s=0.3, retry_s=0.1,
                            attestations=table)
        query = MetadataLink(f"127.0.0.1:{port}", mirror=False, attestations=table)
        table.attest("p0", sent[:6])  # the router sent p0 the first 6 blocks
        with ServerThread(config) as server, MetadataClient(server.address) as client:
            p0, n0 = make_publisher(client, "p0", ttl=30)
            p0.publish([n0.store(sent)])
            await in_sync_with(link, {"p0": 8})
            before = table.unattested_claims.get("p0", 0)  # 2 if they came as an event
            p0.publish([n0.store(lie)])
            await in_sync_with(link, {"p0": 16})
            assert await link.prefix_hits(sent) == {"p0": 6}
            assert await link.prefix_hits(lie) == {}
            assert await query.prefix_hits(sent) == {"p0": 6}
            assert table.unattested_claims["p0"] == before + 8
        async def out_of_sync() -> bool:
            return not link.mirror_in_sync
        await until(out_of_sync, what="the stream to break")
        assert await link.prefix_hits(sent) == {"p0": 6}  # the last mirror, cut too
        with ServerThread(config) as server, MetadataClient(server.address) as client:
            p0, n0 = make_publisher(client, "p0", ttl=30)
            p0.publish([n0.store(sent[:4])])
            await in_sync_with(link, {"p0": 4})
            assert link.mirror_syncs == 2
            assert await link.prefix_hits(sent) == {"p0": 4}
            assert table.num_held("p0") == 4 and table.num_pending("p0") == 2
            p0.publish([n0.store(sent[4:])])  # two of these were attested before the restart
            await in_sync_with(link, {"p0": 8})
            assert await link.prefix_hits(sent) == {"p0": 6}
        await link.close()
        await query.close()

    asyncio.run(scenario())
