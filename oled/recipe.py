"""Recipes: TOML files that declare a model, a budget, policies, a workload and a study.

`load_recipe` validates the whole file before any work starts; every error is one line that
names the file, the line and the key, with a close-match suggestion where one exists.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from oled import registry as reg
from oled.registry import REQUIRED, ComponentImportError, UnknownComponentError, suggest

BUILTIN = "builtin:"
TRACE = "trace:"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*$")
_UNITS = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


class RecipeError(ValueError):
    """A recipe that does not validate; `str()` is one line: `file:line: key: problem`."""


def parse_size(text: str) -> int:
    """Bytes in a size such as `"24GiB"` or `"500 MB"`."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. '24GiB')")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


class Strict(BaseModel):
    """Base of every recipe section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ModelSection(Strict):
    """Which checkpoint to run."""

    path: str  # a checkpoint directory or builtin:NAME (a registered model preset)

    @field_validator("path")
    @classmethod
    def _known_builtin(cls, value: str) -> str:
        if value.startswith(BUILTIN):
            name = value.removeprefix(BUILTIN)
            models = reg.registry("model")
            if name not in models:
                raise ValueError(f"unknown model '{name}'{suggest(name, models.names())}")
        return value


class BudgetSection(Strict):
    """How much GPU memory experts may use: exactly one of the fields."""

    expert_fraction: float | None = Field(None, gt=0, le=1)
    expert_budget: int | None = Field(None, ge=1)
    gpu_memory: str | None = None
    auto: Literal[True] | None = None
    resident: Literal[True] | None = None

    @field_validator("gpu_memory")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None:
            parse_size(value)
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> BudgetSection:
        chosen = [k for k, v in self.model_dump().items() if v is not None]
        if len(chosen) != 1:
            names = ", ".join(type(self).model_fields)
            raise ValueError(f"set exactly one of {names} (got {len(chosen)})")
        return self


class RuntimeSection(Strict):
    """Device, precision and the expert budget."""

    device: str = "auto"
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    cpu_threads: int | None = Field(None, ge=1)
    budget: BudgetSection = Field(default_factory=lambda: BudgetSection(resident=True))
    stage_capacity: int | None = Field(None, ge=1)
    prefetch: int = Field(0, ge=0)  # experts per MoE layer copied a layer ahead (0 = off)
    cost: str = "calibrate"  # "calibrate" or a cost profile name such as "h200"
    cuda_graphs: bool = True  # replay forwards as CUDA graphs on CUDA (the same tokens)
    kernels: Literal["auto", "triton", "torch"] = "auto"  # fused Triton kernels on CUDA
    planner: Literal["auto", "compiled", "python"] = "auto"  # host decisions (same decisions)

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError(f"expected auto, cpu, cuda or cuda:N (got {value!r})")
        return value


class DecodingSection(Strict):
    """Block diffusion decoding."""

    block_length: int = Field(32, ge=1)
    threshold: float = Field(0.95, gt=0, le=1)
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0)
    seed: int = 0


class Component(BaseModel):
    """A policy component: `kind` names a registry entry, other keys are its parameters."""

    model_config = ConfigDict(extra="allow")

    kind: str

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class PolicySection(Strict):
    """The three policy components; omitted ones are None (the runtime's default)."""

    allocation: Component | None = None
    retention: Component | None = None
    compensation: Component | None = None


class WorkloadSection(Strict):
    """Prompts to generate from and how often."""

    prompts: str = "builtin:short"  # builtin:NAME (a registered workload) or a JSONL path
    warmup: int = Field(1, ge=0)
    repeats: int = Field(1, ge=1)
    chat: bool = True
    follow: bool = False  # commit the all-resident model's tokens (Runtime.reference)
    routing: str = "model"  # "model" (the routers') or "trace:PATH" (a routing replay)
    trace_prompts: str | None = None  # with a trace: which of its prompts (I, A:B, list; all)

    @field_validator("routing")
    @classmethod
    def _routing(cls, value: str) -> str:
        if value != "model" and not (value.startswith(TRACE) and value.removeprefix(TRACE)):
            raise ValueError(f"expected 'model' or 'trace:PATH' (got {value!r})")
        return value

    @field_validator("trace_prompts", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("prompts")
    @classmethod
    def _known_builtin(cls, value: str) -> str:
        if value.startswith(BUILTIN):
            name = value.removeprefix(BUILTIN)
            workloads = reg.registry("workload")
            if name not in workloads:
                raise ValueError(f"unknown workload '{name}'{suggest(name, workloads.names())}")
        return value


class TrackingSection(Strict):
    """Where results go."""

    mlflow: bool = True
    tracking_uri: str | None = None  # default: sqlite:///<cwd>/mlflow.db
    experiment: str = "oled"
    report_dir: str = "reports"


class SearchSpace(Strict):
    """One tuned key: `choices`, or `low`/`high` (with `int`, `log`, `step`)."""

    low: float | None = None
    high: float | None = None
    choices: list[Any] | None = None
    int_: bool = Field(False, alias="int")
    log: bool = False
    step: float | None = None

    @model_validator(mode="after")
    def _shape(self) -> SearchSpace:
        if self.choices is not None:
            if self.low is not None or self.high is not None or not self.choices:
                raise ValueError("give either a non-empty 'choices' or 'low' and 'high'")
        elif self.low is None or self.high is None or self.low > self.high:
            raise ValueError("give 'low' <= 'high' (or 'choices')")
        return self

    def sample_value(self) -> Any:
        """A value inside the space (used to check that the tuned key exists)."""
        if self.choices is not None:
            return self.choices[0]
        return int(self.low or 0) if self.int_ else self.low


class TuneSection(Strict):
    """An Optuna study over recipe keys."""

    trials: int = Field(20, ge=1)
    storage: str | None = None  # Optuna URL or journal:PATH; default sqlite:///<cwd>/optuna.db
    study_name: str | None = None  # default: the recipe's name
    objective: str = "simulate"  # a registered objective: simulate, run, ...
    direction: Literal["minimize", "maximize"] = "minimize"
    metric: str = "ms_per_iteration"
    trace: str | None = None  # trace file for the simulate objective
    seed: int | None = None
    params: dict[str, SearchSpace] = Field(default_factory=dict)

    @field_validator("objective")
    @classmethod
    def _known_objective(cls, value: str) -> str:
        objectives = reg.registry("objective")
        if value not in objectives:
            raise ValueError(f"unknown objective '{value}'{suggest(value, objectives.names())}")
        return value


class Recipe(Strict):
    """A whole experiment."""

    model: ModelSection
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    decoding: DecodingSection = Field(default_factory=DecodingSection)
    policy: PolicySection = Field(default_factory=PolicySection)
    workload: WorkloadSection = Field(default_factory=WorkloadSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    tune: TuneSection | None = None

    _path: Path | None = PrivateAttr(None)

    @property
    def path(self) -> Path | None:
        """The file the recipe was loaded from, if any."""
        return self._path

    @property
    def name(self) -> str:
        """The file's stem, or `recipe`."""
        return self._path.stem if self._path else "recipe"

    def routing_trace(self) -> Path | None:
        """The trace file that `workload.routing` replays (None: the model routes itself)."""
        return routing_trace(self.workload.routing, self._path.parent if self._path else None)

    def data(self) -> dict[str, Any]:
        """The recipe as plain TOML-ready data (None values dropped)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    def flatten(self) -> dict[str, str]:
        """Dotted keys to string values (for MLflow params)."""
        return {key: _as_str(value) for key, value in _flat(self.data()).items()}

    def hash(self) -> str:
        """Short digest of what decides the measurement (tracking and tune excluded)."""
        data = {k: v for k, v in self.data().items() if k not in ("tracking", "tune")}
        if data["workload"].get("routing") == "model":  # the default: hashes as before the key
            del data["workload"]["routing"]
        text = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def to_toml(self) -> str:
        """The recipe as TOML text that `load_recipe` accepts again."""
        return dump_toml(self.data())

    def with_values(self, values: dict[str, Any]) -> Recipe:
        """A copy with dotted keys set (validated like `--set`)."""
        raw = self.data()
        for key, value in values.items():
            _assign(raw, key.split("."), value, f"--set {key}")
        base = self._path.parent if self._path else None
        recipe = validate(raw, source=None, lines={}, overrides=set(values), base=base)
        recipe._path = self._path
        return recipe


# ---------------------------------------------------------------- loading and errors


def load_recipe(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    skip_params: Iterable[str] = (),
) -> Recipe:
    """Load, override (`a.b=value`, value parsed as TOML, else a string) and validate a recipe.

    `skip_params`: policy kinds whose parameters are not checked (only their names are).
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line = getattr(exc, "lineno", None) or _line_of_error(str(exc))
        msg = getattr(exc, "msg", str(exc))
        raise RecipeError(f"{path}:{line}: invalid TOML: {msg}") from None
    keys = apply_overrides(raw, overrides)
    recipe = validate(raw, source=path, lines=key_lines(text), overrides=keys, skip=skip_params)
    recipe._path = path
    return recipe


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> set[str]:
    """Apply `a.b=value` strings to raw recipe data; returns the overridden keys."""
    keys: set[str] = set()
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise RecipeError(f"--set {item}: expected KEY=VALUE (e.g. decoding.threshold=0.9)")
        _assign(raw, key.split("."), parse_value(text.strip()), f"--set {key}")
        keys.add(key)
    return keys


def parse_value(text: str) -> Any:
    """A TOML value if `text` is one, else the text itself."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _assign(raw: dict[str, Any], parts: list[str], value: Any, origin: str) -> None:
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise RecipeError(f"{origin}: {where} is a value, not a table")
        node = child
    node[parts[-1]] = value


def validate(
    raw: dict[str, Any],
    *,
    source: Path | None,
    lines: dict[tuple[str, ...], int],
    overrides: set[str] = frozenset(),  # type: ignore[assignment]
    skip: Iterable[str] = (),
    base: Path | None = None,
) -> Recipe:
    """Validate raw data into a Recipe, checking component params, tuned keys and the routing
    trace (relative paths from `base`, by default the source's folder)."""
    where = _Locator(source, lines, overrides)
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as exc:
        raise RecipeError(where.describe(exc, Recipe)) from None
    if base is None and source is not None:
        base = source.parent
    _check_routing(recipe.workload, where, base)
    skip = set(skip)
    for kind in reg.POLICY_KINDS:
        component = getattr(recipe.policy, kind)
        if component is not None:
            _check_component(kind, component, where, check_params=kind not in skip)
    if recipe.tune is not None:
        _check_tuned_keys(raw, recipe.tune, where, skip)
    return recipe


def routing_trace(routing: str, base: Path | None = None) -> Path | None:
    """The trace file of a `workload.routing` value (None for "model"): a relative path is
    looked up next to the recipe (`base`) first, then from the working directory."""
    if not routing.startswith(TRACE):
        return None
    return beside(routing.removeprefix(TRACE), base)


def beside(spec: str | Path, base: Path | None = None) -> Path:
    """A file a recipe names: a relative path next to the recipe (`base`) when it is there,
    else from the working directory."""
    path = Path(spec).expanduser()
    if not path.is_absolute() and base is not None and (base / path).exists():
        return base / path
    return path


def _check_routing(workload: WorkloadSection, where: _Locator, base: Path | None) -> None:
    """A trace routing names a readable trace file, and the prompt selection fits it."""
    path = routing_trace(workload.routing, base)
    if path is None:
        if workload.trace_prompts is not None:
            problem = "needs workload.routing = 'trace:PATH'"
            raise RecipeError(where.line(("workload", "trace_prompts"), problem))
        return
    from oled.trace.format import prompt_count

    try:
        count = prompt_count(path)
    except FileNotFoundError:
        raise RecipeError(where.line(("workload", "routing"), f"no such file: {path}")) from None
    except ValueError as exc:
        raise RecipeError(where.line(("workload", "routing"), str(exc))) from None
    from oled.decoding.replay import select_prompts

    try:
        select_prompts(workload.trace_prompts, count)
    except ValueError as exc:
        raise RecipeError(where.line(("workload", "trace_prompts"), str(exc))) from None


def component_model(kind: str, name: str) -> type[BaseModel]:
    """A pydantic model of a component's constructor parameters (plus `kind`)."""
    fields: dict[str, Any] = {"kind": (Literal[name], ...)}  # type: ignore[valid-type]
    for p in reg.params(kind, name):
        fields[p.name] = (p.annotation, ... if p.default is REQUIRED else p.default)
    config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    return create_model(f"{kind}:{name}", __config__=config, **fields)


def _check_component(kind: str, component: Component, where: _Locator, check_params: bool) -> None:
    loc = ("policy", kind)
    try:
        reg.registry(kind).target(component.kind)
        if not check_params:
            return
        model = component_model(kind, component.kind)
    except (UnknownComponentError, ComponentImportError) as exc:
        raise RecipeError(where.line(("policy", kind, "kind"), str(exc))) from None
    try:
        model.model_validate(component.model_dump())
    except ValidationError as exc:
        raise RecipeError(where.describe(exc, model, prefix=loc)) from None


def _check_tuned_keys(
    raw: dict[str, Any], tune: TuneSection, where: _Locator, skip: Iterable[str]
) -> None:
    for key, space in tune.params.items():
        trial = json.loads(json.dumps(raw))
        trial.pop("tune", None)
        try:
            _assign(trial, key.split("."), space.sample_value(), key)
            validate(trial, source=None, lines={}, skip=skip)
        except RecipeError as exc:
            problem = str(exc).split(": ", 1)[-1]
            raise RecipeError(where.line(("tune", "params", key), problem)) from None


class _Locator:
    """Turns error locations into `file:line: key: problem` lines."""

    def __init__(self, source: Path | None, lines: dict[tuple[str, ...], int], overrides: set[str]):
        self.source = source
        self.lines = lines
        self.overrides = overrides

    def line(self, loc: Sequence[str], problem: str) -> str:
        key = ".".join(loc)
        for o in sorted(self.overrides):
            if o == key or key.startswith(o + ".") or o.startswith(key + "."):
                return f"--set {key}: {problem}" if o == key else f"--set {o}: {key}: {problem}"
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


def _line_of_error(message: str) -> int:
    match = re.search(r"line (\d+)", message)
    return int(match.group(1)) if match else 1


# ---------------------------------------------------------------- key lines and TOML output

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


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out |= _flat(value, f"{name}.")
        else:
            out[name] = value
    return out


def _as_str(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


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
