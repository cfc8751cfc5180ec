"""Typer commands of the experiment framework: validate, ls, cp, run, tune.

`register(app)` adds them to the `oled` command-line app.
"""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from oled import registry as reg
from oled.recipe import RecipeError, load_recipe
from oled.registry import ComponentImportError, UnknownComponentError, suggest

SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a recipe key: a.b=value (TOML value, else text)."),
]


def _fail(message: str) -> typer.Exit:
    Console(stderr=True).print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code=2)


def _load(path: Path, overrides: list[str] | None) -> Any:
    try:
        return load_recipe(path, overrides or [])
    except RecipeError as exc:
        raise _fail(str(exc)) from None


def shipped_recipes() -> dict[str, Path]:
    """Recipes shipped with the package, by name."""
    data = Path(str(resources.files("oled") / "data"))
    return {p.stem: p for p in sorted(data.glob("*.toml"))}


def validate(
    files: Annotated[list[Path], typer.Argument(help="Recipe files.")],
    set_: SetOption = None,
) -> None:
    """Validate recipes; print each one's hash, or the first error of each."""
    failed = 0
    for path in files:
        try:
            recipe = load_recipe(path, set_ or [])
        except RecipeError as exc:
            Console(stderr=True).print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
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
    """List registered components and their parameters."""
    try:
        kinds = [reg.registry(kind).kind] if kind else list(reg.KINDS)
    except UnknownComponentError as exc:
        raise _fail(str(exc)) from None
    table = Table(title="components")
    for column in ("kind", "name", "summary", "parameters"):
        table.add_column(column)
    for k in kinds:
        for name in reg.registry(k).names():
            try:
                info = reg.registry(k).info(name)
                table.add_row(k, name, info.summary, _params_text(info))
            except ComponentImportError as exc:
                table.add_row(k, name, f"[dim]not importable: {exc}[/dim]", "")
    Console().print(table)


def cp(
    name: Annotated[str, typer.Argument(help="Shipped recipe name, e.g. quickstart.")],
    dest: Annotated[Path, typer.Argument(help="Destination file or directory.")] = Path("."),
) -> None:
    """Copy a shipped recipe to edit it."""
    recipes = shipped_recipes()
    stem = name.removesuffix(".toml")
    if stem not in recipes:
        raise _fail(
            f"unknown recipe '{name}'{suggest(stem, recipes)}; shipped: {', '.join(recipes)}"
        )
    target = dest / f"{stem}.toml" if dest.is_dir() else dest
    shutil.copyfile(recipes[stem], target)
    typer.echo(str(target))


def run(
    recipe: Annotated[Path, typer.Argument(help="Recipe file.")],
    set_: SetOption = None,
) -> None:
    """Run a recipe: generate, summarise, write a report and plots, log to MLflow."""
    from oled.experiment.run import run_experiment

    loaded = _load(recipe, set_)
    try:
        run_experiment(loaded)
    except (ValueError, OSError) as exc:
        raise _fail(str(exc)) from None


def tune(
    recipe: Annotated[Path, typer.Argument(help="Recipe file with a [tune] section.")],
    set_: SetOption = None,
    trials: Annotated[int | None, typer.Option(help="Trials for this process.")] = None,
    out: Annotated[Path | None, typer.Option(help="Write the best recipe here.")] = None,
) -> None:
    """Search the recipe's tune.params with Optuna; several processes may share one study."""
    from oled.experiment.tune import tune_recipe

    loaded = _load(recipe, set_)
    if loaded.tune is None:
        raise _fail(f"{recipe}: no [tune] section")
    result = tune_recipe(loaded, trials=trials, out=out)
    typer.echo(f"best {result.value} {result.params}")
    if out is not None:
        typer.echo(f"best recipe: {out}")


COMMANDS = (validate, ls, cp, run, tune)


def register(app: typer.Typer) -> None:
    """Add the experiment commands to `app`."""
    for command in COMMANDS:
        app.command(name=command.__name__)(command)
