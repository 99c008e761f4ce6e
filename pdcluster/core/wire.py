"""The one msgpack codec for the project's typed, versioned wire messages (torch-free).

A frame is `{"v": version, "type": class name, "body": fields}`. `decode` checks the envelope,
the version, that the type is one of the protocol's message classes, and every field against
the class's type hints (nested dataclasses, lists, maps, `X | None`; bool is never an int, an int is
accepted for a float). Anything else raises `WireError`. Never pickle. Protocols
(`core.kv_transfer`, `core.node_wire`) are a `Protocol(version, classes, max_bytes)`.
"""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import MISSING, dataclass, fields
from typing import Any

import msgpack


class WireError(ValueError):
    """A message that cannot be accepted (malformed, unknown, wrong version or oversize)."""


@dataclass(frozen=True)
class Protocol:
    version: int
    classes: tuple[type, ...]
    max_bytes: int

    def encode(self, msg: object) -> bytes:
        try:
            data = msgpack.packb({"v": self.version, "type": type(msg).__name__,
                                  "body": _fields(msg)}, default=_fields)
        except (TypeError, ValueError) as exc:  # e.g. a numpy scalar in a field
            raise WireError(f"cannot encode {type(msg).__name__}: {exc}") from exc
        if len(data) > self.max_bytes:
            raise WireError(f"{type(msg).__name__} of {len(data)} bytes exceeds {self.max_bytes}")
        return data

    def decode(self, data: bytes) -> Any:
        if len(data) > self.max_bytes:
            raise WireError(f"message of {len(data)} bytes exceeds {self.max_bytes}")
        try:
            # int map keys are allowed (token id -> bias); every key is checked by `_value`
            envelope = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            raise WireError(f"not msgpack: {exc}") from exc
        if not isinstance(envelope, dict) or envelope.keys() != {"v", "type", "body"}:
            raise WireError("expected a {v, type, body} envelope")
        if envelope["v"] != self.version:
            raise WireError(f"unsupported wire version {envelope['v']!r}")
        by_name = {cls.__name__: cls for cls in self.classes}
        cls = by_name.get(envelope["type"]) if isinstance(envelope["type"], str) else None
        if cls is None:
            raise WireError(f"unknown message type {envelope['type']!r}")
        return build(cls, envelope["body"], cls.__name__)


def _fields(obj: object) -> dict[str, Any]:
    """A dataclass as the map of its fields, shallow: msgpack calls this again (`default`)
    for nested dataclasses. (`dataclasses.asdict` deep-copies every list element: 100x
    slower on a prompt of token ids.)"""
    names = getattr(type(obj), "__dataclass_fields__", None)
    if names is None:
        raise TypeError(f"{type(obj).__name__} is not a wire type")
    return {name: getattr(obj, name) for name in names}


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], frozenset[str], frozenset[str]]:
    """(type hints, field names, required names) of a message class, resolved once."""
    return (typing.get_type_hints(cls), frozenset(f.name for f in fields(cls)),
            frozenset(f.name for f in fields(cls)
                      if f.default is MISSING and f.default_factory is MISSING))


def build(cls: type, body: object, where: str) -> Any:
    """A dataclass instance from a decoded map, every field checked against its type hint."""
    if not isinstance(body, dict):
        raise WireError(f"{where} must be a map")
    hints, names, required = _schema(cls)
    if not body.keys() <= names or not required <= body.keys():
        raise WireError(f"{where} fields {sorted(body)} do not match {sorted(names)}")
    return cls(**{k: _value(hints[k], v, f"{where}.{k}") for k, v in body.items()})


def _value(hint: Any, value: Any, where: str) -> Any:
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _value(inner, value, where)
    if typing.get_origin(hint) is list:
        if not isinstance(value, list):
            raise WireError(f"{where} must be a list")
        if args[0] in (int, str, bytes) and all(type(v) is args[0] for v in value):
            return value  # the common case (token ids), checked in one pass
        return [_value(args[0], v, f"{where}[]") for v in value]
    if typing.get_origin(hint) is dict:
        if not isinstance(value, dict):
            raise WireError(f"{where} must be a map")
        return {_value(args[0], k, f"{where} key"): _value(args[1], v, f"{where}[]")
                for k, v in value.items()}
    if isinstance(hint, type) and hasattr(hint, "__dataclass_fields__"):
        return build(hint, value, where)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise WireError(f"{where} has type {type(value).__name__}, expected {hint.__name__}")
    return value
