"""Per-stage floors on one GPU at LLaDA2.0-mini's shapes: each stage replayed as a CUDA graph.

Times one MoE layer's pieces in isolation (attention at a given prefix, routing, RMSNorm, the
grouped expert GEMM pair over a 256-slot table at several numbers of distinct experts, combine),
each with the plain torch kernels and with the fused Triton kernels (oled.kernels), and the
pinned host -> device copy rate of expert weights, so a forward's measured time can be read
against what its parts cost alone. Random weights; prints a table and writes JSON.

    python tools/bench_kernels.py --out reports/kernels.json [--kernels torch,auto]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oled import kernels  # noqa: E402
from oled.model.config import mini_config  # noqa: E402
from oled.model.experts import combine, expert_pairs  # noqa: E402
from oled.model.layers import Attention, BlockCausal, RMSNorm, Rotary, Router  # noqa: E402
from oled.model.model import BatchRows  # noqa: E402
from oled.offload import copies  # noqa: E402
from oled.offload.copies import Rows  # noqa: E402


def graph_ms(fn, *args, replays: int = 200) -> float:
    """Milliseconds per replay of `fn(*args)` captured as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*args)  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def routing_with(distinct: int, t: int, k: int, experts: int, gen) -> torch.Tensor:
    """Ids [T, K]: each token picks k different experts among the first `distinct`."""
    pool = torch.randperm(experts, generator=gen)[:distinct]
    picks = torch.stack([torch.randperm(distinct, generator=gen)[:k] for _ in range(t)])
    return pool[picks].cuda()


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="reports/kernels.json")
    ap.add_argument("--kernels", default="torch,auto", help="kernel modes to time, in order")
    ap.add_argument("--copies-only", action="store_true", help="only the copy rates")
    args = ap.parse_args()
    rows: list[tuple[str, float]] = []
    for mode in [] if args.copies_only else args.kernels.split(","):
        kernels.use(mode)
        tag = f" [{kernels.describe(torch.device('cuda'))}]"
        rows += [(name + tag, ms) for name, ms in stage_rows()]
    kernels.use("auto")
    rows += copy_rows()
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value:8.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(rows), indent=1) + "\n")


def stage_rows() -> list[tuple[str, float]]:
    """Milliseconds per stage at the mini shapes, with the kernels `oled.kernels` picks now."""
    cfg = mini_config()
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    h, e, k, inter = (
        cfg.hidden_size,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.moe_intermediate_size,
    )
    rows: list[tuple[str, float]] = []
    w13 = torch.randn(e, 2 * inter, h, device=dev, dtype=dt) * 0.02
    w2 = torch.randn(e, h, inter, device=dev, dtype=dt) * 0.02
    expert_gb = (w13[0].numel() + w2[0].numel()) * w13.element_size() / 1e9
    for t in (32, 64, 256):  # one block of 32 rows; two; 8 streams' blocks side by side
        x = torch.randn(t, h, device=dev, dtype=dt)
        w = torch.rand(t, k, device=dev)
        for distinct in (8, 32, 64, 128, 256):
            if distinct < k or (t == 256 and distinct < 128):
                continue
            ids = routing_with(distinct, t, k, e, gen)
            ms = graph_ms(expert_pairs, x, ids, w, w13, w2)
            rows.append((f"grouped GEMM pair, {t} tokens, {distinct} distinct of 256", ms))
            if distinct == 256:  # the weights of the experts it touches, against its time
                touched = ids.unique().numel()
                rate = touched * expert_gb / ms * 1e3
                rows.append((f"  {touched} experts' weights read, GB/s ({t} tokens)", rate))
        pairs = torch.randn(t, k, h, device=dev)
        rows.append((f"combine, {t} tokens", graph_ms(combine, pairs, dt)))

    big = torch.ones(2**30, device=dev, dtype=dt)  # 2 GiB
    rows.append(
        (
            "HBM read, GB/s (a sum over 2 GiB)",
            big.nbytes / graph_ms(torch.sum, big, replays=20) / 1e6,
        )
    )
    del big

    router = Router(cfg).to(dev)
    router.weight.data.normal_(0, 0.02)
    x = torch.randn(32, h, device=dev, dtype=dt)
    rows.append(("routing (group-limited top-8), 32 tokens", graph_ms(router, x)))
    norm = RMSNorm(h, eps=cfg.rms_norm_eps).to(dev, dt)
    rows.append(("RMSNorm, 32 tokens", graph_ms(norm, x)))

    attn = Attention(cfg).to(dev, dt)
    rotary = Rotary(dim=cfg.rotary_dim, theta=cfg.rope_theta)
    for prefix in (512, 2048):
        kbuf = torch.randn(
            1, cfg.num_key_value_heads, prefix + 32, cfg.head_dim, device=dev, dtype=dt
        )
        vbuf = torch.randn_like(kbuf)
        xa = torch.randn(1, 32, h, device=dev, dtype=dt)
        cos, sin = rotary.cos_sin(torch.arange(prefix, prefix + 32, device=dev), dt)
        ms = graph_ms(attn, xa, rotary, cos, sin, (kbuf, vbuf), prefix, None)
        rows.append((f"attention layer, 32 tokens over prefix {prefix}", ms))
    for streams in (8, 16):
        ms = graph_ms(*batched_attention(attn, rotary, streams, 512))
        rows.append((f"attention layer, {streams} streams' blocks over prefix 512 each", ms))
    return rows


