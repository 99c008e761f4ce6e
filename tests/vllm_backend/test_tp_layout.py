"""vLLM's CPU KV layout between tensor-parallel groups, byte for byte: each rank's per-layer
caches (`[blocks, this rank's KV heads, block size, 2 x head size]`, as vLLM's CPU backend
allocates them) described by `kv_region`, and the writes the connector plans for its group
(transfer/group_writer.py with transfer/head_map.py, one segment per layer, each rank's
segments at its own offsets) applied in this process. Every destination head of every
layer and block must equal the source's copy of that head, each byte written once and into
the memory of the session the plan names; the group (with its per-rank segment offsets)
crosses the wire intact. Fakes: a transport and a rank handle that copy in memory."""

from __future__ import annotations

import ctypes
from concurrent.futures import Future

import pytest
import torch

from pdcluster.core.kv_ranks import KVRanks, RankEndpoint, rank_heads
from pdcluster.core.kv_region import KVRegion
from pdcluster.core.kv_transfer import XferRequest, decode, encode
from pdcluster.transfer.group_writer import Destination, GroupWriter
from pdcluster.transfer.transport import Transport
from pdcluster.vllm_backend.connector_worker import kv_region

BLOCK, HEAD, LAYERS, NUM_BLOCKS = 32, 32, 2, 6
SRC_BLOCKS, DST_BLOCKS = [1, 2, 4], [3, 4, 0]


class MemoryTransport(Transport):
    """Writes by copying within this process; checks each write lands in `session`'s
    memory (`memory`: session -> its tensors)."""

    def __init__(self, session: str, memory: dict[str, list[torch.Tensor]]) -> None:
        self._session, self.memory = session, memory
        self.descriptors = 0

    @property
    def reply_address(self) -> str:
        return f"mem://{self._session}"

    @property
    def session_id(self) -> str:
        return self._session

    def start(self, on_message, authorize=None) -> None:
        return

    def register(self, addr: int, nbytes: int) -> None:
        return

    def send(self, address, msg, on_failure=None) -> None:
        raise AssertionError("no side channel in this test")

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        for s, d, n in zip(src, dst, lengths, strict=True):
            assert any(t.data_ptr() <= d and d + n <= t.data_ptr() + t.nbytes
                       for t in self.memory[session]), f"write outside {session}'s memory"
            ctypes.memmove(d, s, n)
        self.descriptors += len(src)

    def close(self) -> None:
        return


class MemoryRanks(KVRanks):
    def __init__(self, transports: list[MemoryTransport], endpoints: list[RankEndpoint]):
        self._transports, self._endpoints = transports, endpoints

    @property
    def endpoints(self) -> list[RankEndpoint]:
        return self._endpoints

    def write(self, rank, session, src, dst, lengths) -> Future[None]:
        done: Future[None] = Future()
        self._transports[rank].write(session, src, dst, lengths)
        done.set_result(None)
        return done


def _caches(num_heads: int, tp: int, rank: int, fill: bool) -> dict[str, torch.Tensor]:
    """Rank `rank`'s layers, filled with values naming (layer, block, model head, byte)."""
    heads = rank_heads(num_heads, tp, rank)
    caches = {}
    for layer in (1, 0):  # not in layer order: kv_region sorts them
        cache = torch.zeros(NUM_BLOCKS, len(heads), BLOCK, 2 * HEAD)
        if fill:
            for i, head in enumerate(heads):
                cache[:, i] = _pattern(layer, head)
        caches[f"model.layers.{layer}.self_attn.attn"] = cache
    return caches


def _pattern(layer: int, head: int) -> torch.Tensor:
    """[blocks, block size, 2 x head size]: what block b of `head` in `layer` holds."""
    blocks = torch.arange(NUM_BLOCKS).view(-1, 1, 1) * 1000.0
    within = torch.arange(BLOCK * 2 * HEAD).view(1, BLOCK, 2 * HEAD) % 997
    return blocks + within + (layer * 64 + head) * 100_000.0


