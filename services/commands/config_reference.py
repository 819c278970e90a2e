"""The configuration reference of the docs site, generated from the settings classes.

Every key of a run config has one definition: a field of a settings class, with its type, default,
bounds and description.  This renders those fields as the page ``docs/reference/configuration.md``,
so the page cannot drift from what the services accept (tests/unit/test_config_reference.py fails
when the committed page differs from a fresh render; the fix is the command below).

    python -m rlbus.services.commands.config_reference --out docs/reference/configuration.md
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rlbus.services.catalog import SERVICES

HEADER = """# Configuration reference

Generated from the settings classes by
`python -m rlbus.services.commands.config_reference --out docs/reference/configuration.md`;
do not edit by hand. A run config is one TOML file with a table per service; every key is optional
and unknown keys are refused with the name of the table. See [Configuration](../configuration.md)
for how a file is loaded and overridden.
"""


def _tables() -> list[tuple[str, type]]:
    """(table name, settings class) of a run config, in the order a reader meets them."""
    from rlbus.services.runtime.config import RunSettings
    from rlbus.services.up.settings import UpSettings

    out: list[tuple[str, type]] = [("run", RunSettings), ("up", UpSettings)]
    for name, entry in SERVICES.items():
        module, cls = entry.settings.split(":")
        out.append((name, getattr(importlib.import_module(module), cls)))
    return out


def _fields(cls: type) -> dict[str, FieldInfo]:
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return dict(cls.model_fields)
    fields = getattr(cls, "__pydantic_fields__", None)  # a pydantic dataclass
    if fields is None:
        raise TypeError(f"{cls!r} is neither a pydantic model nor a pydantic dataclass")
    return dict(fields)


def _is_table(annotation: Any) -> bool:
    return isinstance(annotation, type) and (issubclass(annotation, BaseModel) or
                                             hasattr(annotation, "__pydantic_fields__"))


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a!r}`".replace("'", '"') for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "none"
    return getattr(annotation, "__name__", str(annotation)).replace("typing.", "")


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value!r}`".replace("'", '"')


def _bounds(info: FieldInfo) -> str:
    names = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    found = []
    for meta in info.metadata:
        for attr, sign in names.items():
            if (v := getattr(meta, attr, None)) is not None:
                found.append(f"{sign} {v}")
    return ", ".join(found)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")


def _render_table(path: str, cls: type) -> Iterator[str]:
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    fields = _fields(cls)
    nested = [(k, f) for k, f in fields.items() if _is_table(f.annotation)]
    yield f"## `[{path}]`\n"
    if doc and not doc.startswith(f"{cls.__name__}("):  # a dataclass's generated signature is no doc
        yield _cell(doc) + "\n"
    yield "| key | type | default | bounds | description |"
    yield "|---|---|---|---|---|"
    for key, info in fields.items():
        if _is_table(info.annotation):
            continue
        yield (f"| `{key}` | {_type_name(info.annotation)} | {_default(info)} | {_bounds(info)} | "
               f"{_cell(info.description or '')} |")
    yield ""
    for key, info in nested:
        yield from _render_table(f"{path}.{key}", info.annotation)


def render() -> str:
    lines = [HEADER]
    for name, cls in _tables():
        lines.extend(_render_table(name, cls))
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the configuration reference page of the docs site.")
    parser.add_argument("--out", default="-", help="file to write (default: standard output)")
    args = parser.parse_args(argv)
    text = render()
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
