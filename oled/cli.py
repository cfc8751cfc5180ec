"""The `oled` command line."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    name="oled",
    help="OLED-MoE: run MoE diffusion language models (LLaDA2) on GPUs too small for all experts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
model_app = typer.Typer(help="Create and inspect checkpoints.", no_args_is_help=True)
app.add_typer(model_app, name="model")
from oled.options import DeviceOpt, DtypeOpt, ModelOpt, console, err_console, user_errors  # noqa: E402


@app.command()
@user_errors
def generate(
    prompt: Annotated[str, typer.Argument(help="The question or text to continue.")],
    model: ModelOpt = "builtin:tiny",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "bfloat16",
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens to generate.")] = 64,
    block_length: Annotated[int, typer.Option(help="Positions per diffusion block.")] = 32,
    threshold: Annotated[float, typer.Option(help="Commit confidence threshold.")] = 0.95,
    temperature: Annotated[float, typer.Option(help="0 = greedy; > 0 samples.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    raw: Annotated[bool, typer.Option("--raw", help="No chat format: continue the text.")] = False,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Recompute the prefix.")] = False,
) -> None:
    """Generate an answer, streaming each finished block, then print decoding statistics."""
    from oled.decoding import DecodeConfig
    from oled.runtime import load_runtime

    decode = DecodeConfig(
        block_length=block_length,
        threshold=threshold,
        max_new_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        use_cache=not no_cache,
    )
    t0 = time.perf_counter()
    rt = load_runtime(model, device=device, dtype=dtype, decode=decode, progress=True)
    err_console.print(
        f"[dim]loaded {rt.checkpoint.path} on {rt.device} in {time.perf_counter() - t0:.1f} s[/dim]"
    )
    ids = rt.prompt_ids(prompt, chat=not raw)
    for block in rt.stream(ids):
        sys.stdout.write(rt.tokenizer.decode(block.new_tokens))
        sys.stdout.flush()
    sys.stdout.write("\n")
    print_stats(rt.last_stats)


def print_stats(stats) -> None:
    from oled.decoding.decoder import median_p90

    median, _ = median_p90(stats.decode_ms)
    err_console.print(
        f"[dim]{stats.new_tokens} tokens, {stats.iterations} forwards, "
        f"{stats.tokens_per_forward:.2f} tokens/forward, "
        f"prompt forward {stats.prompt_ms or 0.0:.1f} ms, "
        f"{median:.1f} ms/iteration after it (median), "
        f"{stats.tokens_per_second:.1f} tokens/s, finish: {stats.stopped}[/dim]"
    )


@model_app.command("init")
@user_errors
def model_init(
    path: Annotated[Path, typer.Argument(help="Directory to write the checkpoint into.")],
    preset: Annotated[str, typer.Option(help="tiny, small or mini-shape.")] = "tiny",
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    device: Annotated[
        str, typer.Option(help="Where to draw the weights (cuda is faster).")
    ] = "cpu",
    shard_size: Annotated[
        str, typer.Option(help="Shard size, e.g. 2GiB, 4MiB; 'single' = one file.")
    ] = "2GiB",
) -> None:
    """Write a random-initialised checkpoint in the exact LLaDA2 layout."""
    from oled.model.presets import init_checkpoint

    if path.exists() and any(path.iterdir()):
        raise ValueError(f"{path}: directory is not empty")
    from oled.recipe import parse_size

    shard = None if shard_size == "single" else parse_size(shard_size)
    t0 = time.perf_counter()
    init_checkpoint(path, preset=preset, seed=seed, device=device, shard_bytes=shard)
    files = sorted(p.name for p in path.iterdir())
    console.print(f"wrote {preset} (seed {seed}) to {path} in {time.perf_counter() - t0:.1f} s:")
    console.print("  " + ", ".join(files))


@model_app.command("info")
@user_errors
def model_info(model: Annotated[str, typer.Argument(help="Checkpoint directory or builtin:NAME.")]):
    """Show a checkpoint's shape, expert sizes and memory needs."""
    from oled.model.config import ModelConfig
    from oled.runtime import resolve_model

    path = resolve_model(model)
    cfg = ModelConfig.from_json(path)
    expert_mib = cfg.expert_params() * 2 / 2**20
    total_experts = cfg.num_moe_layers * cfg.num_experts
    rows = [
        ("path", str(path)),
        ("layers", f"{cfg.num_hidden_layers} ({cfg.first_k_dense_replace} dense, "
                   f"{cfg.num_moe_layers} MoE)"),
        ("hidden / heads / kv heads", f"{cfg.hidden_size} / {cfg.num_attention_heads} / "
                                      f"{cfg.num_key_value_heads}"),
        ("experts", f"{cfg.num_experts} per layer, top-{cfg.num_experts_per_tok}, "
                    f"{cfg.n_group} groups (keep {cfg.topk_group}), "
                    f"{cfg.num_shared_experts} shared"),
        ("one expert (bf16)", f"{expert_mib:.2f} MiB"),
        ("all routed experts (bf16)", f"{total_experts * expert_mib / 1024:.2f} GiB"),
    ]  # fmt: skip
    for key, value in rows:
        console.print(f"{key:>28}: {value}")


def _register_commands() -> None:
    from oled import commands as using
    from oled.experiment import commands as experiment
    from oled.trace import commands as trace

    using.register(app)
    experiment.register(app)
    trace.register(app)


_register_commands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
