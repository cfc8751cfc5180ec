"""The experiment commands: validate, ls, cp, run, tune."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from oled import registry as reg
from oled.cli.options import check_writable, fail, user_errors
from oled.recipe import BUILTIN, RecipeError, load_recipe, shipped_recipes
from oled.registry import ComponentImportError, suggest

SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a recipe key: a.b=value (TOML value, else text)."),
]


_fail = fail  # one `error:` line on stderr; the exit to raise


def _load(path: Path, overrides: list[str] | None, *, require_model: bool = False) -> Any:
    return load_recipe(path, overrides or [], require_model=require_model)


def validate(
    files: Annotated[list[Path], typer.Argument(help="Recipe files.")],
    set_: SetOption = None,
    skip_model: Annotated[
        bool,
        typer.Option(
            "--skip-model",
            help="Do not require the model's checkpoint here (a recipe to run elsewhere).",
        ),
    ] = False,
) -> None:
    """Validate recipes and what they need on this machine (the model's checkpoint, the traces
    they name, routing like the model); print each one's hash, or the first error of each."""
    failed = 0
    for path in files:
        try:
            recipe = load_recipe(path, set_ or [], require_model=not skip_model)
        except RecipeError as exc:
            fail(str(exc))
            failed += 1
            continue
        typer.echo(f"ok  {path}  {recipe.hash()}")
    if failed:
        raise typer.Exit(code=2)


def _params_text(info: reg.ComponentInfo) -> str:
    def one(p: reg.Param) -> str:
        kind = getattr(p.annotation, "__name__", str(p.annotation).replace("typing.", ""))
        return f"{p.name}: {kind}" + ("" if p.required else f" = {p.default!r}")

    return ", ".join(one(p) for p in info.params if p.name != "self")


def ls(
    kind: Annotated[
        str | None, typer.Argument(help="Component kind (all kinds if omitted).")
    ] = None,
) -> None:
    """List registered components and their parameters (models: the built-in checkpoints
    recipes name as builtin:NAME, and the presets `oled model init` writes)."""
    kinds = [reg.registry(kind).kind] if kind else list(reg.KINDS)  # else UnknownComponentError
    table = Table(title="components")
    for column in ("kind", "name", "summary", "parameters"):
        table.add_column(column)
    for k in kinds:
        rows = _model_rows() if k == "model" else _component_rows(k)
        for name, summary, params in rows:
            table.add_row(k, escape(name), escape(summary), escape(params))
    Console().print(table)


def _component_rows(kind: str) -> list[tuple[str, str, str]]:
    """(name, summary, parameters) of each registered component of `kind`."""
    rows = []
    for name in reg.registry(kind).names():
        try:
            info = reg.registry(kind).info(name)
            rows.append((name, info.summary, _params_text(info)))
        except ComponentImportError as exc:
            rows.append((name, f"not importable: {exc}", ""))
    return rows


def _model_rows() -> list[tuple[str, str, str]]:
    """The built-in checkpoints (`builtin:NAME`: the trained default shipped with the package,
    or a random one made on first use) and the presets of `oled model init --preset`, each
    with its shape."""
    from oled.model.config import ModelConfig
    from oled.model.presets import PRESETS
    from oled.runtime import shipped_default

    rows = []
    for name in reg.registry("model").names():
        shipped = shipped_default() if name == "tiny" else None
        if shipped is not None:
            summary = f"the trained default, shipped: {_shape(ModelConfig.from_json(shipped))}"
        else:
            summary = f"random init (seed 0), made on first use: {_shape(reg.get('model', name)())}"
        rows.append((f"{BUILTIN}{name}", summary, ""))
    for name, config in PRESETS.items():
        summary = f"random init (oled model init DIR --preset {name}): {_shape(config())}"
        rows.append((f"preset {name}", summary, ""))
    return rows


def _shape(cfg: Any) -> str:
    """A model config's shape in a few words."""
    return (
        f"{cfg.num_hidden_layers} layers ({cfg.first_k_dense_replace} dense), hidden "
        f"{cfg.hidden_size}, {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}"
    )


def cp(
    name: Annotated[str, typer.Argument(help="Shipped recipe name, e.g. quickstart.")],
    dest: Annotated[Path, typer.Argument(help="Destination file or directory.")] = Path("."),
    force: Annotated[
        bool, typer.Option("--force", help="Overwrite a file that differs from the recipe.")
    ] = False,
) -> None:
    """Copy a shipped recipe to edit it (an edited copy is kept unless --force)."""
    recipes = shipped_recipes()
    stem = name.removesuffix(".toml")
    if stem not in recipes:
        raise ValueError(
            f"unknown recipe '{name}'{suggest(stem, recipes)}; shipped: {', '.join(recipes)}"
        )
    target = dest / f"{stem}.toml" if dest.is_dir() else dest
    shipped = recipes[stem].read_bytes()
    if target.is_file() and target.read_bytes() != shipped and not force:
        raise ValueError(
            f"{target} exists and differs from the shipped {stem} recipe: "
            "give --force to overwrite it"
        )
    check_writable(target, "DEST")
    target.write_bytes(shipped)
    typer.echo(str(target))


def run(
    recipe: Annotated[Path, typer.Argument(help="Recipe file.")],
    set_: SetOption = None,
) -> None:
    """Run a recipe: generate, summarise, write a report and plots, log to MLflow."""
    from oled.experiment.run import run_experiment
    from oled.model.parallel import launched, start

    loaded = _load(recipe, set_, require_model=True)  # a missing model: its line
    devices = loaded.runtime.devices
    if devices > 1 and not launched():  # one process per device, each running this command
        from oled.runtime import check_split

        check_split(loaded.model.path, loaded.runtime)
        sets = [a for s in set_ or [] for a in ("--set", s)]
        raise typer.Exit(start(devices, ["run", str(recipe), *sets]))
    run_experiment(loaded)


def tune(
    recipe: Annotated[Path, typer.Argument(help=escape("Recipe file with a [tune] section."))],
    set_: SetOption = None,
    trials: Annotated[int | None, typer.Option(help="Trials for this process.")] = None,
    out: Annotated[Path | None, typer.Option(help="Write the best recipe here.")] = None,
    heartbeat_interval: Annotated[
        int | None,
        typer.Option(help="Seconds between a trial's heartbeats on a database (60; 0: off)."),
    ] = None,
    grace_period: Annotated[
        int | None,
        typer.Option(help="Seconds without a heartbeat before a trial is FAIL (2x the interval)."),
    ] = None,
) -> None:
    """Search the recipe's tune.params with Optuna; several processes may share one study."""
    from oled.experiment.tune import tune_recipe

    loaded = _load(recipe, set_)
    if loaded.tune is None:
        raise _fail(f"{recipe}: no [tune] section")
    if out is not None:
        check_writable(out, "--out")
    try:
        result = tune_recipe(
            loaded,
            trials=trials,
            out=out,
            heartbeat_interval=heartbeat_interval,
            grace_period=grace_period,
        )
    except (ValueError, OSError) as exc:
        raise _fail(str(exc)) from None
    typer.echo(f"best {result.value} {result.params}")
    if out is not None:
        typer.echo(f"best recipe: {out}")


COMMANDS = (validate, ls, cp, run, tune)


def register(app: typer.Typer) -> None:
    """Add the experiment commands to `app` (expected failures as one line: user_errors)."""
    for command in COMMANDS:
        app.command(name=command.__name__)(user_errors(command))
