"""Evidence for docs/default-model.md: loss plot, sample answers and routing statistics.

Routing is measured while the block decoder runs (32-token blocks, prefix cache, threshold
0.95), on the trained default model and on a random-initialised model of the same shape
(`random_tensors`, seed 0: unit-variance embeddings, std 0.02 elsewhere), over the same prompts.

    python tools/report_default.py --history runs/default-cpu/history.json \
        --plot docs/default-model-loss.png --json docs/default-model-stats.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from oled.decoding import DecodeConfig, DecodeObserver
from oled.model.checkpoint import save_checkpoint
from oled.model.config import ModelConfig
from oled.model.presets import random_tensors
from oled.model.tokenizer import Tokenizer
from oled.runtime import load_runtime

PROMPTS = [
    "Who wrote Hamlet?",
    "What does the Bible say about love?",
    "Quote a verse from Genesis.",
    "What does Hamlet say in Hamlet?",
    "Continue: In the beginning God created the heaven and the earth.",
    "Which book comes after Exodus?",
    "What is the capital of France?",
    "Write a haiku about the sea.",
]
BUCKETS = [(0.0, 0.3), (0.3, 0.6), (0.6, 0.9), (0.9, 1.01)]


def default_dir() -> Path:
    return Path(str(resources.files("oled").joinpath("data/default")))


class RoutingStats(DecodeObserver):
    """Per iteration and MoE layer, the experts of the block's positions; per position, the
    confidence the decoder saw, to relate routing stability to confidence.

    `topk_kept_by_confidence`: the share of a position's top-k experts that it keeps from one
    iteration to the next, for positions fixed before the iteration (prompt or committed
    earlier), positions committed by the iteration (their input changes from the mask to the
    token), and positions still masked, bucketed by the confidence the iteration gave them."""

    def __init__(self, model, block_length: int) -> None:
        self.bl = block_length
        self.current: dict[int, np.ndarray] = {}
        self.iters: list[dict] = []  # {block, layers: {l: ids [L, K]}, masked, conf}
        self.remove = model.add_routing_hook(self._hook)

    def _hook(self, layer: int, ids, weights) -> None:
        self.current[layer] = ids[-self.bl :].cpu().numpy()

    def on_iteration(self, info) -> None:
        self.iters.append(
            {
                "key": (id(self), info.block_start),
                "layers": dict(self.current),
                "masked": info.masked.cpu().numpy(),
                "conf": info.confidence.float().cpu().numpy(),
                "committed": info.committed.cpu().numpy(),
            }
        )
        self.current = {}

    def on_generation_start(self, prompt_length: int) -> None:
        self.generation = getattr(self, "generation", -1) + 1

    def summary(self, num_experts: int) -> dict:
        distinct, jaccard = defaultdict(list), defaultdict(list)
        same_by_conf: dict[str, list[float]] = defaultdict(list)
        for i, it in enumerate(self.iters):
            for layer, ids in it["layers"].items():
                distinct[layer].append(len(np.unique(ids)))
            if i == 0:
                continue
            prev = self.iters[i - 1]
            if prev["key"] != it["key"]:
                continue  # a new block: not adjacent iterations of one block
            for layer, ids in it["layers"].items():
                a, b = set(prev["layers"][layer].ravel()), set(ids.ravel())
                jaccard[layer].append(len(a & b) / len(a | b))
                p_ids = prev["layers"][layer]
                for pos in range(ids.shape[0]):
                    keep = len(set(p_ids[pos]) & set(ids[pos])) / ids.shape[1]
                    if not prev["masked"][pos]:
                        same_by_conf["fixed"].append(keep)
                        continue
                    if prev["committed"][pos]:
                        same_by_conf["just committed"].append(keep)
                        continue
                    c = prev["conf"][pos]
                    for lo, hi in BUCKETS:
                        if lo <= c < hi:
                            same_by_conf[f"{lo:.1f}-{min(hi, 1.0):.1f}"].append(keep)
        layers = sorted(distinct)
        committed = sum(int(it["committed"].sum()) for it in self.iters)
        return {
            "iterations": len(self.iters),
            "committed_per_forward": committed / max(1, len(self.iters)),
            "distinct_per_layer": [float(np.mean(distinct[x])) for x in layers],
            "distinct_mean": float(np.mean([np.mean(distinct[x]) for x in layers])),
            "jaccard_per_layer": [float(np.mean(jaccard[x])) for x in layers if jaccard[x]],
            "jaccard_mean": float(np.mean([np.mean(jaccard[x]) for x in layers if jaccard[x]]))
            if any(jaccard.values())
            else float("nan"),
            "topk_kept_by_confidence": {
                k: {"mean": float(np.mean(v)), "n": len(v)} for k, v in sorted(same_by_conf.items())
            },
            "num_experts": num_experts,
        }


def measure(path: Path, prompts: list[str], max_new_tokens: int) -> dict:
    torch.manual_seed(0)
    rt = load_runtime(str(path), device="cpu", dtype="bfloat16")
    decode = DecodeConfig(max_new_tokens=max_new_tokens)
    stats = RoutingStats(rt.model, decode.block_length)
    answers, seconds = [], 0.0
    usage = np.zeros((rt.config.num_moe_layers, rt.config.num_experts))
    count = rt.model.add_routing_hook(
        lambda layer, ids, w: np.add.at(usage[layer], ids.cpu().numpy().ravel(), 1)
    )
    for prompt in prompts:
        ids = rt.prompt_ids(prompt, chat=True)
        out: list[int] = []
        t0 = time.perf_counter()
        for block in rt.stream(ids, decode=decode, observers=[stats]):
            out += block.new_tokens
        seconds += time.perf_counter() - t0
        st = rt.last_stats
        answers.append(
            {
                "prompt": prompt,
                "answer": rt.tokenizer.decode(out),
                "tokens": st.new_tokens,
                "iterations": st.iterations,
                "seconds": time.perf_counter() - t0,
            }
        )
    stats.remove()
    count()
    summary = stats.summary(rt.config.num_experts)
    summary["experts_ever_used_per_layer"] = [int((u > 0).sum()) for u in usage]
    summary["seconds"] = seconds
    return {"answers": answers, "routing": summary}


def random_twin(trained: Path, out: Path) -> Path:
    cfg = ModelConfig.from_json(trained)
    return save_checkpoint(
        out,
        config=cfg,
        tensors=random_tensors(cfg, seed=0),
        tokenizer=Tokenizer.from_dir(trained),
        shard_bytes=None,
    )


def plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.plot(steps, [r["val_loss"] for r in history], label="validation loss (1/t-weighted ELBO)")
    ax.plot(steps, [r["val_ce"] for r in history], label="validation CE on masked tokens")
    ax.plot(steps, [r["train_loss"] for r in history], alpha=0.4, label="training loss (batch)")
    ax.set_xlabel("step")
    ax.set_ylabel("nats per token")
    ax.set_title("Default model: masked-diffusion training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(default_dir()))
    ap.add_argument("--history")
    ap.add_argument("--plot")
    ap.add_argument("--json")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.history and args.plot:
        plot(json.loads(Path(args.history).read_text()), Path(args.plot))
    trained = Path(args.model)
    result = {"trained": measure(trained, PROMPTS, args.max_new_tokens)}
    with tempfile.TemporaryDirectory() as tmp:
        result["random"] = measure(random_twin(trained, Path(tmp)), PROMPTS, args.max_new_tokens)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
