"""`Role`: what a node does in disaggregated serving — the one list of roles every room
checks against (node config, router node specs, the metadata service's registry).

A node runs as `PREFILL` or `DECODE` (`NODE_ROLES`); `BOTH` exists only in the router, for a
node it may send either half to (a static node list, or a registered node of unknown role).
A `StrEnum`, so a role compares equal to, hashes like and prints as its plain string.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


NODE_ROLES = (Role.PREFILL, Role.DECODE)


def role_names(roles: tuple[Role, ...] = tuple(Role)) -> list[str]:
    """The roles' plain names, for error messages."""
    return [r.value for r in roles]
