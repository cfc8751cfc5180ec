"""The expert codecs (oled.model.codec) on one checkpoint: bytes moved, decode throughput on the
device, and the link's time per expert plain against encoded.

For each codec: the encoded share of the bytes over every MoE layer's experts (or the first
--layers), whether the round trip is bit-exact, and on CUDA the decoder's throughput (bf16
bytes written per second; LANDING experts per launch, the engine's round, timed with events
over --reps replays of its graph) and the time to bring LANDING experts from pinned memory
into slots: plain rows by copy, encoded rows by copy and decode (oled.offload.encoded; one
round decodes while the next lands, as in the engine), with whether the first slot decoded
there holds its expert bit for bit (lossless) or the torch reference's decode of it (lossy).

    python tools/bench_codec.py --model /tmp/oled-mini-shape --json codec.json
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

from oled.model import codec  # noqa: E402
from oled.model.checkpoint import load_checkpoint  # noqa: E402
from oled.model.experts import ExpertStore  # noqa: E402
from oled.offload.copies import Rows, launch  # noqa: E402
from oled.offload.encoded import LANDING, EncodedCopies  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--layers", type=int, default=0, help="only the first N MoE layers (0: all)")
    ap.add_argument("--codecs", default="lossless,fp8,int4")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    store = load_checkpoint(args.model, device="cpu", dtype=torch.bfloat16).experts
    if args.layers:
        store = ExpertStore(w13=store.w13[: args.layers], w2=store.w2[: args.layers])
    if dev.type == "cuda":  # pinned, as the engine's host experts are
        store = ExpertStore(
            w13=[t.pin_memory() for t in store.w13], w2=[t.pin_memory() for t in store.w2]
        )
    print(
        f"loaded {store.num_layers} layers x {store.num_experts} experts in "
        f"{time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    rows = [measure(store, name, dev, args.reps) for name in args.codecs.split(",")]
    print(
        f"{'codec':<14} {'share':>7} {'exact':>6} {'encode s':>9} {'decode GB/s':>12} "
        f"{'plain ms':>9} {'encoded ms':>11} {'slot ok':>8}"
    )
    for r in rows:
        print(
            f"{r['codec']:<14} {r['share']:>7.4f} {str(r['exact']):>6} {r['encode_s']:>9.1f} "
            f"{r.get('decode_gb_s', float('nan')):>12.0f} {r.get('plain_ms', float('nan')):>9.3f} "
            f"{r.get('encoded_ms', float('nan')):>11.3f} {str(r.get('slots_exact')):>8}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "rows": rows}, indent=2))


def measure(store: ExpertStore, name: str, dev: torch.device, reps: int) -> dict:
    """One codec's figures over the store."""
    t0 = time.perf_counter()
    enc = EncodedCopies(store, name, dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    out = {
        "codec": codec.describe(name),
        "share": enc.ratio,
        "encode_s": time.perf_counter() - t0,
        "row_bytes": list(enc.row_bytes),
        "expert_bytes": store.expert_bytes,
    }
    out["exact"] = round_trip(store, enc) if name == "lossless" else None
    if name in codec.LOSSY:
        out["relative_error"] = lossy_error(store, enc)
    if dev.type == "cuda":
        out.update(timings(store, enc, dev, reps))
    return out


def round_trip(store: ExpertStore, enc: EncodedCopies) -> bool:
    """Every layer's first and last experts decode to their bf16 bits."""
    ends = [0, store.num_experts - 1]
    for layer in range(store.num_layers):
        for t, (plain, encoded) in enumerate(((store.w13, enc.w13), (store.w2, enc.w2))):
            back = codec.decode(encoded[layer][ends], enc.n[t])  # [2, n]
            if not torch.equal(
                back.view(torch.int16), plain[layer][ends].reshape(2, -1).view(torch.int16)
            ):
                return False
    return True


def lossy_error(store: ExpertStore, enc: EncodedCopies) -> float:
    """Relative Frobenius error of the first layer's first experts after the lossy codec."""
    k = min(8, store.num_experts)
    back = codec.decode(enc.w13[0][:k], enc.n[0]).float()
    ref = store.w13[0][:k].reshape(k, -1).float()
    return float((back - ref).norm() / ref.norm())


def timings(store: ExpertStore, enc: EncodedCopies, dev: torch.device, reps: int) -> dict:
    """Decoder throughput and the time to bring LANDING experts into slots, plain and encoded."""
    k = min(LANDING, store.num_experts)
    slots13 = torch.empty(k, *store.w13[0].shape[1:], dtype=torch.bfloat16, device=dev)
    slots2 = torch.empty(k, *store.w2[0].shape[1:], dtype=torch.bfloat16, device=dev)
    dst = Rows.of(slots13, slots2)
    stream = torch.cuda.Stream(dev)
    experts, into = np.arange(k), np.arange(k)
    plain_src = Rows.of(store.w13[0], store.w2[0])

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        stream.synchronize()
        enc.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(reps):
            fn()
        stream.wait_stream(enc.stream)  # encoded copies are complete on the decoder's stream
        end.record(stream)
        end.synchronize()
        enc.reset()
        return start.elapsed_time(end) / reps

    plain_ms = timed(lambda: launch(plain_src, dst, experts, into, stream))
    landed_ms = timed(lambda: launch(enc.rows[0], enc.landing, experts, into, stream))
    both_ms = timed(lambda: enc.launch(0, experts, into, dst, stream))
    # the decoder alone: the rows landed in part 0 decoded again
    enc.launch(0, experts, into, dst, stream)
    enc.synchronize()
    decode_ms = timed(lambda: replay(enc, stream))
    # the first slot against its expert (lossless) or the torch reference's decode (lossy)
    want = store.w13[0][0].reshape(-1)
    if enc.codec != "lossless":
        want = codec.decode(enc.w13[0][:1], enc.n[0])[0]
    ok = torch.equal(slots13[0].cpu().reshape(-1).view(torch.int16), want.view(torch.int16))
    bf16 = k * store.expert_bytes
    return {
        "experts": k,
        "plain_ms": plain_ms,
        "landed_ms": landed_ms,
        "encoded_ms": both_ms,
        "decode_ms": decode_ms,
        "decode_gb_s": bf16 / decode_ms / 1e6,
        "plain_gb_s": bf16 / plain_ms / 1e6,
        "landed_gb_s": k * enc.expert_bytes / landed_ms / 1e6,
        "slots_exact": ok,
    }


def replay(enc: EncodedCopies, stream: torch.cuda.Stream) -> None:
    with torch.cuda.stream(stream):
        enc.graphs[0].replay()


if __name__ == "__main__":
    main()
