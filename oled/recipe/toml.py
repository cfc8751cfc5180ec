"""TOML for recipes: the reader, a scanner of the line of every key (for error messages), and a
writer of nested data (for `Recipe.to_toml`)."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

__all__ = ["dump_toml", "key_lines", "line_of_error", "tomllib"]

_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_PART = re.compile(r"""[A-Za-z0-9_\-]+|"[^"]*"|'[^']*'""")
_KEY = re.compile(rf"^\s*((?:{_PART.pattern})(?:\s*\.\s*(?:{_PART.pattern}))*)\s*=")
_INLINE_KEY = re.compile(r"""[{,]\s*([A-Za-z0-9_\-]+|"[^"]*")\s*=""")


def _key_parts(text: str) -> tuple[str, ...]:
    return tuple(p.strip("\"'") for p in _PART.findall(text))


def key_lines(text: str) -> dict[tuple[str, ...], int]:
    """The 1-based line of every table header and key in TOML text (inline tables one level)."""
    lines: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    for number, line in enumerate(text.splitlines(), start=1):
        header = _HEADER.match(line)
        if header:
            table = _key_parts(header.group(1))
            lines.setdefault(table, number)
            continue
        key = _KEY.match(line)
        if key:
            path = table + _key_parts(key.group(1))
            lines.setdefault(path, number)
            for inner in _INLINE_KEY.findall(line[key.end() :]):
                lines.setdefault(path + (inner.strip("\"'"),), number)
    return lines


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_\-]+", key) else json.dumps(key, ensure_ascii=False)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if value == value and abs(value) != float("inf") else str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def dump_toml(data: dict[str, Any], table: tuple[str, ...] = ()) -> str:
    """TOML text of nested dicts: scalars first, then one `[table]` per sub-dict."""
    scalars = [(k, v) for k, v in data.items() if not isinstance(v, dict)]
    tables = [(k, v) for k, v in data.items() if isinstance(v, dict)]
    out = []
    if table and (scalars or not tables):
        out.append("[" + ".".join(_toml_key(k) for k in table) + "]")
    out += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars]
    text = "\n".join(out) + ("\n" if out else "")
    for key, value in tables:
        sub = dump_toml(value, table + (key,))
        text += ("\n" if text else "") + sub
    return text


def line_of_error(message: str) -> int:
    """The line number a TOML parser's message names (1 if none)."""
    match = re.search(r"line (\d+)", message)
    return int(match.group(1)) if match else 1
