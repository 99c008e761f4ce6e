"""Binding a metadata client certificate's role to the principals its calls may name.

Under mTLS each workload kind holds its own client certificate, its role in the subject's
common name: ``pdcluster-router`` (the router), ``pdcluster-node`` (the Ray pods, whose node
actors register), ``pdcluster-operator`` (an operator's tools). A per-pod certificate may add
``.<anything>`` (``pdcluster-node.pd-ray-decode-7x2k``): the role is the part before the dot.
With binding on (``MetadataConfig.tls_bind_client_roles``) a call's token must name a
principal its certificate's role may present, so a token stolen from one kind of pod is
refused over another kind's certificate, and a certificate without a role is refused:

    router   -> ``service``
    node     -> ``node/<id>`` (any id: which id is the token's business, server.py checks it)
    operator -> ``operator``, ``service``

API: ``ROLE_PRINCIPALS``, ``certificate_role(common_name)``, ``may_present(role, principal)``,
``peer_role(context)``, ``refusal(role, principal)``.
"""

from __future__ import annotations

from typing import Any

from pdcluster.core.credentials import NODE_PREFIX, OPERATOR, SERVICE

CN_PREFIX = "pdcluster-"
ROLE_PRINCIPALS: dict[str, tuple[str, ...]] = {
    "router": (SERVICE,),
    "node": (NODE_PREFIX,),  # a prefix: node/<any id>
    "operator": (OPERATOR, SERVICE),
}


def certificate_role(common_name: str | None) -> str | None:
    """The role a certificate's common name states, or None (no pdcluster role)."""
    if not common_name or not common_name.startswith(CN_PREFIX):
        return None
    role = common_name[len(CN_PREFIX):].split(".", 1)[0]
    return role if role in ROLE_PRINCIPALS else None


def may_present(role: str | None, principal: str) -> bool:
    if role is None:
        return False
    allowed = ROLE_PRINCIPALS[role]
    if NODE_PREFIX in allowed and principal.startswith(NODE_PREFIX):
        return len(principal) > len(NODE_PREFIX)
    return principal in allowed


def peer_role(context: Any) -> tuple[str | None, str | None]:
    """(role, common name) of the client certificate on a call's connection (None, None
    without one)."""
    values = (context.auth_context() or {}).get("x509_common_name") or []
    if not values:
        return None, None
    common_name = values[0].decode(errors="replace") if isinstance(values[0], bytes) \
        else str(values[0])
    return certificate_role(common_name), common_name


def refusal(common_name: str | None, role: str | None, principal: str) -> str:
    if role is None:
        return (f"client certificate {common_name!r} names no pdcluster role (its common "
                f"name must be {CN_PREFIX}router, {CN_PREFIX}node or {CN_PREFIX}operator, "
                "optionally followed by '.<pod>')")
    return (f"principal {principal!r} may not call over a {role!r} certificate "
            f"({common_name!r}): a token is bound to its own kind of pod")
