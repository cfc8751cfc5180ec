"""CPU experts as the offload engine computes them beside a GPU (`expert_rows(native=True)`), in GB/s of
expert weights: the C kernel (oled.kernels.cpu) against torch's products, per token count per
expert, experts per call and thread count; the host's read bandwidth beside them; and, on a CUDA
machine, both again while pinned copies to the GPU run at full rate.

One MoE layer of LLaDA2.0-mini's shape (256 experts, 1.6 GB in bf16) in pinned host memory; each
call takes other experts than the last, so their weights come from memory, not from the caches.
Beside each thread count, the ceiling: a plain read of the same experts' bytes, 8 a call, on the C
kernel's threads (`cpu.read`).

Usage: python tools/bench_cpu_experts.py [--threads 1,4,8,16] [--tokens 1,2,4,8,16,32,64]
    [--kernels auto,torch] [--no-copies] [--out FILE.json]
e.g. the C kernel alone, cold experts, 1 and 2 threads:
    python tools/bench_cpu_experts.py --threads 1,2 --tokens 1,2,4,8 --per-call 8 --kernels auto
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oled.env import cpu_flags  # noqa: E402
from oled.kernels import cpu  # noqa: E402
from oled.model.config import mini_config  # noqa: E402
from oled.model.experts import expert_rows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=256, help="experts in the layer")
    ap.add_argument("--threads", default=f"1,4,{os.cpu_count()}")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64", help="tokens per expert")
    ap.add_argument("--per-call", default="1,8", help="experts per call")
    ap.add_argument("--seconds", type=float, default=0.3, help="timed per row")
    ap.add_argument("--kernels", default="auto,torch", help="auto: the C kernel; torch")
    ap.add_argument("--no-copies", action="store_true", help="skip the rows beside GPU copies")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cfg = mini_config()
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    pin = torch.cuda.is_available()
    w13 = torch.empty(args.experts, 2 * i, h, dtype=torch.bfloat16, pin_memory=pin)
    w2 = torch.empty(args.experts, h, i, dtype=torch.bfloat16, pin_memory=pin)
    w13.normal_(0, 0.02), w2.normal_(0, 0.02)
    flags = cpu_flags()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs ({' '.join(isa)}), "
        f"torch {torch.__version__}, C kernel: {cpu.unsupported(w13[0, 0], w13, w2) or 'built'}"
    )
    rows: list[dict[str, object]] = []
    threads = [int(t) for t in args.threads.split(",")]
    for t in threads:
        rows.append({"what": "host read", "threads": t, "gbs": read_bandwidth(t, args.seconds)})
        print(f"host read, {t} threads: {rows[-1]['gbs']:.1f} GB/s", flush=True)
        if cpu.unsupported(w13[0, 0], w13, w2) is None:
            gbs = same_bytes(w13, w2, t, 8, args.seconds)
            rows.append({"what": "expert bytes read", "threads": t, "experts": 8, "gbs": gbs})
            print(f"read of 8 experts' weights a call, {t} threads: {gbs:.1f} GB/s", flush=True)
    print(
        f"{'kernel':6s} {'threads':>7s} {'experts':>7s} {'tokens':>6s} {'ms/expert':>9s} {'GB/s':>6s}"
    )
    grid = [
        (e, n) for e in map(int, args.per_call.split(",")) for n in map(int, args.tokens.split(","))
    ]
    modes = args.kernels.split(",")
    for mode in modes:
        for t in threads:
            for per_call, tokens in grid:
                rows.append(timed(w13, w2, mode, t, per_call, tokens, args.seconds))
    if torch.cuda.is_available() and not args.no_copies:
        copies = Copies(w13, w2)
        for mode in modes:
            for per_call, tokens in [(8, 1), (8, 2), (8, 4), (8, 8)]:
                copies.start()
                rows.append(timed(w13, w2, mode, threads[-1], per_call, tokens, args.seconds))
                rows[-1]["beside copies"] = True
                rows[-1]["copies gbs"] = gbs = copies.finish()
                print(f"  copies beside them: {gbs:.1f} GB/s", flush=True)
        copies.start()
        rows.append({"what": "copies alone", "gbs": copies.finish()})
        print(f"copies alone: {rows[-1]['gbs']:.1f} GB/s")
    if args.out:
        args.out.write_text(json.dumps({"isa": isa, "rows": rows}, indent=1))


def read_bandwidth(threads: int, seconds: float) -> float:
    """GB/s of a sum over 2 GiB of fp32 with `threads` intra-op threads."""
    torch.set_num_threads(threads)
    big = torch.ones(512 * 2**20)
    big.sum()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 2:
        big.sum()
        n += 1
    return n * big.numel() * 4 / (time.perf_counter() - t0) / 1e9


def same_bytes(w13, w2, threads: int, per_call: int, seconds: float) -> float:
    """GB/s of a plain read of `per_call` experts' weights a call (other experts each call, as
    in `timed`) on the kernel's threads: the ceiling of a kernel that streams them."""
    torch.set_num_threads(threads)
    e = w13.shape[0]
    nbytes = (w13[0].numel() + w2[0].numel()) * 2 * per_call
    calls, first, spent = 0, 0, 0.0
    while spent < seconds or calls < 3:
        experts = (first + torch.arange(per_call)) % e
        first = (first + per_call) % e
        t0 = time.perf_counter()
        cpu.read(experts, w13, w2)
        if calls >= 2:
            spent += time.perf_counter() - t0
        calls += 1
    return nbytes * (calls - 2) / spent / 1e9


