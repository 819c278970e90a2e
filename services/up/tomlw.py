"""Write the resolved run config as TOML (flat tables of scalars and lists) for the services."""

from __future__ import annotations

import json
from typing import Any


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


def dumps(tables: dict[str, dict[str, Any]]) -> str:
    out = []
    for name, table in tables.items():
        out.append(f"[{name}]")
        out.extend(f"{k} = {_value(v)}" for k, v in table.items())
        out.append("")
    return "\n".join(out)
