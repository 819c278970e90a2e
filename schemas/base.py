"""The wire codec: typed dataclasses <-> msgpack, validated on the way in.

Why a small codec of our own instead of pickle or a generic model library:
- the wire must be language-neutral and safe to decode from anyone (never pickle);
- numeric arrays must cross as raw little-endian bytes + dtype + shape so a 1 MiB rollout
  decodes with one copy and ``np.frombuffer`` views, not a Python list per token;
- every decode failure must be one ``SchemaError`` naming the message, schema version, field,
  expected type and what was found, so a dead letter explains itself.

Evolution rule: fields are append-only and every new field has a default.  A decoder ignores
fields it does not know (a newer producer) and fills defaults for missing ones (an older
producer).  A message whose schema version is newer than this code understands is refused.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import msgpack
import numpy as np

M = TypeVar("M", bound="Message")

# Header keys of the encoded map.  Short because they ride on every message.
_KIND = "$k"
_VERSION = "$v"


class SchemaError(ValueError):
    """A payload does not decode into the expected message.  Fields say exactly why."""

    def __init__(
        self, message: str, *, schema: str = "?", version: int = 0, field: str = "", expected: str = "",
        got: str = "",
    ) -> None:
        self.schema = schema
        self.version = version
        self.field = field
        self.expected = expected
        self.got = got
        where = f"{schema} v{version}" + (f" field '{field}'" if field else "")
        detail = f"{where}: {message}"
        if expected:
            detail += f" (expected {expected}, got {got})"
        super().__init__(detail)


@dataclass(frozen=True)
class ArraySpec:
    """Declares an array field: allowed dtype (numpy str, little-endian) and ndim."""

    dtype: str
    ndim: int = 1
    finite: bool = False  # NaN/inf rejected at decode (e.g. logprobs)


Array = np.ndarray


def array_field(spec: ArraySpec) -> Any:
    """Annotated marker used as ``x: Annotated[np.ndarray, ArraySpec(...)]``."""
    return typing.Annotated[np.ndarray, spec]


def _encode_value(value: Any) -> Any:
    if isinstance(value, Message):
        return value._to_wire()
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        return {"dtype": arr.dtype.str, "shape": list(arr.shape), "data": arr.tobytes()}
    if isinstance(value, (list, tuple)):
        return [_encode_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode_value(v) for k, v in value.items()}
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    return value


class Message:
    """Base of every wire message.  Subclasses are frozen dataclasses with ``KIND``/``VERSION``."""

    KIND: ClassVar[str]
    VERSION: ClassVar[int] = 1

    # --- encode ---------------------------------------------------------------------
    def _to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {_KIND: self.KIND, _VERSION: self.VERSION}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            out[f.name] = _encode_value(getattr(self, f.name))
        return out

    def encode(self) -> bytes:
        return msgpack.packb(self._to_wire(), use_bin_type=True)

    # --- decode ---------------------------------------------------------------------
    @classmethod
    def decode(cls: type[M], data: bytes | memoryview) -> M:
        try:
            raw = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise SchemaError(
                f"payload is not valid msgpack ({type(exc).__name__}: {exc}); "
                "publish with the encoder in schemas/",
                schema=cls.KIND, version=cls.VERSION,
            ) from None
        return cls._from_wire(raw)

    @classmethod
    def _from_wire(cls: type[M], raw: Any, path: str = "") -> M:
        if not isinstance(raw, dict):
            raise SchemaError(
                "payload is not a map", schema=cls.KIND, version=cls.VERSION, field=path or "<root>",
                expected="map", got=type(raw).__name__,
            )
        kind = raw.get(_KIND)
        if kind != cls.KIND:
            raise SchemaError(
                "wrong message kind on this subject", schema=cls.KIND, version=cls.VERSION,
                field=(path + "." if path else "") + _KIND, expected=repr(cls.KIND), got=repr(kind),
            )
        version = raw.get(_VERSION)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise SchemaError(
                "missing or invalid schema version", schema=cls.KIND, version=cls.VERSION,
                field=_KIND.replace("k", "v"), expected="int >= 1", got=repr(version),
            )
        if version > cls.VERSION:
            raise SchemaError(
                f"schema version {version} is newer than this build understands; upgrade rlbus "
                "on this service", schema=cls.KIND, version=cls.VERSION, field="$v",
                expected=f"<= {cls.VERSION}", got=str(version),
            )
        hints = _hints(cls)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            name = (path + "." if path else "") + f.name
            if f.name not in raw:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise SchemaError(
                        "required field is missing", schema=cls.KIND, version=version, field=name,
                        expected=_type_name(hints[f.name]), got="nothing",
                    )
                continue
            kwargs[f.name] = _check(hints[f.name], raw[f.name], name, cls.KIND, version)
        try:
            msg = cls(**kwargs)
        except SchemaError:
            raise
        except (TypeError, ValueError) as exc:
            raise SchemaError(str(exc), schema=cls.KIND, version=version, field=path) from None
        return msg

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Cross-field checks; raise ``SchemaError``.  Run on construction and on decode."""


