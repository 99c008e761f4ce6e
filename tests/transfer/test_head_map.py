"""The head-range mapping between tensor-parallel groups (transfer/head_map.py), checked
against a byte-level model: two groups' regions as bytearrays in the engine's layout, the
planned descriptors applied, every destination byte compared with the model's heads. Also:
the split agrees with the engine's own (engine/models/parallel.py), descriptors stay one per
(source rank, destination rank, block) overlap and merge runs of blocks where both sides
split alike, each destination byte is written once, and the wire refuses impossible groups."""

from __future__ import annotations

import pytest

from pdcluster.core.kv_ranks import rank_heads
from pdcluster.core.kv_transfer import KVGroup, XferRequest, decode, encode
from pdcluster.core.wire import WireError
from pdcluster.engine.models.parallel import TensorParallel, head_slice
from pdcluster.transfer.head_map import GroupLayout, head_moves, plan_writes

HEAD_NBYTES = 6  # bytes of one head of one block (every layer and plane), small on purpose
SPLITS = [(h, p, d) for h in (1, 2, 4, 8) for p in (1, 2, 4, 8) for d in (1, 2, 4, 8)
          if all(h % t == 0 if h >= t else t % h == 0 for t in (p, d))]


@pytest.mark.parametrize("num_heads", [1, 2, 4, 8])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_the_split_is_the_engines(num_heads, tp):
    if (num_heads % tp if num_heads >= tp else tp % num_heads):
        with pytest.raises(ValueError):
            rank_heads(num_heads, tp, 0)
        return
    for rank in range(tp):
        shard = head_slice(num_heads, 1, TensorParallel(rank, tp), "heads")
        assert rank_heads(num_heads, tp, rank) == range(shard.start, shard.start + shard.length)


def _layout(num_heads: int, tp: int, num_blocks: int, base: int) -> GroupLayout:
    local = len(rank_heads(num_heads, tp, 0))
    block = local * HEAD_NBYTES
    return GroupLayout(num_heads, block, tuple(f"s{base}-{r}" for r in range(tp)),
                       tuple(base + r * num_blocks * block * 2 for r in range(tp)))


def _fill(layout: GroupLayout, num_blocks: int) -> dict[int, bytearray]:
    """Each rank's region (by base), its bytes naming (block, head, byte)."""
    regions = {}
    for rank, base in enumerate(layout.bases):
        data = bytearray(num_blocks * layout.block_nbytes)
        for block in range(num_blocks):
            for i, head in enumerate(rank_heads(layout.num_kv_heads, layout.tp_size, rank)):
                for b in range(HEAD_NBYTES):
                    data[block * layout.block_nbytes + i * HEAD_NBYTES + b] = \
                        (block * 31 + head * 7 + b) % 251
        regions[base] = data
    return regions


def _apply(writes, src: GroupLayout, dst: GroupLayout, src_regions, dst_regions) -> list[int]:
    """Apply the descriptors; how many times each destination byte was written."""
    def locate(regions, addr):
        base = max(b for b in regions if b <= addr)
        return regions[base], addr - base

    counts = {base: [0] * len(data) for base, data in dst_regions.items()}
    for w in writes:
        assert 0 <= w.rank < src.tp_size
        dst_base = dst.bases[dst.sessions.index(w.session)]
        for s, d, n in zip(w.src, w.dst, w.lengths, strict=True):
            data, off = locate(src_regions, s)
            assert locate(src_regions, s + n - 1)[0] is data, "a descriptor crosses ranks"
            out, doff = locate(dst_regions, d)
            assert out is dst_regions[dst_base], "written to a rank not of its session"
            out[doff:doff + n] = data[off:off + n]
            for i in range(doff, doff + n):
                counts[dst_base][i] += 1
    return [c for base in sorted(counts) for c in counts[base]]


