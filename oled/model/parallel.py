"""Experts split across processes (expert parallel): one process per device, each holding a
contiguous share of every MoE layer's routed experts, everything else replicated.

Batch-1 block-diffusion decoding reads few weights per expert and routes every token to 8 of
256 experts, so the experts are what outgrows one device; attention and the dense layers of
LLaDA2.0-flash fit every device. Each process runs the same forward on the same tokens: at a
MoE layer it computes the (token, expert) pairs of the experts it holds (zeros for the others),
one all-reduce sums the pairs, and every process combines the same [T, K, H] pairs as one
process would. Each pair is non-zero on exactly one process, so the sum adds only zeros to it:
the processes decode exactly the tokens of a single process, whatever the order of the sum.

The processes are started by `oled run` (runtime.devices > 1), or by `torchrun`; NCCL joins
CUDA devices, gloo CPUs. Here every expert of a share is resident (ShardedExperts); with an
offload budget each process offloads its own share (oled.offload.shard), with the same
all-reduce.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from oled.model.experts import ExpertStore, ResidentExperts
from oled.model.stages import stage
from oled.threads import visible_cpus

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class ParallelError(ValueError):
    """The processes cannot split the experts as configured."""


@dataclass(frozen=True)
class Split:
    """Process `rank` of `world` holds experts [first, first + per) of every MoE layer."""

    rank: int
    world: int
    num_experts: int

    def __post_init__(self) -> None:
        if self.num_experts % self.world:
            raise ParallelError(
                f"{self.num_experts} experts per layer do not split evenly over {self.world} "
                "devices: choose runtime.devices dividing the expert count"
            )
        if not 0 <= self.rank < self.world:
            raise ParallelError(f"rank {self.rank} outside a world of {self.world}")

    @property
    def per(self) -> int:
        """Experts per layer each process holds."""
        return self.num_experts // self.world

    @property
    def owned(self) -> range:
        """The experts this process holds, in the order of its store's rows."""
        return range(self.rank * self.per, (self.rank + 1) * self.per)

    def rows(self, device: torch.device | str = "cpu") -> Tensor:
        """[E] int64: the store row of each expert this process holds, -1 for the others."""
        out = torch.full((self.num_experts,), -1, dtype=torch.long, device=device)
        out[self.rank * self.per : (self.rank + 1) * self.per] = torch.arange(
            self.per, device=device
        )
        return out


def all_reduce(pairs: Tensor) -> Tensor:
    """The pairs [T, K, H] fp32 of every share, summed in place over the processes: each pair
    is non-zero on the one process holding its expert."""
    with stage("all-reduce"):
        dist.all_reduce(pairs)
    return pairs


def check_host(devices: int, device: str) -> None:
    """A ParallelError when `device` ("auto", "cpu", "cuda") cannot give `devices` processes a
    device each: on CUDA, fewer GPUs than that (a CPU host runs any number of CPU processes)."""
    wants_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if wants_cuda and torch.cuda.device_count() < devices:
        raise ParallelError(
            f"runtime.devices = {devices}, but this host has {torch.cuda.device_count()} GPU(s)"
        )
    if device.startswith("cuda:"):
        raise ParallelError(
            f"runtime.devices = {devices} takes cuda:0 to cuda:{devices - 1}; set device = "
            f'"cuda" (not {device!r})'
        )


def launched() -> bool:
    """Whether this process was started as one of several (torchrun's environment)."""
    return all(v in os.environ for v in LAUNCH_VARS)


def join(devices: int, device_type: str) -> tuple[int, int]:
    """Join the process group of `devices` processes (NCCL on CUDA, gloo on the CPU) once per
    process; (rank, local rank). A ParallelError when this process was not started as one of
    `devices` processes."""
    if not dist.is_initialized():
        if not launched():
            raise ParallelError(
                f"runtime.devices = {devices} needs {devices} processes: `oled run` starts them, "
                f"or start them with `torchrun --standalone --nproc-per-node {devices} -m oled ...`"
            )
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    world = dist.get_world_size()
    if world != devices:
        raise ParallelError(f"runtime.devices = {devices}, but {world} processes were started")
    return dist.get_rank(), int(os.environ.get("LOCAL_RANK", dist.get_rank()))


def start(devices: int, args: list[str]) -> int:
    """Run `oled ARGS` as `devices` processes of one host (torchrun, standalone), each with an
    equal part of the CPUs for its threads unless OMP_NUM_THREADS says; their exit status."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={devices}", "-m", "oled.cli", *args]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(visible_cpus()) // devices)))
    return subprocess.run(cmd, check=False, env=env).returncode


_WAITS: list[dist.ProcessGroup | None] = []  # the gloo group `in_turn` waits on (None: the
# default group, on the CPU), made once


@contextmanager
def in_turn() -> Iterator[None]:
    """Run the block in one process after another, in rank order (as a single process without
    a group): what measures the machine, such as the cost calibration, never runs beside
    another process's measuring, and the later processes find what the first stored. Every
    process of the group enters it together. The waits are gloo's (a waiting process blocks on
    a socket, it keeps no core busy)."""
    if not dist.is_initialized():
        yield
        return
    if not _WAITS:
        cpu = dist.get_backend() == "gloo"
        _WAITS.append(None if cpu else dist.new_group(backend="gloo"))
    group, rank, world = _WAITS[0], dist.get_rank(), dist.get_world_size()
    for _ in range(rank):  # barrier k opens once rank k is done
        dist.barrier(group)
    try:
        yield
    finally:
        for _ in range(world - rank):
            dist.barrier(group)


def is_main() -> bool:
    """Whether this process reports (rank 0, or the only process)."""
    return not dist.is_initialized() or dist.get_rank() == 0


class ShardedExperts(ResidentExperts):
    """The expert executor of one process of several: its share of the experts resident on
    its device, the pairs of all shares summed by one all-reduce per MoE layer."""

    graph_safe = False  # a collective between layers: the layers replay as graphs, not forwards

    def __init__(self, store: ExpertStore, device: torch.device | str, split: Split) -> None:
        if store.num_experts != split.per:
            raise ParallelError(
                f"a store of {store.num_experts} experts for a share of {split.per}"
            )
        super().__init__(store, device)
        self.split = split
        self.rows = split.rows(device)  # [E]

    def pairs(self, layer: int, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """This share's pairs [T, K, H] fp32, zeros for the others' experts."""
        return super().pairs(layer, x, self.rows[ids], weights)  # rows: -1 elsewhere

    def gather(self, pairs: Tensor) -> Tensor:
        """The pairs of every share, summed over the processes (`all_reduce`)."""
        return all_reduce(pairs)