def _group(num_heads, tp, name, fill, memory):
    """(transports, regions, caches, writer) of a group of `tp` ranks."""
    caches = [_caches(num_heads, tp, r, fill) for r in range(tp)]
    local = len(rank_heads(num_heads, tp, 0))
    regions = [kv_region(c, NUM_BLOCKS, (num_heads, local)) for c in caches]
    transports = [MemoryTransport(f"{name}{r}", memory) for r in range(tp)]
    for r in range(tp):
        memory[f"{name}{r}"] = list(caches[r].values())
    endpoints = [RankEndpoint(t.session_id, g.base_addr, segment_offsets=g.segment_offsets)
                 for t, g in zip(transports[1:], regions[1:], strict=True)]
    ranks = MemoryRanks(transports, endpoints) if tp > 1 else None
    return transports, regions, caches, GroupWriter(transports[0], regions[0], ranks, 5.0)


@pytest.mark.parametrize(("num_heads", "src_tp", "dst_tp"),
                         [(2, 2, 1), (2, 1, 2), (2, 2, 2), (2, 1, 1), (1, 2, 1), (1, 1, 2),
                          (4, 2, 4)])
def test_every_head_of_every_layer_lands_on_the_rank_that_holds_it(num_heads, src_tp,
                                                                   dst_tp) -> None:
    memory: dict[str, list[torch.Tensor]] = {}
    src_transports, _, _, writer = _group(num_heads, src_tp, "P", True, memory)
    _, dst_regions, dst_caches, dst_writer = _group(num_heads, dst_tp, "D", False, memory)
    group = dst_writer.group
    assert group is not None and len(group.segment_offsets) == dst_tp
    request = decode(encode(XferRequest(
        "t", "r", "tcp://127.0.0.1:1", "D0", dst_regions[0].block_nbytes, len(DST_BLOCKS), 0,
        [dst_regions[0].block_addr(b) for b in DST_BLOCKS],
        list(dst_regions[0].segment_offsets), group)))
    assert isinstance(request, XferRequest) and request.dest_group == group
    num_descriptors, nbytes = writer.write(SRC_BLOCKS, request.dest_block_addrs, Destination(
        request.dest_session, request.block_nbytes, request.dest_segment_offsets,
        request.dest_group))
    # every destination byte once: as many bytes as the destination group holds for them
    assert nbytes == len(DST_BLOCKS) * sum(r.block_nbytes * r.num_segments for r in dst_regions)
    assert num_descriptors == sum(t.descriptors for t in src_transports)
    for rank, caches in enumerate(dst_caches):
        for name, cache in caches.items():
            layer = int(name.split(".")[2])
            for i, head in enumerate(rank_heads(num_heads, dst_tp, rank)):
                for src_block, dst_block in zip(SRC_BLOCKS, DST_BLOCKS, strict=True):
                    assert torch.equal(cache[dst_block, i], _pattern(layer, head)[src_block]), \
                        (rank, layer, head, dst_block)
                untouched = sorted(set(range(NUM_BLOCKS)) - set(DST_BLOCKS))
                assert not cache[untouched].any()


def test_the_same_split_moves_runs_of_blocks_as_one_descriptor_per_layer() -> None:
    memory: dict[str, list[torch.Tensor]] = {}
    _, _, _, writer = _group(2, 2, "P", True, memory)
    _, dst_regions, _, dst_writer = _group(2, 2, "D", False, memory)
    num_descriptors, _ = writer.write([1, 2, 3], [dst_regions[0].block_addr(b) for b in (2, 3, 4)],
                                      Destination("D0", dst_regions[0].block_nbytes,
                                                  list(dst_regions[0].segment_offsets),
                                                  dst_writer.group))
    assert num_descriptors == 2 * LAYERS  # one per rank per layer


