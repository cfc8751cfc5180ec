"""`oled bench`: milliseconds per iteration, tokens/s and offload figures, side by side.

Workload (DESIGN.md section 7): a seeded random prompt (512 tokens by default), `gen_length`
generated tokens in blocks of `block_length`, batch 1; warm-up runs, then timed runs; median and
p90 over every timed iteration. With several recipes every configuration runs in this one
process and the table gives each one's ratio to the first.

Modules: `runs` (the configuration, workloads and one generation), `measure` (rows of figures),
`profile` (profiler attribution to forward stages and host time), `report` (the JSON report),
`tables` (rich tables).
"""

from __future__ import annotations

from oled.bench.measure import (
    bench_replay,
    bench_runtime,
    replay_warmups,
    summarise,
    with_ratios,
)
from oled.bench.profile import host_breakdown, stage_breakdown
from oled.bench.report import machine, write_report
from oled.bench.runs import (
    BenchConfig,
    TraceWorkload,
    bench_decode,
    random_prompt,
    run_once,
    run_replay,
)
from oled.bench.tables import host_table, stage_table, table

__all__ = [
    "BenchConfig",
    "TraceWorkload",
    "bench_decode",
    "bench_replay",
    "bench_runtime",
    "host_breakdown",
    "host_table",
    "machine",
    "random_prompt",
    "replay_warmups",
    "run_once",
    "run_replay",
    "stage_breakdown",
    "stage_table",
    "summarise",
    "table",
    "with_ratios",
    "write_report",
]
