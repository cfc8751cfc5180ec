"""Named, lazily imported components: policies, model presets, workloads, tune objectives.

Entries are objects or `"module:Attr"` strings imported on first use; third-party packages add
entries through entry points in the group `oled.<kind>` (e.g. `oled.retention`).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

T = TypeVar("T")

REQUIRED: Any = inspect.Parameter.empty  # default of a parameter without one


class UnknownComponentError(KeyError, ValueError):
    """An unknown component name; the message carries a close-match suggestion."""

    def __str__(self) -> str:
        return str(self.args[0])


class ComponentImportError(ImportError):
    """A registered `"module:Attr"` target that cannot be imported."""


@dataclass(frozen=True)
class Param:
    """One constructor parameter of a component."""

    name: str
    annotation: Any  # a type, or Any when the signature has none
    default: Any  # REQUIRED when the parameter has no default

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


@dataclass(frozen=True)
class ComponentInfo:
    """What `oled ls` shows of one component."""

    kind: str
    name: str
    target: str
    summary: str
    params: tuple[Param, ...]


def suggest(name: str, choices: typing.Iterable[str]) -> str:
    """` (did you mean 'x'?)` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


def import_target(target: str) -> Any:
    """Import `"module:Attr"` (Attr may be dotted)."""
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split(".") if attr else []:
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ComponentImportError(f"cannot import {target} ({exc})") from exc
    return obj


def target_name(target: Any) -> str:
    """`"module:Attr"` of an object, or the string itself."""
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"


def signature_params(obj: Any) -> tuple[Param, ...]:
    """Parameters of a class's constructor (or a function), with resolved type hints."""
    func = obj.__init__ if inspect.isclass(obj) else obj
    try:
        hints = typing.get_type_hints(func)
    except Exception:  # unresolvable forward references: fall back to Any
        hints = {}
    sig = inspect.signature(obj)
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return tuple(
        Param(p.name, hints.get(p.name, Any), p.default)
        for p in sig.parameters.values()
        if p.kind not in kinds
    )


def summary_of(obj: Any) -> str:
    """First line of an object's docstring."""
    doc = inspect.getdoc(obj) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


class Registry(Generic[T]):
    """Components of one kind, by name; `"module:Attr"` entries are imported on first use."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.group = f"oled.{kind}"
        self._entries: dict[str, Any] = {}
        self._scanned: set[str] = set()  # entry point names already seen

    def register(self, name: str, target: T | str, *, overwrite: bool = True) -> None:
        """Add `name`; `target` is the object or a lazy `"module:Attr"` string."""
        if not overwrite and name in self._entries:
            raise ValueError(f"{self.kind} '{name}' is already registered")
        self._entries[name] = target

    def unregister(self, name: str) -> None:
        """Remove `name` if present."""
        self._entries.pop(name, None)

    def _scan_entry_points(self) -> None:
        for ep in entry_points(group=self.group):
            if ep.name not in self._scanned and ep.name not in self._entries:
                self._entries[ep.name] = ep.value
            self._scanned.add(ep.name)

    def names(self) -> list[str]:
        """All names, entry points included, sorted."""
        self._scan_entry_points()
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def target(self, name: str) -> str:
        """The entry's `"module:Attr"` without importing it."""
        if name not in self._entries:
            self._scan_entry_points()
        if name not in self._entries:
            raise UnknownComponentError(
                f"unknown {self.kind} '{name}'{suggest(name, self._entries)}"
            )
        return target_name(self._entries[name])

    def get(self, name: str) -> T:
        """The component itself, imported now if it was a lazy entry."""
        self.target(name)
        entry = self._entries[name]
        if isinstance(entry, str):
            entry = import_target(entry)
            self._entries[name] = entry
        return entry

    def is_loaded(self, name: str) -> bool:
        """Whether `name` has been imported (or was registered as an object)."""
        return name in self._entries and not isinstance(self._entries[name], str)

    def params(self, name: str) -> tuple[Param, ...]:
        """Constructor parameters of `name` (imports it)."""
        return signature_params(self.get(name))

    def info(self, name: str) -> ComponentInfo:
        """Name, target, summary and parameters of `name` (imports it)."""
        obj = self.get(name)
        return ComponentInfo(
            self.kind, name, self.target(name), summary_of(obj), signature_params(obj)
        )

    def build(self, name: str, /, **kwargs: Any) -> Any:
        """Construct `name` with keyword arguments."""
        return self.get(name)(**kwargs)  # type: ignore[operator]


POLICY_KINDS = ("allocation", "retention", "compensation")
KINDS = ("model", *POLICY_KINDS, "workload", "objective")

REGISTRIES: dict[str, Registry[Any]] = {kind: Registry(kind) for kind in KINDS}

_BUILTINS: dict[str, dict[str, str]] = {
    "allocation": {
        "uniform": "oled.policies.allocation:UniformAllocation",
        "adaptive": "oled.policies.allocation:AdaptiveAllocation",
    },
    "retention": {
        "lru": "oled.policies.retention:LRURetention",
        "lfu": "oled.policies.retention:LFURetention",
        "score_ema": "oled.policies.retention:ScoreEMARetention",
        "confidence": "oled.policies.retention:ConfidenceRetention",
    },
    "compensation": {
        "transfer_only": "oled.policies.compensation:TransferOnly",
        "cpu_only": "oled.policies.compensation:CpuOnly",
        "batch_threshold": "oled.policies.compensation:BatchThreshold",
        "makespan": "oled.policies.compensation:MakespanCompensation",
        "cooperative": "oled.policies.compensation:CooperativeCompensation",
        "interval_refresh": "oled.policies.compensation:IntervalRefresh",
        "static_hot": "oled.policies.compensation:StaticHot",
        "resident": "oled.policies.compensation:Resident",
    },
    "workload": {"short": "oled.experiment.workload:short_prompts"},
    "objective": {
        "simulate": "oled.experiment.tune:simulate_objective",
        "run": "oled.experiment.tune:run_objective",
    },
}
for _kind, _entries in _BUILTINS.items():
    for _name, _target in _entries.items():
        REGISTRIES[_kind].register(_name, _target)
# Kinds whose built-ins the defining module registers itself, imported on the first look-up:
# the model shapes' one table (oled.model.config.SHAPES).
_DEFINED_IN = {"model": "oled.model.config"}


def registry(kind: str) -> Registry[Any]:
    """The registry of one component kind."""
    if kind not in REGISTRIES:
        raise UnknownComponentError(f"unknown component kind '{kind}'{suggest(kind, KINDS)}")
    if kind in _DEFINED_IN:
        importlib.import_module(_DEFINED_IN.pop(kind))
    return REGISTRIES[kind]


def register(kind: str, name: str, target: Any) -> None:
    """Register `target` (an object or `"module:Attr"`) as `name` of `kind`."""
    registry(kind).register(name, target)


def get(kind: str, name: str) -> Any:
    """The component `name` of `kind`."""
    return registry(kind).get(name)


def params(kind: str, name: str) -> tuple[Param, ...]:
    """Constructor parameters of component `name` of `kind`."""
    return registry(kind).params(name)