@pytest.mark.parametrize(("num_heads", "src_tp", "dst_tp"), SPLITS)
def test_every_destination_byte_is_the_sources_written_once(num_heads, src_tp, dst_tp):
    num_blocks = 5
    src, dst = _layout(num_heads, src_tp, num_blocks, 10_000), \
        _layout(num_heads, dst_tp, num_blocks, 500_000)
    src_blocks, dst_blocks = [0, 1, 2, 4], [4, 0, 1, 2]  # a run, then a jump
    writes = plan_writes(src, dst, [b * src.block_nbytes for b in src_blocks],
                         [b * dst.block_nbytes for b in dst_blocks])
    src_regions = _fill(src, num_blocks)
    dst_regions = {base: bytearray(num_blocks * dst.block_nbytes) for base in dst.bases}
    counts = _apply(writes, src, dst, src_regions, dst_regions)
    model = _fill(dst, num_blocks)  # what each destination rank holds of each source block
    size = dst.block_nbytes
    for base in dst.bases:
        for s_block, d_block in zip(src_blocks, dst_blocks, strict=True):
            assert dst_regions[base][d_block * size:(d_block + 1) * size] == \
                model[base][s_block * size:(s_block + 1) * size]
    written = [c for c in counts if c]
    assert written and set(written) == {1}, "a destination byte written more than once"
    assert sum(written) == len(dst_blocks) * dst.block_nbytes * dst_tp


@pytest.mark.parametrize(("num_heads", "src_tp", "dst_tp"), SPLITS)
def test_one_descriptor_per_rank_pair_and_block_runs_merge_when_split_alike(
        num_heads, src_tp, dst_tp):
    src, dst = _layout(num_heads, src_tp, 8, 10_000), _layout(num_heads, dst_tp, 8, 900_000)
    blocks = list(range(6))  # consecutive on both sides
    writes = plan_writes(src, dst, [b * src.block_nbytes for b in blocks],
                         [b * dst.block_nbytes for b in blocks])
    moves = head_moves(num_heads, src_tp, dst_tp)
    whole = all(m.num_heads == len(rank_heads(num_heads, src_tp, m.src_rank))
                == len(rank_heads(num_heads, dst_tp, m.dst_rank)) for m in moves)
    num_descriptors = sum(len(w.src) for w in writes)
    assert num_descriptors == len(moves) * (1 if whole else len(blocks))
    # a head range each destination rank gets from each source rank it overlaps, no more
    assert len({(m.src_rank, m.dst_rank) for m in moves}) == len(moves)


def test_replicated_heads_come_from_their_holders_in_turn():
    # 2 KV heads over 4 source ranks (each head on 2 ranks) to 4 destination ranks: every
    # holder sends, none twice
    moves = head_moves(2, 4, 4)
    assert sorted((m.src_rank, m.dst_rank) for m in moves) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    # MLA's latent (one head) held by 2 ranks, to 4 ranks: one copy per destination rank
    latent = head_moves(1, 2, 4)
    assert [m.dst_rank for m in latent] == [0, 1, 2, 3]
    assert {m.src_rank for m in latent} == {0, 1}


def test_layouts_of_other_models_are_refused():
    a = _layout(4, 2, 4, 10_000)
    with pytest.raises(ValueError, match="KV layout mismatch"):
        plan_writes(a, _layout(8, 2, 4, 90_000), [0], [0])
    wider = GroupLayout(4, 2 * HEAD_NBYTES + 2, ("x",) * 2, (1, 2))
    with pytest.raises(ValueError, match="KV layout mismatch"):
        plan_writes(a, wider, [0], [0])


def test_the_wire_refuses_groups_that_cannot_split():
    def request(group):
        return XferRequest("t", "r", "tcp://127.0.0.1:1", "s", 8, 1, 0, [64], dest_group=group)

    good = KVGroup(4, ["a", "b"], [64, 128])
    assert decode(encode(request(good))).dest_group == good
    for bad in (KVGroup(3, ["a", "b"], [64, 128]), KVGroup(2, ["a", "b", "c"], [1, 2, 3]),
                KVGroup(4, ["a", "b"], [64]), KVGroup(4, [], [])):
        with pytest.raises(WireError, match="dest_group"):
            decode(encode(request(bad)))

