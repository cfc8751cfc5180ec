"""What every command shares: consoles, common options, and turning user errors into one line."""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ParamSpec, TextIO, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from oled.recipe.schema import DECODING, DEFAULT_MODEL, RUNTIME

if TYPE_CHECKING:
    from oled.recipe import Recipe
    from oled.runtime import Runtime

P = ParamSpec("P")
R = TypeVar("R")

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)

ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help=f"Checkpoint directory or builtin:NAME (default: the recipe's, else {DEFAULT_MODEL}).",
    ),
]
DeviceOpt = Annotated[
    str | None,
    typer.Option(help=f"auto, cpu, cuda or cuda:N (default: the recipe's, else {RUNTIME.device})."),
]
DtypeOpt = Annotated[
    str | None,
    typer.Option(
        help=f"bfloat16, float16 or float32 (default: the recipe's, else {RUNTIME.dtype})."
    ),
]
RecipeOpt = Annotated[
    Path | None,
    typer.Option(
        "--recipe",
        "-r",
        help="TOML recipe (model, budget, policies, decoding); the other flags override it.",
    ),
]
CacheOpt = Annotated[
    int | None,
    typer.Option(
        "--cache-size",
        help="GPU expert slots per MoE layer (per device with runtime.devices > 1), with "
        "the recipe's policies, else OLED's (default: the recipe's budget, else all resident).",
    ),
]
BlockOpt = Annotated[
    int | None,
    typer.Option(
        "--block-length",
        help=f"Positions per diffusion block (default: the recipe's, else {DECODING.block_length}).",
    ),
]
ThresholdOpt = Annotated[
    float | None,
    typer.Option(
        help=f"Commit confidence threshold (default: the recipe's, else {DECODING.threshold})."
    ),
]
StepsOpt = Annotated[
    int | None,
    typer.Option(
        "--steps",
        help="Denoising steps per block: at least block-length / steps commits per forward, "
        "as LLaDA2's own generate (default: the recipe's, else at least one a forward).",
    ),
]
MaxTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--max-tokens",
        help=f"Tokens to generate (default: the recipe's, else {DECODING.max_new_tokens}).",
    ),
]
TemperatureOpt = Annotated[
    float | None,
    typer.Option(
        help=f"0 = greedy; > 0 samples (default: the recipe's, else {DECODING.temperature:g})."
    ),
]
SeedOpt = Annotated[
    int | None, typer.Option(help=f"Sampling seed (default: the recipe's, else {DECODING.seed}).")
]
GraphsOpt = Annotated[
    bool | None,
    typer.Option(
        "--graphs/--eager",
        help="On CUDA, replay forwards as CUDA graphs (the same tokens); --eager launches "
        "every kernel from Python (default: the recipe's, else "
        f"{'graphs' if RUNTIME.cuda_graphs else 'eager'}).",
    ),
]
KernelsOpt = Annotated[
    str | None,
    typer.Option(
        "--kernels",
        help="auto: fused Triton kernels on CUDA where triton imports; triton: insist on them; "
        f"torch: plain torch kernels (default: the recipe's, else {RUNTIME.kernels}).",
    ),
]
TransferOpt = Annotated[
    str | None,
    typer.Option(
        "--transfer",
        help="How misses cross the link: plain (bf16 rows), lossless (encoded, the same tokens, "
        "about 68% of the bytes), fp8 or int4 (lossy: about 50% or 27% of the bytes, other "
        "tokens) (default: "
        f"the recipe's, else {RUNTIME.transfer}).",
    ),
]

PrefillChunkOpt = Annotated[
    int | None,
    typer.Option(
        "--prefill-chunk",
        help="A prompt's tokens per batched forward while other requests decode, in whole "
        "blocks, so they keep decoding while it is taken in (0: the whole prompt in one forward; "
        f"default: the recipe's runtime.prefill_chunk, else {RUNTIME.prefill_chunk}).",
    ),
]


def command_spec(recipe: Path | None, model: str | None, **flags: Any) -> Recipe:
    """The recipe a command builds its runtime from: its flags (oled.recipe.Flags' fields; a
    flag left out is None) over `recipe` over the schema's defaults (command_recipe), checked
    now against this machine (oled.runtime.check)."""
    from oled.recipe import Flags, command_recipe
    from oled.runtime import check

    spec = command_recipe(recipe, Flags(model=model, **flags))
    check(spec)
    return spec


def load(spec: Recipe, *, progress: bool = False) -> Runtime:
    """The runtime of a command's spec (oled.runtime.build); says what loaded, where, how fast."""
    import time

    from oled.runtime import build

    t0 = time.perf_counter()
    rt = build(spec, progress=progress)
    err_console.print(
        f"[dim]loaded {rt.checkpoint.path} on {rt.device} in {time.perf_counter() - t0:.1f} s[/dim]"
    )
    return rt


def fail(message: str) -> typer.Exit:
    """Print `message` as one red `error:` line on stderr (as text: brackets in it stay); the
    exit (code 2) to raise."""
    err_console.print(f"[red]error:[/red] {escape(message)}")
    return typer.Exit(2)


def at_least(low: int, **flags: int) -> None:
    """ValueError naming the first flag (`--gen-length` for gen_length) whose value is below
    `low`, before any work."""
    for name, value in flags.items():
        if value < low:
            raise ValueError(f"--{name.replace('_', '-')}: must be at least {low} (got {value})")


def show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """A warning as one yellow `warning:` line on stderr (warnings.showwarning's signature)."""
    err_console.print(f"[yellow]warning:[/yellow] {escape(str(message))}")


def user_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Expected failures (bad input, missing files, what this machine lacks: ValueError and
    OSError) -> one red line and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (ValueError, OSError) as err:
            raise fail(str(err)) from None

    return wrapper


def check_writable(path: Path, flag: str) -> Path:
    """`path`, checked before any work to be a file this process can create or replace (its
    folder exists and takes a new file); ValueError naming `flag` otherwise."""
    folder = path.parent
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory, not a file")
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: no such directory {folder}")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot write in {folder} ({err.strerror})") from None
    return path


def save_or_keep(save: Callable[[Path], object], path: Path, what: str) -> None:
    """`save(path)`; should that fail, `save` to a new file in the temporary directory and
    raise an OSError that says where `what` is kept (nothing computed is lost)."""
    try:
        save(path)
    except Exception as err:  # the writers raise their own error types for OSErrors too
        problem = getattr(err, "strerror", None) or str(err)
        fd, kept = tempfile.mkstemp(prefix=f"{path.stem}-", suffix=path.suffix)
        os.close(fd)
        try:
            save(Path(kept))
        except Exception:
            os.unlink(kept)
            raise err from None
        raise OSError(
            f"cannot write {path} ({problem}); the {what} is kept at {kept} instead"
        ) from None
