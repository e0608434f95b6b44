"""Wire codec for Raft messages: msgpack arrays driven by the dataclasses' type hints (pure).

A message is encoded as `[type name, field, field, ...]`. Field kinds come from the
type hints of the dataclasses in `dledger.messages`, so a new message type needs no
change here: an enum field travels as its value, a nested dataclass (Entry) as its
field array, and `tuple[Entry, ...]` as an array of those. Nested values are plain
arrays, not ext types, because the per-entry cost of Append decides throughput.

Decoding rebuilds each dataclass through its own __post_init__ validation; anything
that does not decode to a registered message raises `CodecError`.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any, Callable

import msgpack

from dledger import messages as M


class CodecError(ValueError):
    """A frame payload is not a valid message. The fault is remote (the sender)."""

    retriable = False
    local = False


Encoder = Callable[[Any], Any]
Decoder = Callable[[Any], Any]


def _identity(v: Any) -> Any:
    return v


def _enum_codec(cls: type[enum.Enum]) -> tuple[Encoder, Decoder]:
    by_value = {m.value: m for m in cls}

    def dec(v: Any) -> Any:
        try:
            return by_value[v]
        except (KeyError, TypeError):
            raise CodecError(f"{v!r} is not a {cls.__name__}") from None
    return (lambda m: m.value), dec


def _field_codec(hint: Any) -> tuple[Encoder, Decoder] | None:
    """Codec for one field type; None when msgpack carries it as is."""
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum_codec(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass_codec(hint)
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            inner = _field_codec(args[0])
            if inner is not None:
                enc, dec = inner
                return (lambda t: [enc(x) for x in t]), (lambda t: tuple(dec(x) for x in _seq(t)))
    return None


def _seq(v: Any) -> tuple:
    if not isinstance(v, tuple):
        raise CodecError(f"expected an array, got {type(v).__name__}")
    return v


_CACHE: dict[type, tuple[Encoder, Decoder]] = {}


def _dataclass_codec(cls: type) -> tuple[Encoder, Decoder]:
    """(obj -> field array, field array -> obj) for a dataclass."""
    if cls in _CACHE:
        return _CACHE[cls]
    hints = typing.get_type_hints(cls, vars(M))
    names = tuple(f.name for f in dataclasses.fields(cls))
    codecs = [_field_codec(hints[n]) for n in names]
    if all(c is None for c in codecs):
        def enc(obj: Any) -> list:
            return [getattr(obj, n) for n in names]

        def dec(arr: Any) -> Any:
            if len(_seq(arr)) != len(names):
                raise CodecError(f"{cls.__name__} needs {len(names)} fields, got {len(arr)}")
            return cls(*arr)
    else:
        encs = [c[0] if c else _identity for c in codecs]
        decs = [c[1] if c else _identity for c in codecs]
        pairs = tuple(zip(names, encs))

        def enc(obj: Any) -> list:
            return [e(getattr(obj, n)) for n, e in pairs]

        def dec(arr: Any) -> Any:
            if len(_seq(arr)) != len(decs):
                raise CodecError(f"{cls.__name__} needs {len(decs)} fields, got {len(arr)}")
            return cls(*[d(v) for d, v in zip(decs, arr)])
    _CACHE[cls] = (enc, dec)
    return enc, dec


def _build_registry() -> dict[str, tuple[type, Encoder, Decoder]]:
    registry: dict[str, tuple[type, Encoder, Decoder]] = {}
    for name, obj in vars(M).items():
        if isinstance(obj, type) and dataclasses.is_dataclass(obj):
            enc, dec = _dataclass_codec(obj)
            registry[name] = (obj, enc, dec)
    return registry


_BY_NAME = _build_registry()
_BY_TYPE = {cls: (name, enc) for name, (cls, enc, _dec) in _BY_NAME.items()}


def encode(msg: object) -> bytes:
    """The payload of one frame."""
    try:
        name, enc = _BY_TYPE[type(msg)]
    except KeyError:
        raise TypeError(f"not a registered message: {type(msg).__name__}") from None
    arr = enc(msg)
    arr.insert(0, name)
    return msgpack.packb(arr, use_bin_type=True)


def decode(payload: bytes) -> object:
    """The message in a frame payload; raises CodecError if it is not one."""
    try:
        arr = msgpack.unpackb(payload, raw=False, use_list=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as e:
        raise CodecError(f"undecodable payload: {e}") from e
    if not isinstance(arr, tuple) or not arr or not isinstance(arr[0], str):
        raise CodecError("payload is not [type, fields...]")
    entry = _BY_NAME.get(arr[0])
    if entry is None:
        raise CodecError(f"unknown message type {arr[0]!r}")
    try:
        return entry[2](arr[1:])
    except CodecError:
        raise
    except (M.InvalidMessage, ValueError, TypeError) as e:
        raise CodecError(f"invalid {arr[0]}: {e}") from e
