"""What every command shares: consoles, common options, and turning user errors into one line."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)

ModelOpt = Annotated[
    str, typer.Option("--model", "-m", help="Checkpoint directory or builtin:NAME.")
]
DeviceOpt = Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")]
DtypeOpt = Annotated[str, typer.Option(help="bfloat16, float16 or float32.")]
RecipeOpt = Annotated[
    Path | None, typer.Option("--recipe", "-r", help="TOML recipe (model, budget, policies).")
]
CacheOpt = Annotated[
    int | None,
    typer.Option("--cache-size", help="GPU expert slots per layer (default: all resident)."),
]
BlockOpt = Annotated[int, typer.Option("--block-length", help="Positions per diffusion block.")]
ThresholdOpt = Annotated[float, typer.Option(help="Commit confidence threshold.")]
GraphsOpt = Annotated[
    bool,
    typer.Option(
        "--graphs/--eager",
        help="On CUDA, replay forwards as CUDA graphs (the same tokens); --eager launches "
        "every kernel from Python.",
    ),
]

KernelsOpt = Annotated[
    str | None,
    typer.Option(
        "--kernels",
        help="auto: fused Triton kernels on CUDA where triton imports; triton: insist on them; "
        "torch: plain torch kernels (default: the recipe's, else auto).",
    ),
]


def user_errors(fn):
    """Expected failures (bad input, missing files) -> one red line and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, FileNotFoundError, OSError) as err:
            err_console.print(f"[red]error:[/red] {err}")
            raise typer.Exit(2) from None

    return wrapper
