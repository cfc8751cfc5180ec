"""Where a recipe error is: validation errors turned into one line, `file:line: key: problem`,
with a close-match suggestion for unknown keys; `--set` and command-line flags name themselves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from oled.registry import suggest


def set_origins(keys: Sequence[str]) -> dict[str, str]:
    """Each `--set` key named as its origin (`--set KEY`)."""
    return {key: f"--set {key}" for key in keys}


class Locator:
    """Turns error locations into `file:line: key: problem` lines; a key that an override set
    (`origins`: dotted key -> how the user gave it, `--set KEY` or a flag) is named by that."""

    def __init__(
        self,
        source: Path | None,
        lines: dict[tuple[str, ...], int],
        origins: Mapping[str, str],
    ) -> None:
        self.source = source
        self.lines = lines
        self.origins = origins

    def line(self, loc: Sequence[str], problem: str) -> str:
        key = ".".join(loc)
        for o in sorted(self.origins):
            if o == key or key.startswith(o + ".") or o.startswith(key + "."):
                origin = self.origins[o]
                return f"{origin}: {problem}" if o == key else f"{origin}: {key}: {problem}"
        if self.source is None:
            return f"{key}: {problem}"
        return f"{self.source}:{self._lineno(tuple(loc))}: {key}: {problem}"

    def _lineno(self, loc: tuple[str, ...]) -> int:
        for n in range(len(loc), 0, -1):
            if loc[:n] in self.lines:
                return self.lines[loc[:n]]
        return 1

    def describe(self, exc: ValidationError, model: type[BaseModel], prefix: tuple = ()) -> str:
        error = exc.errors()[0]
        loc = tuple(str(part) for part in error["loc"])
        return self.line(prefix + loc, _problem(error, model, loc))


def _problem(error: Any, model: type[BaseModel], loc: tuple[str, ...]) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown key" + suggest(loc[-1], _fields_at(model, loc[:-1]))
    if kind == "missing":
        return "missing required key"
    msg = str(error["msg"]).removeprefix("Value error, ")
    if kind.endswith("_type") or kind.endswith("_parsing") or kind == "literal_error":
        msg += f" (got {error['input']!r})"
    return msg


def _fields_at(model: Any, loc: tuple[str, ...]) -> list[str]:
    """Field names (aliases) of the model found at `loc` inside `model`."""
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = _model_in(field.annotation)
    fields = getattr(model, "model_fields", {})
    return [f.alias or name for name, f in fields.items()]


def _model_in(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
