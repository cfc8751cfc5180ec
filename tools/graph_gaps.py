"""Inside a forward's CUDA graph: its kernels, the idle gaps between them, and its replay time.

Decodes one prompt (one stream) and 8 prompts together (8 streams) on a resident checkpoint,
takes the whole-forward graph each replayed most, and reports for it: one replay timed alone
with events and 10 back to back (untraced), then one replay traced (kernel count, their summed
time, the span from the first start to the last end, the idle gaps between consecutive kernels
by size and by the kernel pair around them). A replay recomputes the graph's last input, so its
time is that input's (with random weights, the experts its tokens route to).

    python tools/graph_gaps.py /path/to/checkpoint [--streams 8]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oled.decoding.config import DecodeConfig  # noqa: E402
from oled.model.graphs import GraphedForward  # noqa: E402
from oled.runtime import Runtime, load_runtime  # noqa: E402


def short(name: str) -> str:
    """A kernel's name without its template and argument lists."""
    name = re.sub(r"[(<].*", "", name).replace("void ", "").replace("at::native::", "")
    return name[:40]


def most_replayed(fw: GraphedForward, run: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """The whole-forward graph that `run()` replays most (after one run that captures)."""
    run()
    seen: collections.Counter[int] = collections.Counter()
    original = fw._replay

    def counted(entry: Any) -> None:
        seen[id(entry)] += 1
        original(entry)

    fw._replay = counted  # type: ignore[method-assign]
    try:
        run()
    finally:
        del fw._replay  # the class's method again
    if not seen or not fw.whole:
        raise SystemExit("no whole-forward graph replayed: resident runs on CUDA only")
    top = seen.most_common(1)[0][0]
    return next(e for e in fw.captured.values() if id(e) == top).pieces[0]


def replay_ms(graph: torch.cuda.CUDAGraph) -> tuple[float, float]:
    """(median of 10 replays each timed alone, mean of 10 replayed back to back) in ms."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    alone = []
    for _ in range(10):
        torch.cuda.synchronize()
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        alone.append(e0.elapsed_time(e1))
    e0.record()
    for _ in range(10):
        graph.replay()
    e1.record()
    e1.synchronize()
    return sorted(alone)[5], e0.elapsed_time(e1) / 10


def traced(graph: torch.cuda.CUDAGraph, label: str) -> None:
    """Print the traced replay's kernels and the gaps between them."""
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    device = torch.autograd.DeviceType.CUDA
    ks = sorted(
        (e for e in prof.events() if e.device_type == device), key=lambda e: e.time_range.start
    )
    busy = sum(e.time_range.elapsed_us() for e in ks)
    span = ks[-1].time_range.end - ks[0].time_range.start
    pairs: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    sizes: collections.Counter[int] = collections.Counter()
    for a, b in zip(ks[:-1], ks[1:], strict=True):
        gap = max(0.0, b.time_range.start - a.time_range.end)
        pair = pairs[f"{short(a.name)} -> {short(b.name)}"]
        pair[0] += 1
        pair[1] += gap
        sizes[min(int(gap), 10)] += 1
    gaps = sum(us for _, us in pairs.values())
    print(
        f"{label}, traced: {len(ks)} kernels, {busy / 1000:.3f} ms busy, span "
        f"{span / 1000:.3f} ms, gaps {gaps / 1000:.3f} ms"
    )
    print("  gaps by whole us (10: 10 or more):", dict(sorted(sizes.items())))
    for key, (n, us) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[:8]:
        print(f"  {us:7.1f} us over {int(n):3d}: {key}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=512)
    args = parser.parse_args()
    rt: Runtime = load_runtime(args.checkpoint, device="cuda", dtype="bfloat16")
    if not isinstance(rt.forward, GraphedForward):
        raise SystemExit("CUDA graphs are off here: run on a GPU")
    cfg = DecodeConfig(max_new_tokens=64)
    prompts = [
        rt.tokenizer.encode(f"{i} hello there " * args.prompt_length)[: args.prompt_length]
        for i in range(args.streams)
    ]

    def one() -> None:
        list(rt.stream(prompts[0], decode=cfg))

    def batch() -> None:
        dec = rt.batch_decoder(args.streams, prefill_chunk=0)
        for p in prompts:
            dec.add(p, cfg)
        while dec.busy:
            dec.step()

    for label, run in (("1 stream", one), (f"{args.streams} streams", batch)):
        graph = most_replayed(rt.forward, run)
        alone, back = replay_ms(graph)
        print(f"{label}: one replay alone {alone:.3f} ms, 10 back to back {back:.3f} ms each")
        traced(graph, label)


if __name__ == "__main__":
    main()
