"""The one msgpack codec for the project's typed, versioned wire messages (torch-free).

A frame is `{"v": version, "type": class name, "body": fields}`. `decode` checks the envelope,
the version, that the type is one of the protocol's message classes, and every field against
the class's type hints (nested dataclasses, lists, maps, `X | None`; bool is never an int, an int is
accepted for a float). Anything else raises `WireError`. Never pickle. Protocols
(`core.kv_transfer`, `core.node_wire`) are a `Protocol(version, classes, max_bytes)`.

Limits in bytes, from the schema: every `str`, `bytes`, list and map field of a message class
carries its own cap (`Annotated[str, MaxLen(256)]`; a class with an uncapped one is refused
when the protocol is built). The protocol derives msgpack's `max_str_len`, `max_bin_len`,
`max_array_len` and `max_map_len` from those caps and a bound on the number of containers
(lists and maps) a message of its schema can hold, and the unpacker stops at the first value
past any of them, before it allocates it: a frame of nested empty lists (56 bytes of Python
per wire byte) costs no more than the schema allows. Each field's own cap is checked again on
the decoded value, and `encode` checks them too, so a sender learns of an oversize field from
its own `WireError`, not from a peer that silently drops the frame.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, field, fields
from typing import Annotated, Any

import msgpack


class WireError(ValueError):
    """A message that cannot be accepted (malformed, unknown, wrong version or oversize)."""


@dataclass(frozen=True, slots=True)
class MaxLen:
    """The most items (characters of a `str`, bytes, list or map entries) a field may hold."""

    n: int


_ENVELOPE_KEY_CHARS = 64  # "v", "type", "body", field names, class names
_SCALARS = (int, float, bool, type(None))


@dataclass(frozen=True)
class Protocol:
    version: int
    classes: tuple[type, ...]
    max_bytes: int
    _limits: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_limits", _limits(self.classes))

    def encode(self, msg: object) -> bytes:
        if type(msg) not in self.classes:
            raise WireError(f"{type(msg).__name__} is not a message of this protocol")
        _check_caps(msg, type(msg).__name__)
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
        limits = self._limits
        budget = _ContainerBudget(limits["containers"])
        try:
            # int map keys are allowed (token id -> bias); every key is checked by its field's check
            envelope = msgpack.unpackb(
                data, raw=False, strict_map_key=False, max_str_len=limits["str"],
                max_bin_len=limits["bin"], max_array_len=limits["array"],
                max_map_len=limits["map"], max_ext_len=0, list_hook=budget.take,
                object_hook=budget.take)
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            raise WireError(f"not msgpack within this protocol's limits: {exc}") from exc
        if not isinstance(envelope, dict) or envelope.keys() != {"v", "type", "body"}:
            raise WireError("expected a {v, type, body} envelope")
        if envelope["v"] != self.version:
            raise WireError(f"unsupported wire version {envelope['v']!r}")
        by_name = {cls.__name__: cls for cls in self.classes}
        cls = by_name.get(envelope["type"]) if isinstance(envelope["type"], str) else None
        if cls is None:
            raise WireError(f"unknown message type {envelope['type']!r}")
        return build(cls, envelope["body"], cls.__name__)


class _ContainerBudget:
    """Counts the lists and maps msgpack builds for one frame and stops it past the bound
    its schema allows (msgpack calls `take` with each container as it completes it)."""

    __slots__ = ("left",)

    def __init__(self, limit: int) -> None:
        self.left = limit

    def take(self, container: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise ValueError("more lists and maps than any message of this protocol holds")
        return container


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
    return (typing.get_type_hints(cls, include_extras=True),
            frozenset(f.name for f in fields(cls)),
            frozenset(f.name for f in fields(cls)
                      if f.default is MISSING and f.default_factory is MISSING))


def build(cls: type, body: object, where: str) -> Any:
    """A dataclass instance from a decoded map, every field checked against its type hint."""
    if not isinstance(body, dict):
        raise WireError(f"{where} must be a map")
    _, names, required = _schema(cls)
    if not body.keys() <= names or not required <= body.keys():
        raise WireError(f"{where} fields {sorted(body)} do not match {sorted(names)}")
    checks = _field_checks(cls)
    return cls(**{k: checks[k](v, f"{where}.{k}") for k, v in body.items()})


Check = Callable[[Any, str], Any]


@functools.cache
def _field_checks(cls: type) -> dict[str, Check]:
    hints, _, _ = _schema(cls)
    return {name: _check_for(hint) for name, hint in hints.items()}


@functools.cache
def _check_for(hint: Any) -> Check:
    """The function that checks (and returns) a decoded value of `hint`, built once per hint
    so that decoding a message walks no type hints."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return _capped(_check_for(args[0]), _cap_of(hint))
    if origin in (types.UnionType, typing.Union):
        (inner,) = [a for a in args if a is not type(None)]
        return _optional(_check_for(inner))
    if origin is list:
        return _list_of(args[0])
    if origin is dict:
        return _map_of(_check_for(args[0]), _check_for(args[1]))
    if isinstance(hint, type) and hasattr(hint, "__dataclass_fields__"):
        return lambda value, where: build(hint, value, where)
    if hint is float:
        return _float
    return _scalar(hint)