def batched_attention(attn: Attention, rotary: Rotary, streams: int, prefix: int) -> tuple:
    """A batched forward's attention call (oled.model.model.BatchRows): `streams` decode blocks
    of 32 rows side by side, each over its own KV slot's `prefix` keys; (fn, *args) to time."""
    cfg, dev, dt = mini_config(), torch.device("cuda"), torch.bfloat16
    shape = (streams, cfg.num_key_value_heads, 1024, cfg.head_dim)  # a batch cache's slots
    kbuf = torch.randn(shape, device=dev, dtype=dt)
    vbuf = torch.randn_like(kbuf)
    rows = BatchRows.build(
        list(range(streams)),
        [prefix] * streams,
        [32] * streams,
        [0] * streams,
        keys=prefix + 32,
        device=dev,
    )
    x = torch.randn(1, 32 * streams, cfg.hidden_size, device=dev, dtype=dt)  # [1, T, H]
    cos, sin = rotary.cos_sin(rows.positions, dt)
    return attn, x, rotary, cos, sin, (kbuf, vbuf), rows, BlockCausal(rows, 32)


def copy_rows() -> list[tuple[str, float]]:
    """GB/s of pinned host -> device copies of 64 mini experts, per tensor and as 2 copies."""
    cfg = mini_config()
    dev, dt, h, inter = (
        torch.device("cuda"),
        torch.bfloat16,
        cfg.hidden_size,
        cfg.moe_intermediate_size,
    )
    rows: list[tuple[str, float]] = []
    host13 = torch.randn(64, 2 * inter, h, dtype=dt).pin_memory()
    host2 = torch.randn(64, h, inter, dtype=dt).pin_memory()
    dst13, dst2 = torch.empty_like(host13, device=dev), torch.empty_like(host2, device=dev)
    nbytes = host13.numel() * 2 + host2.numel() * 2
    stream = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    src, dst = Rows.of(host13, host2), Rows.of(dst13, dst2)
    every = list(range(64))
    for label, launch in (
        (
            "64 experts, 128 copies",
            lambda: torch._foreach_copy_([*dst13, *dst2], [*host13, *host2], non_blocking=True),
        ),
        (
            "64 experts, 128 copies through the runtime",
            lambda: copies.launch(src, dst, every, every, stream),
        ),
        (
            "64 experts, 2 copies",
            lambda: (dst13.copy_(host13, non_blocking=True), dst2.copy_(host2, non_blocking=True)),
        ),
    ):
        with torch.cuda.stream(stream):
            launch()
            stream.synchronize()
            host_s = time.perf_counter()
            launch()  # onto an idle stream: the host time of the launches alone
            host_s = time.perf_counter() - host_s
            start.record()
            for _ in range(5):
                launch()
            end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / 5
        rows.append((f"pinned copy, {label}: GB/s", nbytes / ms / 1e6))
        if "128" in label:
            rows.append((f"pinned copy, {label}: host µs per copy", 1e6 * host_s / 128))
    return rows + launch_rows(src, dst, stream)


def launch_rows(src: Rows, dst: Rows, stream: torch.cuda.Stream) -> list[tuple[str, float]]:
    """Host µs of one `copies.launch` of n experts (median of 30 onto an idle stream), one
    batched call against one call per expert and table, and the copy rate of each."""
    rows: list[tuple[str, float]] = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for batched in (True, False):
        copies.use_batches(batched)
        mode = "batched" if batched else "one call each"
        for n in (1, 2, 4, 8, 16, 32):
            experts = np.arange(n)
            spent = []
            for _ in range(30):
                stream.synchronize()
                t0 = time.perf_counter()
                copies.launch(src, dst, experts, experts, stream)
                spent.append(time.perf_counter() - t0)
            rows.append((f"launch {n} experts, {mode}: host µs", 1e6 * float(np.median(spent))))
        with torch.cuda.stream(stream):
            start.record()
            copies.launch(src, dst, np.arange(32), np.arange(32), stream)
            end.record()
        end.synchronize()
        gb = 32 * (src.size[0] + src.size[1]) / start.elapsed_time(end) / 1e6
        rows.append((f"launch 32 experts, {mode}: GB/s", gb))
    copies.use_batches(True)
    return rows


if __name__ == "__main__":
    main()
