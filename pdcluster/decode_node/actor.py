"""The decode node's Ray entry point: `node.actor.NodeActor` with the decode role. It holds
no behaviour of its own; the launcher applies `ray.remote`."""

from __future__ import annotations

from pdcluster.core.roles import Role
from pdcluster.node.actor import NodeActor


class DecodeNodeActor(NodeActor):
    role = Role.DECODE
