"""router.routing.identity.ClusterIdentity alone (no I/O, an injected clock): which identity the
router takes for the cluster's, which nodes it quarantines and why, and when it lets go."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdcluster.core.kv_identity import KVIdentity
from pdcluster.router.config import NodeSpec
from pdcluster.router.routing.identity import REPIN_AFTER_S, ClusterIdentity

TOKENIZER = "sha256:" + "1" * 64
GOOD = KVIdentity(16, "sha256", "pdcluster-v1", "tiny", TOKENIZER)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def spec(node_id: str, identity: KVIdentity | None = GOOD) -> NodeSpec:
    return NodeSpec(node_id, "decode", f"tcp://127.0.0.1:{7000 + len(node_id)}", "",
                    identity=identity)


def ids(specs: list[NodeSpec]) -> list[str]:
    return [s.node_id for s in specs]


def test_the_first_registered_node_names_the_cluster(caplog) -> None:
    cluster = ClusterIdentity(TOKENIZER)
    assert cluster.current is None and ids(cluster.admit([])) == []
    assert ids(cluster.admit([spec("n1")])) == ["n1"]
    assert cluster.current == GOOD and cluster.source == "node n1"
    late = spec("a0", replace(GOOD, block_size=32))  # sorts first, registers later
    assert ids(cluster.admit([late, spec("n1")])) == ["n1"]
    assert cluster.current == GOOD
    verdict = cluster.quarantined["a0"]
    assert verdict.fields == ("block_size",)
    assert verdict.reason == "block_size 32 (the cluster's: 16)"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["node a0 quarantined, it gets no requests: its KV identity differs "
                        "from the cluster's: block_size 32 (the cluster's: 16)"]
    cluster.admit([late, spec("n1")])  # logged once per node and difference
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1


def test_a_router_joining_a_running_cluster_takes_its_majority() -> None:
    seed = replace(GOOD, hash_seed="other")
    cluster = ClusterIdentity(TOKENIZER)
    admitted = cluster.admit([spec("a-odd", seed), spec("n1"), spec("n2")])
    assert ids(admitted) == ["n1", "n2"] and cluster.current == GOOD
    assert cluster.quarantined["a-odd"].fields == ("hash_seed",)
    tie = ClusterIdentity(TOKENIZER)  # one each: the smallest node id's
    assert ids(tie.admit([spec("b", GOOD), spec("a", seed)])) == ["a"]


def test_a_node_with_another_tokenizer_never_names_the_cluster() -> None:
    cluster = ClusterIdentity(TOKENIZER)
    foreign = replace(GOOD, tokenizer_digest="sha256:" + "2" * 64)
    assert cluster.admit([spec("a", foreign)]) == []
    assert cluster.current is None
    assert cluster.quarantined["a"].fields == ("tokenizer_digest",)
    assert "the router's" in cluster.quarantined["a"].reason
    assert ids(cluster.admit([spec("a", foreign), spec("b")])) == ["b"]
    assert cluster.quarantined["a"].fields == ("tokenizer_digest",)


def test_a_node_declaring_no_identity_gets_nothing() -> None:
    cluster = ClusterIdentity(TOKENIZER)
    old = KVIdentity(0, "", "", "", "")  # an older node, or a registration without one
    assert cluster.admit([spec("old", old)]) == [] and cluster.current is None
    assert set(cluster.quarantined["old"].fields) == {"tokenizer_digest"}
    assert ids(cluster.admit([spec("old", old), spec("n1")])) == ["n1"]
    assert set(cluster.quarantined["old"].fields) == {"block_size", "hash_algorithm",
                                                      "hash_seed", "model", "tokenizer_digest"}


def test_a_node_registering_again_with_the_clusters_identity_is_admitted() -> None:
    cluster = ClusterIdentity(TOKENIZER)
    cluster.admit([spec("n1")])
    cluster.admit([spec("n1"), spec("n2", replace(GOOD, model="other"))])
    assert list(cluster.quarantined) == ["n2"]
    assert ids(cluster.admit([spec("n1"), spec("n2")])) == ["n1", "n2"]
    assert cluster.quarantined == {}


def test_the_identity_is_taken_anew_only_after_no_node_shared_it_for_a_while() -> None:
    clock = Clock()
    cluster = ClusterIdentity(TOKENIZER, clock=clock)
    cluster.admit([spec("n1")])
    redeployed = replace(GOOD, block_size=32)
    # the metadata service restarted empty, then the odd node registered first: kept
    cluster.admit([])
    clock.now += REPIN_AFTER_S / 2
    assert cluster.admit([spec("x", redeployed)]) == [] and cluster.current == GOOD
    assert ids(cluster.admit([spec("x", redeployed), spec("n1")])) == ["n1"]
    # the whole cluster came back with another identity: after REPIN_AFTER_S, it is taken
    clock.now += 1.0
    cluster.admit([spec("x", redeployed)])
    clock.now += REPIN_AFTER_S
    assert ids(cluster.admit([spec("x", redeployed)])) == ["x"]
    assert cluster.current == redeployed and cluster.quarantined == {}


def test_an_explicit_identity_is_the_clusters_for_good() -> None:
    clock = Clock()
    cluster = ClusterIdentity(TOKENIZER, GOOD, clock)
    assert cluster.current == GOOD and cluster.source == "config"
    other = replace(GOOD, block_size=8)
    assert cluster.admit([spec("a", other), spec("b", other)]) == []
    clock.now += 10 * REPIN_AFTER_S
    assert cluster.admit([spec("a", other)]) == [] and cluster.current == GOOD
    with pytest.raises(ValueError, match="tokenizer"):
        ClusterIdentity("sha256:" + "3" * 64, GOOD)


def test_static_nodes_are_not_checked() -> None:
    cluster = ClusterIdentity(TOKENIZER)
    assert ids(cluster.admit([spec("static", None)])) == ["static"]
    assert cluster.current is None and cluster.quarantined == {}
