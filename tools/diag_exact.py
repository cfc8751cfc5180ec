"""GPU exactness diagnosis (CUDA): does the offloaded runtime leave the GPU, and does the grouped
GEMM depend on the table or the number of groups?

Prints, for GPU-only policies at two budgets and two stage sizes, whether the tokens equal the
all-resident ones and the engine's cpu_experts / staged / copies; then bit differences of
`expert_pairs` over a full vs. a 4-row table vs. two calls, and of `torch._grouped_mm` with the
same groups padded to different G. Run: PYTHONPATH=. python3 tools/diag_exact.py
"""

import sys
import tempfile
import time

import torch

from oled.model.experts import expert_pairs
from oled.model.presets import init_checkpoint
from oled.offload.budget import Budget
from oled.policies import allocation as A
from oled.policies import compensation as C
from oled.policies import retention as R
from oled.runtime import build_runtime, load_runtime

PROMPTS = ["What is the capital of France?", "Once upon a time there was a small robot"]
rows = []
t_start = time.time()
print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), flush=True)


def tokens(rt):
    return [rt.generate(p, max_new_tokens=64, threshold=0.6).token_ids for p in PROMPTS]


# ---- part 2 first (cheap): grouped GEMM dependence on table / G ----
def bits_diff(a, b):
    return (a.float() - b.float()).abs().max().item(), int((a != b).sum().item())


dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
for H, inter in ((128, 64), (128, 256)):
    x = torch.randn(256, H, device=dev, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(32, 2 * inter, H, device=dev, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(32, H, inter, device=dev, generator=g) * 0.05).to(torch.bfloat16)
    sub = torch.tensor([3, 7, 19, 28], device=dev)
    ids = sub[torch.randint(0, 4, (256, 4), device=dev, generator=g)]
    wts = torch.rand(256, 4, device=dev, generator=g)
    full = expert_pairs(x, ids, wts, w13, w2)
    remap = torch.full((32,), -1, dtype=torch.long, device=dev)
    remap[sub] = torch.arange(4, device=dev)
    small = expert_pairs(x, remap[ids], wts, w13[sub].contiguous(), w2[sub].contiguous())
    a_ = torch.where((ids == 3) | (ids == 7), remap[ids], -1)
    b_ = torch.where((ids == 19) | (ids == 28), remap[ids], -1)
    split = expert_pairs(x, a_, wts, w13[sub].contiguous(), w2[sub].contiguous())
    split = split + expert_pairs(x, b_, wts, w13[sub].contiguous(), w2[sub].contiguous())
    # random ids over all 32 experts, full table vs split into two halves of the table slots
    ids32 = torch.randint(0, 32, (256, 4), device=dev, generator=g)
    f32 = expert_pairs(x, ids32, wts, w13, w2)
    lo = torch.where(ids32 < 16, ids32, -1)
    hi = torch.where(ids32 >= 16, ids32, -1)
    s32 = expert_pairs(x, lo, wts, w13, w2) + expert_pairs(x, hi, wts, w13, w2)
    for name, other in (("4-row table", small), ("4-row split 2 calls", split)):
        d, n = bits_diff(full, other)
        rows.append((f"pairs H={H} inter={inter}: full32 vs {name}", f"maxdiff={d:.3g} ndiff={n}"))
    d, n = bits_diff(f32, s32)
    rows.append(
        (
            f"pairs H={H} inter={inter}: 32 experts one call vs two calls",
            f"maxdiff={d:.3g} ndiff={n}",
        )
    )

# direct _grouped_mm with different G (empty-group padding)
a = torch.randn(256, 128, device=dev, generator=g).to(torch.bfloat16)
bt = torch.randn(32, 128, 128, device=dev, generator=g).to(torch.bfloat16)
sizes = torch.tensor([50, 70, 36, 100], device=dev)
offs4 = torch.cumsum(sizes, 0).to(torch.int32)
o4 = torch._grouped_mm(a, bt[:4].transpose(-2, -1), offs=offs4)
offs32 = torch.cat([offs4, offs4[-1:].repeat(28)])
o32 = torch._grouped_mm(a, bt.transpose(-2, -1), offs=offs32)
b_front = torch.cat([bt[4:], bt[:4]])  # 28 empty groups first, then the 4 real ones
offs_front = torch.cat([torch.zeros(28, dtype=torch.int32, device=dev), offs4])
ofront = (
    torch.cat([torch.zeros(0, device=dev)])
    if False
    else torch._grouped_mm(a, b_front.transpose(-2, -1), offs=offs_front)
)
b_inter = torch.stack([bt[i // 8] if i % 8 == 0 else bt[31 - i] for i in range(32)])
offs_inter = torch.cat(
    [offs4[i // 8 : i // 8 + 1] if i % 8 == 0 else (offs4[i // 8 : i // 8 + 1]) for i in range(32)]
).to(torch.int32)
ointer = torch._grouped_mm(a, b_inter.transpose(-2, -1), offs=offs_inter)
loop = torch.cat(
    [
        a[s:e] @ bt[i].t()
        for i, (s, e) in enumerate(zip([0] + offs4[:-1].tolist(), offs4.tolist(), strict=True))
    ]
)
for name, o in (("G=32 pad end", o32), ("G=32 pad front", ofront), ("G=32 interleaved", ointer)):
    d, n = bits_diff(o4, o)
    rows.append((f"_grouped_mm G=4 vs {name}", f"maxdiff={d:.3g} ndiff={n}"))
d, n = bits_diff(o4, loop)
rows.append(("_grouped_mm vs per-group a@b (info)", f"maxdiff={d:.3g} ndiff={n}"))
print("part 2 done", time.time() - t_start, flush=True)

# ---- part 1: runtime ----
path = init_checkpoint(tempfile.mkdtemp(), preset="tiny", seed=0, shard_bytes=2 << 20)
ref = tokens(load_runtime(str(path), device="cuda", dtype="bfloat16"))
for frac in (0.125, 0.5):
    for stage in (4, 64):
        rt = build_runtime(
            model=str(path),
            device="cuda",
            dtype="bfloat16",
            cost="h200",
            budget=Budget("expert_fraction", frac),
            allocation=A.UniformAllocation(),
            retention=R.LRURetention(),
            compensation=C.TransferOnly(),
            stage_capacity=stage,
        )
        try:
            got = tokens(rt)
            s = rt.stats()
            eq = [g_ == r_ for g_, r_ in zip(got, ref, strict=True)]
            rows.append(
                (
                    f"runtime frac={frac} stage={stage}",
                    f"equal={eq} cpu_experts={s['cpu_experts']:.0f} staged={s['staged']:.0f} "
                    f"copies={s['copies']:.0f} hits={s['hits']:.0f}",
                )
            )
        finally:
            rt.close()
        print("done", frac, stage, time.time() - t_start, flush=True)

print("\n==== TABLE ====")
for k, v in rows:
    print(f"{k:55s} {v}")
sys.exit(0)