_HINT_CACHE: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINT_CACHE.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls, include_extras=True)
        _HINT_CACHE[cls] = hints
    return hints


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        spec = typing.get_args(tp)[1]
        return f"array[{spec.dtype}, ndim={spec.ndim}]"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _fail(schema: str, version: int, field: str, tp: Any, value: Any, why: str = "wrong type") -> SchemaError:
    got = type(value).__name__
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        got += f" {str(value)[:40]!r}"
    return SchemaError(why, schema=schema, version=version, field=field, expected=_type_name(tp), got=got)


def _check(tp: Any, value: Any, field: str, schema: str, version: int) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is typing.Annotated:
        return _check_array(args[1], value, field, schema, version)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for a in inner:
            try:
                return _check(a, value, field, schema, version)
            except SchemaError as exc:
                errors.append(exc)
        raise _fail(schema, version, field, tp, value)
    if origin is typing.Literal:
        if value not in args:
            raise _fail(schema, version, field, tp, value, "value not allowed")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise _fail(schema, version, field, tp, value)
        item_tp = args[0] if args else Any
        items = [_check(item_tp, v, f"{field}[{i}]", schema, version) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise _fail(schema, version, field, tp, value)
        key_tp, val_tp = args if args else (str, Any)
        return {
            _check(key_tp, k, f"{field}.<key>", schema, version): _check(val_tp, v, f"{field}[{k!r}]", schema, version)
            for k, v in value.items()
        }
    if isinstance(tp, type) and issubclass(tp, Message):
        return tp._from_wire(value, field)
    if tp is bool:
        if not isinstance(value, bool):
            raise _fail(schema, version, field, tp, value)
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _fail(schema, version, field, tp, value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(schema, version, field, tp, value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _fail(schema, version, field, tp, value)
        return value
    if tp is bytes:
        if not isinstance(value, bytes):
            raise _fail(schema, version, field, tp, value)
        return value
    raise SchemaError(f"codec does not support type {tp!r}", schema=schema, version=version, field=field)


def _check_array(spec: ArraySpec, value: Any, field: str, schema: str, version: int) -> np.ndarray:
    tp = typing.Annotated[np.ndarray, spec]
    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data"}:
        raise _fail(schema, version, field, tp, value, "array must be a map {dtype, shape, data}")
    dtype, shape, data = value["dtype"], value["shape"], value["data"]
    if dtype != spec.dtype:
        raise _fail(schema, version, field, tp, dtype, f"array dtype must be {spec.dtype}")
    if (
        not isinstance(shape, list) or len(shape) != spec.ndim
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
    ):
        raise _fail(schema, version, field, tp, shape, f"array shape must be {spec.ndim} non-negative ints")
    if not isinstance(data, bytes):
        raise _fail(schema, version, field, tp, data, "array data must be bytes")
    dt = np.dtype(dtype)
    count = math.prod(shape)
    if count * dt.itemsize != len(data):
        raise SchemaError(
            "array byte length does not match dtype x shape", schema=schema, version=version, field=field,
            expected=f"{count * dt.itemsize} bytes", got=f"{len(data)} bytes",
        )
    # Zero-copy view over the bytes msgpack handed us (read-only, as it should be).
    try:
        arr = np.frombuffer(data, dtype=dt).reshape(shape)
    except ValueError as exc:  # e.g. a zero-size shape whose other dimensions overflow numpy
        raise _fail(schema, version, field, tp, shape, f"array shape is not representable ({exc})") from None
    if spec.finite and dt.kind == "f" and arr.size and not np.isfinite(arr).all():
        bad = int(np.flatnonzero(~np.isfinite(arr.reshape(-1)))[0])
        raise SchemaError(
            f"array holds a non-finite value at flat index {bad}; the producer computed NaN/inf",
            schema=schema, version=version, field=field, expected="finite floats", got=str(arr.reshape(-1)[bad]),
        )
    return arr


def invalid(msg: Message, field: str, why: str, *, expected: str = "", got: str = "") -> SchemaError:
    """A cross-field validation failure of an already-typed message."""
    return SchemaError(why, schema=msg.KIND, version=msg.VERSION, field=field, expected=expected, got=got)
