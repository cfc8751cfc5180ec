"""Named components: policies, model presets, workloads, tune objectives.

A built-in component is registered where it is defined (`@component(kind, name)`, checked
against the kind's base class); the registry knows only which modules define a kind's
built-ins and imports them on the kind's first lookup. Other entries are objects or
`"module:Attr"` strings imported on first use; third-party packages add entries through entry
points in the group `oled.<kind>` (e.g. `oled.retention`).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import typing
from collections.abc import Callable, Iterable, Iterator
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


def suggest(name: str, choices: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for the closest choice, or an empty string: the one wording of a
    close match for every unknown name."""
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

    def __init__(self, kind: str, builtins: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self.group = f"oled.{kind}"
        self.base: type | None = None  # what `component` checks (expect); None: any callable
        self._entries: dict[str, Any] = {}
        self._scanned: set[str] = set()  # entry point names already seen
        self._builtins = builtins  # modules whose `component`s register built-ins here

    def expect(self, base: type) -> None:
        """Components registered with `component` must be subclasses of `base`."""
        self.base = base

    def check(self, name: str, obj: Any) -> None:
        """TypeError unless `obj` may be `name` of this kind: a subclass of `base`, or (without
        one) a callable."""
        if self.base is None:
            ok, want = callable(obj), "a callable"
        else:
            ok, want = inspect.isclass(obj) and issubclass(obj, self.base), self.base.__name__
        if not ok:
            raise TypeError(f"{self.kind} '{name}': {target_name(obj)} is not {want}")

    def _load_builtins(self) -> None:
        """Import the modules that register this kind's built-ins (once)."""
        modules, self._builtins = self._builtins, ()  # a lookup while they import: no loop
        try:
            for module in modules:
                importlib.import_module(module)
        except BaseException:
            self._builtins = modules
            raise

    def register(self, name: str, target: T | str, *, overwrite: bool = True) -> None:
        """Add `name`; `target` is the object or a lazy `"module:Attr"` string."""
        if not overwrite and name in self._entries:
            raise ValueError(f"{self.kind} '{name}' is already registered")
        self._entries[name] = target

    def unregister(self, name: str) -> None:
        """Remove `name` if present."""
        self._entries.pop(name, None)

    def _scan_entry_points(self) -> None:
        self._load_builtins()
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
        """The entry's `"module:Attr"` without importing a lazy entry."""
        self._load_builtins()
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

# Where each kind's built-ins are defined (and registered, by `component`).
_HOMES: dict[str, tuple[str, ...]] = {
    "allocation": ("oled.policies.allocation",),
    "retention": ("oled.policies.retention",),
    "compensation": ("oled.policies.compensation",),
    "workload": ("oled.experiment.workload",),
    "objective": ("oled.experiment.tune",),
    "model": ("oled.model.config",),  # the built-in models' one table (SHAPES)
}
REGISTRIES: dict[str, Registry[Any]] = {
    kind: Registry(kind, _HOMES.get(kind, ())) for kind in KINDS
}


def registry(kind: str) -> Registry[Any]:
    """The registry of one component kind."""
    if kind not in REGISTRIES:
        raise UnknownComponentError(f"unknown component kind '{kind}'{suggest(kind, KINDS)}")
    return REGISTRIES[kind]


def register(kind: str, name: str, target: Any) -> None:
    """Register `target` (an object or `"module:Attr"`) as `name` of `kind`."""
    registry(kind).register(name, target)


def component(kind: str, name: str) -> Callable[[T], T]:
    """Decorator: register the class or function it decorates as `name` of `kind`, where it
    is defined (TypeError unless it fits the kind: Registry.check)."""

    def add(obj: T) -> T:
        kinds = registry(kind)
        kinds._load_builtins()  # they import the base class, which declares itself (expect)
        kinds.check(name, obj)
        kinds.register(name, obj)
        return obj

    return add


def get(kind: str, name: str) -> Any:
    """The component `name` of `kind`."""
    return registry(kind).get(name)


def params(kind: str, name: str) -> tuple[Param, ...]:
    """Constructor parameters of component `name` of `kind`."""
    return registry(kind).params(name)
