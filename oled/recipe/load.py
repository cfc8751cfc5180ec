"""Loading recipes: read the TOML, apply overrides (`--set`, command-line flags), validate.

`load_recipe` validates the whole file before any work starts; every error is one line that
names the file, the line and the key (or the override that set it), with a close-match
suggestion where one exists. `command_recipe` is how every command turns its input into the
one spec a runtime is built from: flags over the recipe, the recipe over the schema's defaults.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from oled import registry as reg
from oled.model.config import BUILTIN, ModelConfig, builtin_config, builtin_name
from oled.recipe.locate import Locator, set_origins
from oled.recipe.schema import (
    DEFAULT_MODEL,
    Component,
    Recipe,
    TuneSection,
    beside,
    routing_trace,
)
from oled.recipe.toml import key_lines, line_of_error, tomllib
from oled.registry import REQUIRED, ComponentImportError, UnknownComponentError


class RecipeError(ValueError):
    """A recipe that does not validate; `str()` is one line: `file:line: key: problem`."""


def load_recipe(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    skip_params: Iterable[str] = (),
    require_model: bool = False,
) -> Recipe:
    """Load, override (`a.b=value`, value parsed as TOML, else a string) and validate a recipe:
    a file, or `builtin:NAME` for a recipe shipped with the package (`oled cp` lists them).

    `skip_params`: policy kinds whose parameters are not checked (only their names are);
    `require_model`: the model's checkpoint must be on this machine (`oled validate`).
    """
    path = shipped_recipe(str(path)) if str(path).startswith(BUILTIN) else Path(path)
    text = read_text(path)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line = getattr(exc, "lineno", None) or line_of_error(str(exc))
        msg = getattr(exc, "msg", str(exc))
        raise RecipeError(f"{path}:{line}: invalid TOML: {msg}") from None
    keys = apply_overrides(raw, overrides)
    origins = set_origins(sorted(keys))
    recipe = validate(
        raw,
        source=path,
        lines=key_lines(text),
        origins=origins,
        skip=skip_params,
        require_model=require_model,
    )
    recipe._path = path
    return recipe


def shipped_recipes() -> dict[str, Path]:
    """The recipes shipped with the package (`oled cp NAME`), by name."""
    from importlib import resources

    data = Path(str(resources.files("oled") / "data"))
    return {p.stem: p for p in sorted(data.glob("*.toml"))}


def shipped_recipe(name: str) -> Path:
    """The file of shipped recipe `builtin:NAME` (or NAME); RecipeError naming the shipped
    ones when there is no such recipe."""
    stem = name.removeprefix(BUILTIN).removesuffix(".toml")
    recipes = shipped_recipes()
    if stem not in recipes:
        raise RecipeError(
            f"{name}: no such shipped recipe{reg.suggest(stem, recipes)}; "
            f"shipped: {', '.join(recipes)}"
        )
    return recipes[stem]


def read_text(path: Path) -> str:
    """A recipe file's text; a RecipeError naming the file when it cannot be read or is not
    text (a binary file given as a recipe)."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start]
        raise RecipeError(
            f"{path}: not a TOML recipe: not UTF-8 text (byte 0x{byte:02x} at offset {exc.start})"
        ) from None


def override(
    recipe: Recipe, values: Mapping[str, Any], origins: Mapping[str, str] | None = None
) -> Recipe:
    """A copy of `recipe` with dotted keys set and validated; errors name each key by its
    origin (`origins[key]`, default `--set KEY`)."""
    raw = recipe.data()
    origins = {**set_origins(list(values)), **(origins or {})}
    for key, value in values.items():
        assign(raw, key.split("."), value, origins[key])
    out = validate(raw, source=None, lines={}, origins=origins, base=recipe.folder)
    out._path = recipe.path
    return out


def _flag(key: str, flag: str) -> Any:
    """A field of `Flags`: the recipe key it sets and the flag that names it in errors."""
    return field(default=None, metadata={"key": key, "flag": flag})


