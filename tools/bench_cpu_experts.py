"""Time CPU experts as the offload engine computes them (`oled.model.experts.expert_rows`): one
MoE layer's experts of LLaDA2.0-mini's shape in host memory, one to several experts per call,
1-8 tokens each, for some thread counts and weight dtypes.

Usage: python tools/bench_cpu_experts.py [--experts 64] [--threads 1,4,8,16] [--pin]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oled.model.config import mini_config  # noqa: E402
from oled.model.experts import expert_rows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--experts", type=int, default=64, help="experts in the layer (distinct weights)"
    )
    ap.add_argument("--threads", default=f"1,4,{os.cpu_count()}")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--pin", action="store_true", help="pinned host memory, as when serving CUDA")
    ap.add_argument("--repeat", type=int, default=40)
    args = ap.parse_args()
    cfg = mini_config()
    h, i, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, mkldnn bf16: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}"
    )
    print(
        f"{'dtype':9s} {'threads':>7s} {'experts':>7s} {'tokens':>6s} {'ms/call':>8s} "
        f"{'ms/expert':>9s} {'GB/s':>6s}"
    )
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        w13 = torch.randn(args.experts, 2 * i, h).to(dtype)
        w2 = torch.randn(args.experts, h, i).to(dtype)
        if args.pin:
            w13, w2 = w13.pin_memory(), w2.pin_memory()
        nbytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
        for threads in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(threads)
            for n_experts, tokens in [(1, 1), (1, 2), (1, 8), (4, 1), (4, 2)]:
                ms = time_call(w13, w2, n_experts, tokens, k, args.repeat)
                gbs = n_experts * nbytes / ms / 1e6
                print(
                    f"{str(dtype)[6:]:9s} {threads:7d} {n_experts:7d} {tokens:6d} {ms:8.3f} "
                    f"{ms / n_experts:9.3f} {gbs:6.1f}",
                    flush=True,
                )


def time_call(w13, w2, n_experts: int, tokens: int, k: int, repeat: int) -> float:
    """ms per expert_rows call: `tokens` tokens routed to each of `n_experts` experts (other
    experts each call, so their weights come from memory, not from the CPU's caches)."""
    e = w13.shape[0]
    t = n_experts * tokens  # one pair per token here: slot of pair 0, -1 elsewhere
    x = torch.randn(t, w13.shape[2]).to(w13.dtype)
    weights = torch.rand(t, k)
    total = 0.0
    for r in range(repeat + 2):
        first = (r * n_experts) % (e - n_experts + 1)
        slots = torch.full((t, k), -1, dtype=torch.long)
        slots[:, 0] = first + torch.arange(t) // tokens
        t0 = time.perf_counter()
        with torch.inference_mode():
            expert_rows(x, slots, weights, w13, w2)
        if r >= 2:
            total += time.perf_counter() - t0
    return 1000 * total / repeat


if __name__ == "__main__":
    main()