def timed(w13, w2, mode: str, threads: int, per_call: int, tokens: int, seconds: float) -> dict:
    """One row: `per_call` experts with `tokens` tokens each per call, other experts each call."""
    cpu.use(mode)
    torch.set_num_threads(threads)
    e, h = w13.shape[0], w13.shape[2]
    t = per_call * tokens
    x = torch.randn(t, h).bfloat16()
    weights = torch.rand(t, 1)
    nbytes = (w13[0].numel() + w2[0].numel()) * 2
    calls, first, spent, space = 0, 0, 0.0, cpu.Space()  # buffers kept, as the engine's
    while spent < seconds or calls < 3:
        slots = (first + torch.arange(t) // tokens).view(t, 1) % e  # [T, 1]
        first = (first + per_call) % e
        t0 = time.perf_counter()
        with torch.inference_mode():
            expert_rows(x, slots, weights, w13, w2, native=True, space=space)
        if calls >= 2:  # two warm-up calls
            spent += time.perf_counter() - t0
        calls += 1
    ms = 1000 * spent / (calls - 2) / per_call
    name = (
        "C" if mode == "auto" and cpu.chosen(x, w13, w2) and tokens <= cpu.MAX_TOKENS else "torch"
    )
    print(
        f"{name:6s} {threads:7d} {per_call:7d} {tokens:6d} {ms:9.3f} {nbytes / ms / 1e6:6.1f}",
        flush=True,
    )
    cpu.use("auto")
    return {
        "kernel": name,
        "threads": threads,
        "experts": per_call,
        "tokens": tokens,
        "ms": ms,
        "gbs": nbytes / ms / 1e6,
    }


class Copies:
    """Pinned expert copies to the GPU queued on their own stream from this thread, as the
    engine issues them (no host thread waits on them: one spinning in a synchronize would take
    a core from the CPU experts), timed with events: `finish` gives their GB/s and checks that
    they were still running when it was called."""

    def __init__(self, w13, w2, batches: int = 600) -> None:
        self.src = (w13, w2)
        self.dst = [torch.empty_like(w[:16], device="cuda") for w in self.src]
        self.stream = torch.cuda.Stream()
        self.batches = batches  # of 16 experts: about 1.1 s of copies at 55 GB/s
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    def start(self) -> None:
        e = self.src[0].shape[0]
        self.events[0].record(self.stream)
        with torch.cuda.stream(self.stream):
            for b in range(self.batches):
                first = (16 * b) % (e - 16)
                for s, d in zip(self.src, self.dst, strict=True):
                    d.copy_(s[first : first + 16], non_blocking=True)
        self.events[1].record(self.stream)

    def finish(self) -> float:
        if self.events[1].query():
            print(
                "  (the copies ended before the CPU experts did: part of the row ran without them)"
            )
        self.events[1].synchronize()
        nbytes = self.batches * sum(d.numel() * 2 for d in self.dst)
        return nbytes / self.events[0].elapsed_time(self.events[1]) / 1e6


if __name__ == "__main__":
    main()