def _vllm_views(layout_name: str, num_heads: int) -> dict[str, torch.Tensor]:
    """Per-layer caches exactly as vLLM's model runners allocate them (CPU and GPU alike:
    `create_kv_cache_views` over one buffer, strides from the resolved `KVCacheLayout`)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=num_heads, head_size=HEAD,
                             dtype=torch.float32)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, LAYERS, layout)
    names = [f"model.layers.{layer}.self_attn.attn" for layer in range(LAYERS)]
    size = spec.page_size_bytes * NUM_BLOCKS * LAYERS
    views = create_kv_cache_views(
        torch.zeros(size, dtype=torch.int8), spec, NUM_BLOCKS, layout,
        KVCacheTensor(size=size, layers=names, layer_stride=layer_stride,
                      block_stride=block_stride))
    return dict(zip(names, views, strict=True))


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_every_vllm_kv_layout_is_mapped_byte_for_byte_or_refused_by_name(layout) -> None:
    """The layouts vLLM may pick (its GPU backends default to LBNHC, token-major; the
    connector asks for LBHNC): where a block of a layer holds its heads outermost in one run,
    each head of each block lies where the region says; elsewhere kv_region refuses."""
    from pdcluster.vllm_backend.settings import HEAD_OUTERMOST_LAYOUTS

    caches = _vllm_views(layout, 2)
    if layout not in HEAD_OUTERMOST_LAYOUTS:
        with pytest.raises(ValueError, match="needs KV cache layout LBHNC or BLHNC"):
            kv_region(caches, NUM_BLOCKS, (4, 2))
        return
    for name, cache in caches.items():
        for head in range(2):
            cache[:, head] = _pattern(int(name.split(".")[2]), head)
    region = kv_region(caches, NUM_BLOCKS, (4, 2))
    head_nbytes = region.block_nbytes // 2
    for layer in range(LAYERS):
        for block in range(NUM_BLOCKS):
            for head in range(2):
                addr = region.block_addr(block) + region.segment_offsets[layer] \
                    + head * head_nbytes
                run = (ctypes.c_float * (head_nbytes // 4)).from_address(addr)
                assert torch.equal(torch.frombuffer(run, dtype=torch.float32),
                                   _pattern(layer, head)[block].flatten()), (layer, block)


def test_the_connector_asks_vllm_for_the_head_outermost_layout() -> None:
    from types import SimpleNamespace

    from pdcluster.vllm_backend.connector import PdclusterConnector

    def config(use_mla: bool) -> SimpleNamespace:
        return SimpleNamespace(model_config=SimpleNamespace(use_mla=use_mla))

    assert PdclusterConnector.get_required_kvcache_layout(config(False)) == "LBHNC"
    assert PdclusterConnector.get_required_kvcache_layout(config(True)) is None  # one head


def test_a_layer_cache_whose_second_dimension_is_not_the_ranks_heads_is_refused() -> None:
    token_major = {"model.layers.0.attn": torch.zeros(NUM_BLOCKS, BLOCK, 2, HEAD)}
    with pytest.raises(ValueError, match="KV heads outermost"):
        kv_region(token_major, NUM_BLOCKS, (4, 2))


def test_a_group_of_another_layer_count_is_a_layout_mismatch() -> None:
    memory: dict[str, list[torch.Tensor]] = {}
    _, _, _, writer = _group(2, 2, "P", True, memory)
    one_layer = torch.zeros(NUM_BLOCKS, 2, BLOCK, 2 * HEAD)
    region = KVRegion(one_layer.data_ptr(), one_layer.nbytes, one_layer[0].nbytes, NUM_BLOCKS,
                      num_kv_heads=2)
    other = GroupWriter(MemoryTransport("D0", memory), region, None, 5.0)
    with pytest.raises(ValueError, match="layout mismatch"):
        writer.write([1], [region.block_addr(0)], Destination(
            "D0", region.block_nbytes, [0], other.group))
