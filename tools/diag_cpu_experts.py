"""Where a cooperative compensation's CPU-expert time goes, on a GPU: per layer call with CPU
experts, the time the policy learns from (plan -> result) against the cost model's, in the
prompt forward and in decode iterations, and the learned slowdown after each generation.

Usage: PYTHONPATH=. python3 tools/diag_cpu_experts.py --model /tmp/m --budget 0.25 --label new
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np
import torch

from oled.bench import random_prompt
from oled.offload.budget import Budget
from oled.runtime import build_runtime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/m")
    ap.add_argument("--budget", type=float, default=0.25, help="expert fraction")
    ap.add_argument("--prompt-length", type=int, default=512)
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--generations", type=int, default=3)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    rt = build_runtime(
        model=args.model, device="cuda", budget=Budget("expert_fraction", args.budget)
    )
    log = instrument(rt.executor)
    ids = random_prompt(rt, args.prompt_length, seed=0)
    decode = replace(rt.decode, max_new_tokens=args.gen_length)
    for n in range(args.generations):
        log.clear()
        for _ in rt.stream(ids, decode=decode):
            pass
        torch.cuda.synchronize()
        report(args.label, n, np.array(log).reshape(-1, 6), rt)


def instrument(engine) -> list[tuple]:
    """Log per CPU job: (tokens of the call, experts, tokens, measured ms, modelled ms, ms
    waiting for the activations)."""
    planner, log, cur = engine.planner, [], {}
    observe, compute = planner.observe_cpu, engine._cpu_pairs

    def observe_cpu(layer, tokens, measured):
        modelled = float(np.sum(planner.cost.cpu_ms(tokens)))
        log.append((cur["T"], len(tokens), int(tokens.sum()), measured, modelled, cur["wait"]))
        observe(layer, tokens, measured)

    def cpu_pairs(job, pairs, t_plan):
        t = time.perf_counter()
        cur["T"] = job.x.shape[0]
        if job.copied is not None:
            job.copied.synchronize()
        cur["wait"] = 1000 * (time.perf_counter() - t)
        compute(job, pairs, t_plan)

    planner.observe_cpu, engine._cpu_pairs = observe_cpu, cpu_pairs
    return log


def report(label: str, n: int, a: np.ndarray, rt) -> None:
    for name, rows in (("prompt", a[a[:, 0] > 100]), ("decode", a[a[:, 0] <= 100])):
        if len(rows):
            print(
                f"{label} gen {n} {name}: {len(rows)} CPU jobs, experts/job "
                f"{rows[:, 1].mean():.1f}, tokens/job {rows[:, 2].mean():.1f}, measured "
                f"{rows[:, 3].mean():.3f} ms, modelled {rows[:, 4].mean():.3f} ms, "
                f"sync-wait {rows[:, 5].mean():.3f} ms"
            )
    engine = rt.executor
    print(
        f"{label} gen {n}: slowdown {engine.planner.compensation.slowdown:.2f} driver "
        f"{engine.driver is not None} cpu_share {rt.stats()['cpu_share']:.4f} p50 "
        f"{np.median(rt.last_stats.decode_ms):.2f}"
    )


if __name__ == "__main__":
    main()
