"""How many KV blocks a lower tier (host memory, disk) gets from its configured size, and the
error a size that cannot work gets at start (torch-free). `host_kv_cache.host_tier_blocks` and
`disk_kv_cache.disk_tier_blocks` are this with each tier's option names and room.

API: `tier_blocks`.
"""

from __future__ import annotations

_GIB = 1 << 30


def tier_blocks(tier: str, option: str, gib: float, num_blocks: int | None, block_nbytes: int,
                room: int | None, room_text: str, fix: str) -> int:
    """Blocks of the `tier` (0: none): `num_blocks` if given, else `gib` of blocks. ValueError
    when a non-zero size holds no block, or its bytes exceed `room` (None: not known)."""
    blocks = num_blocks if num_blocks is not None else int(gib * _GIB) // block_nbytes
    if blocks == 0 and (gib > 0 or num_blocks):
        raise ValueError(f"{option}={gib} holds no KV block of {block_nbytes / 2**20:.2f} MiB")
    wanted = blocks * block_nbytes
    if blocks and room is not None and wanted > room:
        raise ValueError(
            f"the {tier} KV tier does not fit: {blocks} blocks are {wanted / _GIB:.2f} GiB "
            f"({option}={gib}) but {room_text.format(room / _GIB)}; {fix}")
    return blocks