def _capped(inner: Check, cap: int | None) -> Check:
    if cap is None:
        return inner

    def check(value: Any, where: str) -> Any:
        if isinstance(value, str | bytes | list | dict) and len(value) > cap:
            raise WireError(f"{where} holds {len(value)} items, more than its cap of {cap}")
        return inner(value, where)
    return check


def _optional(inner: Check) -> Check:
    return lambda value, where: None if value is None else inner(value, where)


def _list_of(item: Any) -> Check:
    check_item = _check_for(item)
    fast = item if item in (int, str, bytes) else None

    def check(value: Any, where: str) -> Any:
        if not isinstance(value, list):
            raise WireError(f"{where} must be a list")
        if fast is not None and all(type(v) is fast for v in value):
            return value  # the common case (token ids), checked in one pass
        return [check_item(v, f"{where}[]") for v in value]
    return check


def _map_of(check_key: Check, check_value: Check) -> Check:
    def check(value: Any, where: str) -> Any:
        if not isinstance(value, dict):
            raise WireError(f"{where} must be a map")
        return {check_key(k, f"{where} key"): check_value(v, f"{where}[]")
                for k, v in value.items()}
    return check


def _float(value: Any, where: str) -> Any:
    if isinstance(value, float):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    raise WireError(f"{where} has type {type(value).__name__}, expected float")


def _scalar(hint: type) -> Check:
    def check(value: Any, where: str) -> Any:
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise WireError(f"{where} has type {type(value).__name__}, expected "
                            f"{hint.__name__}")
        return value
    return check


# ---- caps -----------------------------------------------------------------------------


def _cap_of(hint: Any) -> int | None:
    caps = [m.n for m in getattr(hint, "__metadata__", ()) if isinstance(m, MaxLen)]
    return caps[0] if caps else None


def _check_caps(obj: Any, where: str) -> None:
    """Every capped field of `obj` (and of the dataclasses inside it) within its cap."""
    cls: type = type(obj)
    for name, check in _cap_checks(cls):
        check(getattr(obj, name), f"{where}.{name}")


@functools.cache
def _cap_checks(cls: type) -> list[tuple[str, Check]]:
    hints, _, _ = _schema(cls)
    checks = [(name, _cap_check_for(hint)) for name, hint in hints.items()]
    return [(name, check) for name, check in checks if check is not None]


