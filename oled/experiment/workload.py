"""Prompt sets: shipped ones (`builtin:NAME`) and JSONL files."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from oled import registry as reg
from oled.recipe import BUILTIN


class Message(BaseModel):
    """One chat message."""

    model_config = ConfigDict(extra="forbid")

    role: str
    content: str


class Prompt(BaseModel):
    """A plain prompt or a list of chat messages."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    messages: list[Message] | None = None

    @model_validator(mode="after")
    def _one(self) -> Prompt:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self

    def as_messages(self, system: str | None = None) -> list[dict[str, str]]:
        """The prompt as chat messages."""
        if self.messages is not None:
            return [m.model_dump() for m in self.messages]
        head = [{"role": "system", "content": system}] if system else []
        return head + [{"role": "user", "content": self.prompt or ""}]


def read_jsonl(path: str | Path) -> list[Prompt]:
    """Prompts of a JSONL file ({"prompt": ...} or {"messages": [...]} per line)."""
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            prompts.append(Prompt.model_validate(json.loads(line)))
        except (json.JSONDecodeError, ValidationError) as exc:
            first = (
                str(exc).splitlines()[0]
                if isinstance(exc, json.JSONDecodeError)
                else (exc.errors()[0]["msg"])
            )
            raise ValueError(f"{path}:{number}: {first}") from None
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


@reg.component("workload", "short")
def short_prompts() -> list[Prompt]:
    """A few short prompts (instructions, a chat with a system message)."""
    return read_jsonl(Path(str(resources.files("oled") / "data" / "short.jsonl")))


def load_prompts(spec: str, base: Path | None = None) -> list[Prompt]:
    """Prompts of `builtin:NAME` (a registered workload) or a JSONL path (relative to `base`)."""
    if spec.startswith(BUILTIN):
        workload: Any = reg.get("workload", spec.removeprefix(BUILTIN))
        return list(workload())
    path = Path(spec)
    if not path.is_absolute() and base is not None and (base / path).exists():
        path = base / path
    return read_jsonl(path)
