"""One layer's batched attention on CUDA: the torch path against the fused ragged kernel.

For each number of streams, B sequences each decode a block of --t-max queries at the end of
--keys keys (with --spread, stream b has about (b + 1) / B of them) in KV slots given out of
order. The torch path (oled.model.layers.Attention._batched) builds the [B, 1, t_max, keys]
mask, gathers every stream's keys and values padded to `keys` (the next power of two, as the
batch decoder pads them) and runs SDPA; `ragged_attention` reads each slot's own keys. Both
start from the padded query block and end at the [B * t_max, h * D] rows the output projection
takes. Each is captured as a CUDA graph (as the runtime replays batched forwards) and timed
with CUDA events over --iters replays (--eager: launched eagerly instead). Prints, per stream
count, both times, the speedup and the largest difference between the two outputs.

    python tools/bench_attention.py --streams 1,8,16 --keys 576 --t-max 32
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oled.decoding.batch import padded_keys  # noqa: E402
from oled.kernels.attention import ragged_attention  # noqa: E402
from oled.model.config import mini_config  # noqa: E402
from oled.model.model import BatchRows  # noqa: E402


def timed_ms(fn: Callable[[], Tensor], iters: int, *, eager: bool) -> float:
    """Milliseconds per call of fn: replays of its CUDA graph, or eager calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    run = fn
    if not eager:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def stream_keys(streams: int, keys: int, t_max: int, spread: bool) -> list[int]:
    """Each stream's keys: all `keys`, or with `spread` from keys / B up to keys (at least one
    block of queries)."""
    if not spread:
        return [keys] * streams
    return [max(t_max, keys * (b + 1) // streams) for b in range(streams)]


def compare(args: argparse.Namespace, streams: int) -> tuple[float, float, float]:
    """(torch ms, fused ms, max abs difference) of one layer's batched attention."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    heads, kv, dim, t_max, bl = args.heads, args.kv_heads, args.head_dim, args.t_max, args.block
    ends = stream_keys(streams, args.keys, t_max, args.spread)
    keys = padded_keys(max(ends))
    slots = [(7 * b + 3) % streams for b in range(streams)]  # out of order
    rows = BatchRows.build(
        slots,
        [e - t_max for e in ends],
        [t_max] * streams,
        [0] * streams,
        keys=keys,
        device=dev,
    )
    gen = torch.Generator(device=dev).manual_seed(0)
    shape = (streams, kv, keys, dim)  # [slots, kv, S_max, D]
    kbuf = torch.randn(shape, generator=gen, device=dev, dtype=dt)
    vbuf = torch.randn(shape, generator=gen, device=dev, dtype=dt)
    q = torch.randn(streams, heads, t_max, dim, generator=gen, device=dev, dtype=dt)
    scale = dim**-0.5

    def old() -> Tensor:
        mask = rows.mask(bl)  # [B, 1, t_max, keys]
        k = kbuf[:, :, : rows.keys].index_select(0, rows.slots)  # [B, kv, keys, D]
        v = vbuf[:, :, : rows.keys].index_select(0, rows.slots)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )  # [B, h, t_max, D]
        return out.transpose(1, 2).reshape(streams * t_max, heads * dim)

    def new() -> Tensor:
        out = ragged_attention(q, kbuf, vbuf, rows.slots, rows.key_len, rows.query_pos, bl, scale)
        return out.transpose(1, 2).reshape(streams * t_max, heads * dim)

    diff = (old().float() - new().float()).abs().max().item()
    return (
        timed_ms(old, args.iters, eager=args.eager),
        timed_ms(new, args.iters, eager=args.eager),
        diff,
    )


@torch.inference_mode()
def main() -> None:
    cfg = mini_config()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,8,16", help="stream counts, comma-separated")
    ap.add_argument("--keys", type=int, default=576, help="keys of each (the longest) stream")
    ap.add_argument("--t-max", type=int, default=32, help="queries per stream")
    ap.add_argument("--block", type=int, default=32, help="diffusion block length")
    ap.add_argument("--heads", type=int, default=cfg.num_attention_heads)
    ap.add_argument("--kv-heads", type=int, default=cfg.num_key_value_heads)
    ap.add_argument("--head-dim", type=int, default=cfg.head_dim)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--spread", action="store_true", help="streams of unequal key lengths")
    ap.add_argument("--eager", action="store_true", help="eager launches, not graph replays")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA device (the fused kernel is timed on the GPU)")
    if args.t_max > args.keys:
        sys.exit("--t-max must not exceed --keys")
    print(
        f"{torch.cuda.get_device_name()}: heads {args.heads}, kv heads {args.kv_heads}, "
        f"head dim {args.head_dim}, keys {args.keys}{' (spread)' if args.spread else ''}, "
        f"t_max {args.t_max}, block {args.block}, bf16, "
        f"{'eager' if args.eager else 'graph replays'}"
    )
    print(f"{'streams':>7} {'old ms':>9} {'new ms':>9} {'speedup':>8} {'max diff':>9}")
    for streams in (int(s) for s in args.streams.split(",")):
        old_ms, new_ms, diff = compare(args, streams)
        print(f"{streams:>7} {old_ms:>9.4f} {new_ms:>9.4f} {old_ms / new_ms:>7.2f}x {diff:>9.2e}")


if __name__ == "__main__":
    main()
