"""`oled model`: create and inspect checkpoints."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from oled.cli.options import console, user_errors

model_app = typer.Typer(help="Create and inspect checkpoints.", no_args_is_help=True)


@model_app.command("init")
@user_errors
def model_init(
    path: Annotated[Path, typer.Argument(help="Directory to write the checkpoint into.")],
    preset: Annotated[str, typer.Option(help="tiny, small, mini-shape or flash-shape.")] = "tiny",
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
    init_checkpoint(path, preset=preset, seed=seed, device=device, shard_bytes=shard, progress=True)
    files = sorted(p.name for p in path.iterdir())
    console.print(f"wrote {preset} (seed {seed}) to {path} in {time.perf_counter() - t0:.1f} s:")
    console.print("  " + ", ".join(files))


@model_app.command("info")
@user_errors
def model_info(
    model: Annotated[str, typer.Argument(help="Checkpoint directory or builtin:NAME.")],
) -> None:
    """Show a checkpoint's shape, expert sizes and memory needs; check its shards' headers and
    sizes (no weight is read)."""
    from oled.model.checkpoint import check_shards
    from oled.model.config import ModelConfig
    from oled.runtime import resolve_model

    path = resolve_model(model)
    cfg = ModelConfig.from_json(path)
    shards, size = check_shards(path, cfg)
    expert_mib = cfg.expert_params() * 2 / 2**20
    total_experts = cfg.num_moe_layers * cfg.num_experts
    rows = [
        ("path", str(path)),
        (
            "layers",
            f"{cfg.num_hidden_layers} ({cfg.first_k_dense_replace} dense, "
            f"{cfg.num_moe_layers} MoE)",
        ),
        (
            "hidden / heads / kv heads",
            f"{cfg.hidden_size} / {cfg.num_attention_heads} / {cfg.num_key_value_heads}",
        ),
        (
            "experts",
            f"{cfg.num_experts} per layer, top-{cfg.num_experts_per_tok}, "
            f"{cfg.n_group} groups (keep {cfg.topk_group}), "
            f"{cfg.num_shared_experts} shared",
        ),
        ("one expert (bf16)", f"{expert_mib:.2f} MiB"),
        ("all routed experts (bf16)", f"{total_experts * expert_mib / 1024:.2f} GiB"),
        ("shards", f"{shards} ({size / 2**20:.1f} MiB; headers, sizes and shapes checked)"),
    ]
    for key, value in rows:
        console.print(f"{key:>28}: {value}")


def register(app: typer.Typer) -> None:
    """Add `oled model` to the `oled` app."""
    app.add_typer(model_app, name="model")