@dataclass(frozen=True, kw_only=True)
class Flags:
    """A command's flags over a recipe, typed: each field sets one recipe key (None, a flag
    left out, keeps the recipe's value); the recipe's schema validates them, and an invalid
    value's error names its flag."""

    model: str | None = _flag("model.path", "--model")
    device: str | None = _flag("runtime.device", "--device")
    dtype: str | None = _flag("runtime.dtype", "--dtype")
    cache_size: int | None = _flag("runtime.budget", "--cache-size")  # slots per MoE layer
    graphs: bool | None = _flag("runtime.cuda_graphs", "--graphs/--eager")
    kernels: str | None = _flag("runtime.kernels", "--kernels")
    transfer: str | None = _flag("runtime.transfer", "--transfer")
    max_batch: int | None = _flag("runtime.max_batch", "--max-batch")
    max_queue: int | None = _flag("runtime.max_queue", "--max-queue")
    prefill_chunk: int | None = _flag("runtime.prefill_chunk", "--prefill-chunk")
    block_length: int | None = _flag("decoding.block_length", "--block-length")
    threshold: float | None = _flag("decoding.threshold", "--threshold")
    steps: int | None = _flag("decoding.steps", "--steps")
    max_tokens: int | None = _flag("decoding.max_new_tokens", "--max-tokens")
    temperature: float | None = _flag("decoding.temperature", "--temperature")
    seed: int | None = _flag("decoding.seed", "--seed")
    use_cache: bool | None = _flag("decoding.use_cache", "--no-cache")
    max_tokens_flag: str = "--max-tokens"  # how the command spells --max-tokens

    def over(self, recipe: Recipe) -> Recipe:
        """`recipe` with the flags given set, validated (`override`: errors name the flag)."""
        values: dict[str, Any] = {}
        origins: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if "key" in f.metadata and value is not None:
                key = f.metadata["key"]
                values[key] = _budget(value) if f.name == "cache_size" else value
                origins[key] = (
                    self.max_tokens_flag if f.name == "max_tokens" else f.metadata["flag"]
                )
        return override(recipe, values, origins) if values else recipe


def _budget(slots_per_layer: int) -> dict[str, int]:
    """The budget table of `--cache-size` (it replaces the recipe's whole budget)."""
    return {"slots_per_layer": slots_per_layer}


def command_recipe(recipe: Path | None, flags: Flags) -> Recipe:
    """The spec a command builds its runtime from: the recipe file (else the schema's defaults
    for the built-in default model), then each flag the user gave. Flags override the recipe,
    the recipe overrides the schema's defaults; an invalid flag's error names the flag."""
    if recipe is not None:
        base = load_recipe(recipe)
    else:
        base = validate({"model": {"path": DEFAULT_MODEL}}, source=None, lines={})
    return flags.over(base)


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> set[str]:
    """Apply `a.b=value` strings to raw recipe data; returns the overridden keys."""
    keys: set[str] = set()
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise RecipeError(f"--set {item}: expected KEY=VALUE (e.g. decoding.threshold=0.9)")
        assign(raw, key.split("."), parse_value(text.strip()), f"--set {key}")
        keys.add(key)
    return keys


