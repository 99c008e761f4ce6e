"""BlockIndex: the prefix query, node removal, slot reuse, and a model check against sets."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.core.block_index import BlockIndex
from tests.metadata_service.helpers import make_chain


def make_index(holdings: dict[str, list[bytes]]) -> BlockIndex:
    index = BlockIndex()
    for node_id, hashes in holdings.items():
        index.add_node(node_id)
        index.add_blocks(node_id, hashes)
    return index


CHAIN = make_chain("req", 8)


def test_query_counts_leading_blocks_best_first() -> None:
    index = make_index({"a": CHAIN[:3], "b": CHAIN[:6], "c": CHAIN[1:8], "d": []})
    assert index.query(CHAIN) == [("b", 6), ("a", 3)]
    assert index.query(CHAIN, include_zero=True) == [("b", 6), ("a", 3), ("c", 0), ("d", 0)]


def test_query_counts_only_the_leading_run() -> None:
    # "a" holds blocks 0, 1 and 3: a hole at 2 means only 2 leading blocks.
    index = make_index({"a": [CHAIN[0], CHAIN[1], CHAIN[3]]})
    assert index.query(CHAIN) == [("a", 2)]


def test_query_ties_break_by_node_id_and_full_chain_counts() -> None:
    index = make_index({"z": CHAIN, "y": CHAIN})
    assert index.query(CHAIN) == [("y", 8), ("z", 8)]
    assert index.query([]) == []


def test_candidates_filter() -> None:
    index = make_index({"a": CHAIN[:3], "b": CHAIN[:6]})
    assert index.query(CHAIN, candidates=["a"]) == [("a", 3)]
    assert index.query(CHAIN, candidates=["ghost"]) == []
    assert index.query(CHAIN, candidates=[]) == []


def test_remove_node_drops_its_blocks_and_reuses_the_slot() -> None:
    index = make_index({"a": CHAIN[:4], "b": CHAIN[:2]})
    assert index.remove_node("a") == 4
    assert index.num_blocks == 2 and index.num_entries == 2
    index.add_node("c")
    assert index.query(CHAIN) == [("b", 2)], "a reused slot must start empty"
    index.add_blocks("c", CHAIN[:1])
    assert index.query(CHAIN) == [("b", 2), ("c", 1)]
    index.check_invariants()


def test_replace_and_clear() -> None:
    index = make_index({"a": CHAIN[:4]})
    index.replace_node_blocks("a", CHAIN[2:6])
    assert index.node_blocks("a") == frozenset(CHAIN[2:6])
    assert index.query(CHAIN) == []
    assert index.clear_node("a") == 4
    assert index.num_blocks == 0
    index.check_invariants()


def test_duplicate_adds_and_unknown_removes_are_harmless() -> None:
    index = make_index({"a": CHAIN[:2]})
    assert index.add_blocks("a", CHAIN[:2]) == 0
    assert index.remove_blocks("a", CHAIN[5:]) == 0
    assert index.num_entries == 2
    index.check_invariants()


NODES = ["n0", "n1", "n2", "n3"]
OPS = st.lists(st.tuples(
    st.sampled_from(["add", "remove", "clear", "drop", "replace"]),
    st.sampled_from(NODES),
    st.lists(st.integers(0, 11), max_size=6),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_matches_a_model_of_plain_sets(ops) -> None:
    hashes = make_chain("model", 12)
    index = BlockIndex()
    model: dict[str, set[bytes]] = {}
    for op, node_id, picks in ops:
        chosen = [hashes[i] for i in picks]
        if op == "drop":
            index.remove_node(node_id)
            model.pop(node_id, None)
            continue
        index.add_node(node_id)
        held = model.setdefault(node_id, set())
        if op == "add":
            index.add_blocks(node_id, chosen)
            held.update(chosen)
        elif op == "remove":
            index.remove_blocks(node_id, chosen)
            held.difference_update(chosen)
        elif op == "clear":
            index.clear_node(node_id)
            held.clear()
        else:
            index.replace_node_blocks(node_id, chosen)
            held.clear()
            held.update(chosen)
    index.check_invariants()
    expected = []
    for node_id, held in model.items():
        depth = 0
        while depth < len(hashes) and hashes[depth] in held:
            depth += 1
        expected.append((node_id, depth))
    expected.sort(key=lambda item: (-item[1], item[0]))
    assert index.query(hashes, include_zero=True) == expected
    assert index.num_entries == sum(len(s) for s in model.values())
