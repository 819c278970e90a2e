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


_PLAIN = frozenset({int, float, str, bool, bytes, type(None)})


def _encode_value(value: Any) -> Any:
    if type(value) in _PLAIN:  # most values: no conversion, checked first
        return value
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
        for name in _field_names(type(self)):
            out[name] = _encode_value(getattr(self, name))
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
    def _from_wire(cls: type[M], raw: Any, path: Path = "") -> M:
        if not isinstance(raw, dict):
            raise SchemaError(
                "payload is not a map", schema=cls.KIND, version=cls.VERSION, field=_path(path) or "<root>",
                expected="map", got=type(raw).__name__,
            )
        kind = raw.get(_KIND)
        if kind != cls.KIND:
            raise SchemaError(
                "wrong message kind on this subject", schema=cls.KIND, version=cls.VERSION,
                field=_path((path, _KIND)), expected=repr(cls.KIND), got=repr(kind),
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
        ctx = (cls.KIND, version)
        kwargs: dict[str, Any] = {}
        for name, required, tp, check in _plan(cls):
            if name not in raw:
                if required:
                    raise SchemaError(
                        "required field is missing", schema=cls.KIND, version=version, field=_path((path, name)),
                        expected=_type_name(tp), got="nothing",
                    )
                continue
            kwargs[name] = check(raw[name], (path, name) if path else name, ctx)
        try:
            msg = cls(**kwargs)
        except SchemaError:
            raise
        except (TypeError, ValueError) as exc:
            raise SchemaError(str(exc), schema=cls.KIND, version=version, field=_path(path)) from None
        return msg

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Cross-field checks; raise ``SchemaError``.  Run on construction and on decode."""


# A field path is built only when an error names it: decoding a rollout group would otherwise
# format a string per field and per list item of every message.  ``str`` is a top-level field,
# ``(parent, name)`` a nested field, ``(parent, index)`` a list item, ``(parent, (key,))`` a map value.
Path = str | tuple[Any, Any]
Ctx = tuple[str, int]  # (schema kind, version) of the message being decoded
Checker = typing.Callable[[Any, Path, Ctx], Any]


def _path(p: Path) -> str:
    if isinstance(p, str):
        return p
    parent, key = p
    head = _path(parent)
    if isinstance(key, int):
        return f"{head}[{key}]"
    if isinstance(key, tuple):
        return f"{head}[{key[0]!r}]"
    return f"{head}.{key}" if head else key


_NAMES: dict[type, tuple[str, ...]] = {}
_PLANS: dict[type, list[tuple[str, bool, Any, Checker]]] = {}
_CHECKERS: dict[Any, Checker] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    return names


def _plan(cls: type) -> list[tuple[str, bool, Any, Checker]]:
    """Per message class, once: (field, required, type, checker) for every field."""
    plan = _PLANS.get(cls)
    if plan is None:
        hints = typing.get_type_hints(cls, include_extras=True)
        plan = [(f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                 hints[f.name], _checker(hints[f.name]))
                for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        _PLANS[cls] = plan
    return plan


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        spec = typing.get_args(tp)[1]
        return f"array[{spec.dtype}, ndim={spec.ndim}]"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _fail(ctx: Ctx, field: Path, tp: Any, value: Any, why: str = "wrong type") -> SchemaError:
    got = type(value).__name__
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        got += f" {str(value)[:40]!r}"
    return SchemaError(why, schema=ctx[0], version=ctx[1], field=_path(field), expected=_type_name(tp), got=got)


def _checker(tp: Any) -> Checker:
    """The validating converter for one declared type, built once and cached: the type
    introspection happens here, not per value."""
    check = _CHECKERS.get(tp)
    if check is None:
        check = _CHECKERS[tp] = _build_checker(tp)
    return check


def _scalar(tp: type, ok: typing.Callable[[Any], bool], convert: typing.Callable[[Any], Any] | None = None) -> Checker:
    def check(value: Any, field: Path, ctx: Ctx) -> Any:
        if not ok(value):
            raise _fail(ctx, field, tp, value)
        return convert(value) if convert is not None else value
    return check


def _build_checker(tp: Any) -> Checker:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return lambda value, field, ctx: value
    if origin is typing.Annotated:
        spec = args[1]
        return lambda value, field, ctx: _check_array(spec, value, field, ctx)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if all(isinstance(a, type) and issubclass(a, Message) for a in members):
            return _message_union(tp, members, nullable=type(None) in args)
        nullable = type(None) in args
        inner = [_checker(a) for a in args if a is not type(None)]

        def check_union(value: Any, field: Path, ctx: Ctx) -> Any:
            if value is None and nullable:
                return None
            for c in inner:
                try:
                    return c(value, field, ctx)
                except SchemaError:
                    pass
            raise _fail(ctx, field, tp, value)
        return check_union
    if origin is typing.Literal:
        def check_literal(value: Any, field: Path, ctx: Ctx) -> Any:
            if value not in args:
                raise _fail(ctx, field, tp, value, "value not allowed")
            return value
        return check_literal
    if origin in (list, tuple):
        item = _checker(args[0] if args else Any)
        as_tuple = origin is tuple

        def check_seq(value: Any, field: Path, ctx: Ctx) -> Any:
            if not isinstance(value, list):
                raise _fail(ctx, field, tp, value)
            items = [item(v, (field, i), ctx) for i, v in enumerate(value)]
            return tuple(items) if as_tuple else items
        return check_seq
    if origin is dict:
        key_tp, val_tp = args if args else (str, Any)
        check_key, check_val = _checker(key_tp), _checker(val_tp)

        def check_map(value: Any, field: Path, ctx: Ctx) -> Any:
            if not isinstance(value, dict):
                raise _fail(ctx, field, tp, value)
            return {check_key(k, (field, "<key>"), ctx): check_val(v, (field, (k,)), ctx) for k, v in value.items()}
        return check_map
    if isinstance(tp, type) and issubclass(tp, Message):
        return lambda value, field, ctx: tp._from_wire(value, field)
    if tp is bool:
        return _scalar(tp, lambda v: isinstance(v, bool))
    if tp is int:
        return _scalar(tp, lambda v: isinstance(v, int) and not isinstance(v, bool))
    if tp is float:
        return _scalar(tp, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), float)
    if tp is str:
        return _scalar(tp, lambda v: isinstance(v, str))
    if tp is bytes:
        return _scalar(tp, lambda v: isinstance(v, bytes))

    def unsupported(value: Any, field: Path, ctx: Ctx) -> Any:
        raise SchemaError(f"codec does not support type {tp!r}", schema=ctx[0], version=ctx[1], field=_path(field))
    return unsupported


def _message_union(tp: Any, members: list[type[Message]], *, nullable: bool) -> Checker:
    """A union of message types is tagged by each member's ``KIND``: dispatch on it, so an error
    inside the chosen member names its field instead of a bare "none of the types matched"."""
    by_kind = {m.KIND: m for m in members}

    def check_tagged(value: Any, field: Path, ctx: Ctx) -> Any:
        if value is None and nullable:
            return None
        if not isinstance(value, dict):
            raise _fail(ctx, field, tp, value)
        kind = value.get(_KIND)
        member = by_kind.get(kind) if isinstance(kind, str) else None
        if member is None:
            raise SchemaError("unknown message kind in a tagged union", schema=ctx[0], version=ctx[1],
                              field=_path((field, _KIND)), expected=" | ".join(sorted(by_kind)),
                              got=repr(value.get(_KIND)))
        return member._from_wire(value, field)
    return check_tagged


def _check_array(spec: ArraySpec, value: Any, field: Path, ctx: Ctx) -> np.ndarray:
    # Runs for every array of every decoded message: the declared type is spelled out only
    # when an error needs it, and the common case takes as few numpy calls as possible.
    if not isinstance(value, dict) or len(value) != 3 or "dtype" not in value or "shape" not in value \
            or "data" not in value:
        raise _fail(ctx, field, array_field(spec), value, "array must be a map {dtype, shape, data}")
    dtype, shape, data = value["dtype"], value["shape"], value["data"]
    if dtype != spec.dtype:
        raise _fail(ctx, field, array_field(spec), dtype, f"array dtype must be {spec.dtype}")
    if not isinstance(shape, list) or len(shape) != spec.ndim or not all(
            type(s) is int and s >= 0 for s in shape):
        raise _fail(ctx, field, array_field(spec), shape, f"array shape must be {spec.ndim} non-negative ints")
    if not isinstance(data, bytes):
        raise _fail(ctx, field, array_field(spec), data, "array data must be bytes")
    dt = _DTYPES.get(dtype) or _DTYPES.setdefault(dtype, np.dtype(dtype))
    count = shape[0] if spec.ndim == 1 else math.prod(shape)
    if count * dt.itemsize != len(data):
        raise SchemaError(
            "array byte length does not match dtype x shape", schema=ctx[0], version=ctx[1], field=_path(field),
            expected=f"{count * dt.itemsize} bytes", got=f"{len(data)} bytes",
        )
    # Zero-copy view over the bytes msgpack handed us (read-only, as it should be).
    try:
        arr = np.frombuffer(data, dtype=dt)
        if spec.ndim != 1:
            arr = arr.reshape(shape)
    except ValueError as exc:  # e.g. a zero-size shape whose other dimensions overflow numpy
        raise _fail(ctx, field, array_field(spec), shape, f"array shape is not representable ({exc})") from None
    # A NaN or inf anywhere makes the sum non-finite; only then (or on float overflow of a
    # finite sum) is the element-wise test needed to name the index.
    if spec.finite and dt.kind == "f" and count and not math.isfinite(float(arr.sum(dtype=np.float64))) \
            and not np.isfinite(arr).all():
        bad = int(np.flatnonzero(~np.isfinite(arr.reshape(-1)))[0])
        raise SchemaError(
            f"array holds a non-finite value at flat index {bad}; the producer computed NaN/inf",
            schema=ctx[0], version=ctx[1], field=_path(field), expected="finite floats", got=str(arr.reshape(-1)[bad]),
        )
    return arr


_DTYPES: dict[str, np.dtype[Any]] = {}


def invalid(msg: Message, field: str, why: str, *, expected: str = "", got: str = "") -> SchemaError:
    """A cross-field validation failure of an already-typed message."""
    return SchemaError(why, schema=msg.KIND, version=msg.VERSION, field=field, expected=expected, got=got)