def parse_value(text: str) -> Any:
    """A TOML value if `text` is one, else the text itself."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def assign(raw: dict[str, Any], parts: list[str], value: Any, origin: str) -> None:
    """Set the value at the dotted key `parts` of raw recipe data."""
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
    origins: Mapping[str, str] | None = None,
    skip: Iterable[str] = (),
    base: Path | None = None,
    require_model: bool = False,
) -> Recipe:
    """Validate raw data into a Recipe, checking component params, tuned keys and the traces
    it names (relative paths from `base`, by default the source's folder); `origins`: the
    overridden keys and how the user gave each (Locator); `require_model`: see load_recipe."""
    where = Locator(source, lines, origins or {})
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as exc:
        raise RecipeError(where.describe(exc, Recipe)) from None
    if base is None and source is not None:
        base = source.parent
    if require_model:
        _check_model(recipe.model.path, where)
    _check_routing(recipe, where, base)
    skip = set(skip)
    for kind in reg.POLICY_KINDS:
        component = getattr(recipe.policy, kind)
        if component is not None:
            _check_component(kind, component, where, check_params=kind not in skip)
            _resolve_paths(kind, component, base, where)
    if recipe.tune is not None:
        _check_tuned_keys(raw, recipe.tune, where, skip, base)
        _check_study_trace(recipe, where, base)
    return recipe


RECORD = "oled trace record RECIPE -o {path} records one"  # how a missing trace is made


def _check_model(model: str, where: Locator) -> None:
    """The model's checkpoint is on this machine (a built-in always is: made on first use)."""
    if model.startswith(BUILTIN):
        return
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        missing = "no config.json in" if path.is_dir() else "no such directory:"
        problem = f"{missing} {path} (oled model init {path} --preset NAME writes one)"
        raise RecipeError(where.line(("model", "path"), problem))


def _check_trace(path: Path, loc: tuple[str, ...], where: Locator, model: str) -> int:
    """A trace file that a recipe names at `loc`: readable, a trace, and routing like the
    recipe's model where that model's config is on this machine; its prompt count."""
    from oled.trace.format import prompt_count, read_meta

    try:
        count = prompt_count(path)
    except FileNotFoundError:
        problem = f"no such file: {path} ({RECORD.format(path=path)})"
        raise RecipeError(where.line(loc, problem)) from None
    except ValueError as exc:
        raise RecipeError(where.line(loc, str(exc))) from None
    try:
        mismatch = routes_unlike(read_meta(path), model)
    except ValueError as exc:  # the model's config.json
        raise RecipeError(where.line(("model", "path"), str(exc))) from None
    if mismatch is not None:
        raise RecipeError(where.line(loc, mismatch))
    return count


def _check_study_trace(recipe: Recipe, where: Locator, base: Path | None) -> None:
    """A study that simulates names a trace file that routes like the recipe's model."""
    tune = recipe.tune
    assert tune is not None
    if tune.trace is not None:
        _check_trace(beside(tune.trace, base), ("tune", "trace"), where, recipe.model.path)
    elif tune.objective == "simulate":
        problem = f"'simulate' replays a trace: set tune.trace ({RECORD.format(path='PATH')})"
        raise RecipeError(where.line(("tune", "objective"), problem))


def model_config(model: str) -> ModelConfig | None:
    """The ModelConfig of a recipe's `model.path` without building anything: a directory's
    config.json, a built-in's (oled.model.config.builtin_config); None when the directory
    holds no config.json."""
    name = builtin_name(model)
    if name is not None:
        return builtin_config(name)
    path = Path(model).expanduser()
    return ModelConfig.from_json(path) if (path / "config.json").is_file() else None


def routes_unlike(meta: Any, model: str) -> str | None:
    """Why a trace (its TraceMeta) does not route like the model of `model.path` (its MoE
    layers, experts and top-k), or None: when it does, or when that model is not on this
    machine to compare with."""
    from oled.trace.replay import check_geometry

    config = model_config(model)
    if config is None:
        return None
    try:
        check_geometry(SimpleNamespace(meta=meta), config)  # it reads a trace's `meta`
    except ValueError as exc:
        return f"{exc} (model.path {model})"
    return None


def _check_routing(recipe: Recipe, where: Locator, base: Path | None) -> None:
    """A trace routing names a trace file (_check_trace), and the prompt selection fits it."""
    workload = recipe.workload
    path = routing_trace(workload.routing, base)
    if path is None:
        if workload.trace_prompts is not None:
            problem = "needs workload.routing = 'trace:PATH'"
            raise RecipeError(where.line(("workload", "trace_prompts"), problem))
        return
    count = _check_trace(path, ("workload", "routing"), where, recipe.model.path)
    from oled.trace.replay import select_prompts

    try:
        select_prompts(workload.trace_prompts, count)
    except ValueError as exc:
        raise RecipeError(where.line(("workload", "trace_prompts"), str(exc))) from None


def component_model(kind: str, name: str) -> type[BaseModel]:
    """A pydantic model of a component's constructor parameters (plus `kind`)."""
    fields: dict[str, Any] = {"kind": (Literal[name], ...)}
    for p in reg.params(kind, name):
        fields[p.name] = (p.annotation, ... if p.default is REQUIRED else p.default)
    config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    return create_model(f"{kind}:{name}", __config__=config, **fields)


def _check_component(kind: str, component: Component, where: Locator, check_params: bool) -> None:
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


def _resolve_paths(kind: str, component: Component, base: Path | None, where: Locator) -> None:
    """A component's file parameters (its class's `path_params`) taken from `base` where
    relative; a RecipeError on the parameter's line where the file is missing."""
    params = component.model_extra or {}
    for name in getattr(reg.registry(kind).get(component.kind), "path_params", ()):
        value = params.get(name)
        if not isinstance(value, str):
            continue
        path = beside(value, base)  # a recipe overridden later names it from here
        if not path.is_file():
            if base is not None and not path.is_absolute():
                path = base / path  # where the recipe looked first
            raise RecipeError(where.line(("policy", kind, name), f"no such file: {path}"))
        params[name] = str(path)


def _check_tuned_keys(
    raw: dict[str, Any], tune: TuneSection, where: Locator, skip: Iterable[str], base: Path | None
) -> None:
    for key, space in tune.params.items():
        trial = json.loads(json.dumps(raw))
        trial.pop("tune", None)
        try:
            assign(trial, key.split("."), space.sample_value(), key)
            validate(trial, source=None, lines={}, skip=skip, base=base)
        except RecipeError as exc:
            problem = str(exc).split(": ", 1)[-1]
            raise RecipeError(where.line(("tune", "params", key), problem)) from None