def _cap_check_for(hint: Any) -> Check | None:
    """What `encode` checks of a value of `hint`: its caps, and those of what it holds."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        inner = _cap_check_for(args[0])
        cap = _cap_of(hint)

        def check(value: Any, where: str) -> None:
            if not isinstance(value, str | bytes | list | dict):
                return  # a wrong type is the receiver's to refuse, with the field's name
            if cap is not None and len(value) > cap:
                raise WireError(f"{where} holds {len(value)} items, more than its cap of {cap}")
            if inner is not None:
                inner(value, where)
        return check
    if origin in (types.UnionType, typing.Union):
        checks = [c for a in args if a is not type(None)
                  if (c := _cap_check_for(a)) is not None]
        return checks[0] if checks else None
    if origin is list and _is_container(args[0]):
        item = _cap_check_for(args[0])
        if item is None:
            return None
        return lambda value, where: [item(v, f"{where}[]") for v in value] and None
    if isinstance(hint, type) and hasattr(hint, "__dataclass_fields__"):
        return lambda value, where: None if value is None else _check_caps(value, where)
    return None


def _is_container(hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is Annotated:
        return _is_container(typing.get_args(hint)[0])
    if origin in (types.UnionType, typing.Union):
        return any(_is_container(a) for a in typing.get_args(hint) if a is not type(None))
    return origin in (list, dict) or (isinstance(hint, type)
                                      and hasattr(hint, "__dataclass_fields__"))


def _limits(classes: tuple[type, ...]) -> dict[str, int]:
    """msgpack's limits for a protocol: the largest cap of each kind over every field of every
    class, and the most containers one message can hold (its envelope included)."""
    limits = {"str": _ENVELOPE_KEY_CHARS, "bin": 1, "array": 1, "map": 3}
    containers = 0
    for cls in classes:
        for kind, cap in _caps_in(cls, cls.__name__):
            limits[kind] = max(limits[kind], cap)
        containers = max(containers, _num_containers(cls))
    limits["str"] *= 4  # msgpack counts UTF-8 bytes; a character is at most 4
    limits["containers"] = containers + 1
    return limits


def _caps_in(cls: type, where: str) -> Iterator[tuple[str, int]]:
    hints, _, _ = _schema(cls)
    yield "map", len(hints)
    for name, hint in hints.items():
        yield from _hint_caps(hint, f"{where}.{name}")


def _hint_caps(hint: Any, where: str, cap: int | None = None) -> Iterator[tuple[str, int]]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        yield from _hint_caps(args[0], where, _cap_of(hint))
    elif origin in (types.UnionType, typing.Union):
        for arg in args:
            if arg is not type(None):
                yield from _hint_caps(arg, where, cap)
    elif hint in _SCALARS:
        return
    elif isinstance(hint, type) and hasattr(hint, "__dataclass_fields__"):
        yield from _caps_in(hint, where)
    elif cap is None:
        raise TypeError(f"{where}: a {getattr(hint, '__name__', hint)} field on the wire needs "
                        "a cap (Annotated[..., MaxLen(n)])")
    elif hint is str or hint is bytes:
        yield ("str" if hint is str else "bin"), cap
    elif origin is list:
        yield "array", cap
        yield from _hint_caps(args[0], f"{where}[]")
    elif origin is dict:
        yield "map", cap
        yield from _hint_caps(args[0], f"{where} key")
        yield from _hint_caps(args[1], f"{where}[]")
    else:
        raise TypeError(f"{where}: {hint!r} cannot go on the wire")


def _num_containers(hint: Any) -> int:
    """The most lists and maps a value of `hint` can hold, itself included."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        inner = args[0]
        if typing.get_origin(inner) is list:
            return 1 + (_cap_of(hint) or 0) * _num_containers(typing.get_args(inner)[0])
        if typing.get_origin(inner) is dict:
            return 1 + (_cap_of(hint) or 0) * _num_containers(typing.get_args(inner)[1])
        return _num_containers(inner)
    if origin in (types.UnionType, typing.Union):
        return max(_num_containers(a) for a in args)
    if isinstance(hint, type) and hasattr(hint, "__dataclass_fields__"):
        hints, _, _ = _schema(hint)
        return 1 + sum(_num_containers(h) for h in hints.values())
    return 0
