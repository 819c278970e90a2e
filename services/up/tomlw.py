"""Write the resolved run config as TOML for the services: tables of scalars and lists, and
nested tables (``[trainer.objective]``) written as sub-tables after their parent's own keys."""

from __future__ import annotations

import json
import re
from typing import Any

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if _BARE_KEY.match(k) else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _table(path: str, table: dict[str, Any], out: list[str]) -> None:
    out.append(f"[{path}]")
    out.extend(f"{_key(k)} = {_value(v)}" for k, v in table.items() if not isinstance(v, dict))
    out.append("")
    for k, v in table.items():
        if isinstance(v, dict):
            _table(f"{path}.{_key(k)}", v, out)


def dumps(tables: dict[str, dict[str, Any]]) -> str:
    out: list[str] = []
    for name, table in tables.items():
        _table(_key(name), table, out)
    return "\n".join(out)
