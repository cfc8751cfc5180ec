"""The runtime calls of one planned layer call, in their order: the offload engine's Python path
issues them on its streams (oled.offload.engine), drive.c issues the same from C
(oled.offload.driver), and tests record both through stand-ins to compare them.

The order: the copies into cache slots, from a timing event on the copy stream to one on the
stream where they are complete (the copy stream, or the decoder's for encoded copies); the CPU
experts' activations to pinned host memory and the event after them; the slot maps; the wait for
copies ahead into this layer (timed as a stall); the hits' pass; the wait for this layer's copies
(timed as a stall) and the copied experts' pass; then each staged round: the copy stream waits
for the earlier users of the round's part of the stage (the round STAGE_ROUNDS before it, or the
stage's users before the call), the round's copies (timed), the wait for them, its pass and the
event after its pass (that part's users now). So one round's copies run while the previous
round's pass computes.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from oled.policies.planner import COPIED, HIT, STAGE_ROUNDS, STAGED, LayerPlan


class Launcher(Protocol):
    """Where a layer call's runtime calls go: the engine's streams, or a recorder in tests.
    Events and streams are the launcher's own objects (None on a machine without streams)."""

    compute: Any  # the layer call's stream
    copy: Any  # the copy stream
    finish: Any  # where copies are complete: the copy stream, or the decoder's (encoded)
    stage_capacity: int  # experts per staged round
    ahead: Any  # the event of copies ahead into this layer's cache (None: none pending)
    stage_free: Any  # the event after the stage's last users (None: the stage is free)

    def record(self, stream: Any) -> Any:
        """An event recorded on `stream` now (None without a stream)."""

    def wait(self, stream: Any, event: Any) -> None:
        """`stream` waits for `event`."""

    def timed(self, layer: int, start: Any, end: Any, copy: bool) -> None:
        """The event pair (start, end) timed the layer's copies (copy) or a stall."""

    def copy_rows(self, layer: int, experts: np.ndarray, slots: np.ndarray, stage: bool) -> None:
        """The layer's experts into rows `slots` of its cache's tables (of the stage's when
        `stage`), on the copy stream."""

    def copies_issued(self, layer: int) -> None:
        """After the layer's copies into cache slots (the engine copies ahead here)."""

    def activations(self) -> None:
        """The layer's activations, device -> pinned host, on the compute stream."""

    def send_maps(self, layer: int, rows: int) -> None:
        """The first `rows` rows of the layer's slot maps, host -> device, on the compute
        stream."""

    def run_pass(self, row: int) -> None:
        """The pass over the experts that slot-map row `row` places, on the compute stream."""


def launch_layer(rt: Launcher, layer: int, plan: LayerPlan) -> Any:
    """Every runtime call of a planned layer call, in order; the event after the CPU experts'
    activations (None: no CPU experts, or no streams)."""
    ready, cpu_ready = launch_inputs(rt, layer, plan)
    launch_passes(rt, layer, plan, ready)
    return cpu_ready


def launch_inputs(rt: Launcher, layer: int, plan: LayerPlan) -> tuple[Any, Any]:
    """The copies into cache slots, the CPU experts' activations and the slot maps: (the event
    the copies complete, the event after the activations), each None when there are none."""
    ready = None
    if len(plan.copy_experts):
        ready = timed_copies(rt, layer, plan.copy_experts, plan.copy_slots, stage=False)
    rt.copies_issued(layer)
    cpu_ready = None
    if len(plan.cpu_experts):  # the activations start for the host before the passes
        rt.activations()
        cpu_ready = rt.record(rt.compute)
    rt.send_maps(layer, plan.map_rows)
    return ready, cpu_ready


def launch_passes(rt: Launcher, layer: int, plan: LayerPlan, ready: Any) -> None:
    """Hits at once, the experts copied now after their copies (`ready`), then the experts that
    found no cache slot through the stage in rounds of its capacity: each round's copies wait
    until the earlier users of its part of the stage are done (and are timed after that wait:
    copy time only), its pass for the copies. Every other pair of a pass is zero, so adding the
    rounds is exact."""
    if rt.ahead is not None:  # hits may be experts copied ahead at the previous layer
        stall(rt, layer, rt.ahead)
    rt.run_pass(HIT)
    if len(plan.copy_experts):
        if ready is not None:  # wait for this layer's copies only now, after the hits
            stall(rt, layer, ready)
        rt.run_pass(COPIED)
    stage_e, stage_s, size = plan.stage_experts, plan.stage_slots, rt.stage_capacity
    free = [rt.stage_free] * STAGE_ROUNDS  # after the last users of each part of the stage
    for n, lo in enumerate(range(0, len(stage_e), size)):
        if free[n % STAGE_ROUNDS] is not None:  # the part's earlier users are done first
            rt.wait(rt.copy, free[n % STAGE_ROUNDS])
        copied = timed_copies(rt, layer, stage_e[lo : lo + size], stage_s[lo : lo + size], True)
        if copied is not None:
            stall(rt, layer, copied)
        rt.run_pass(STAGED + n)
        rt.stage_free = free[n % STAGE_ROUNDS] = rt.record(rt.compute)


def timed_copies(
    rt: Launcher, layer: int, experts: np.ndarray, slots: np.ndarray, stage: bool
) -> Any:
    """The copies of the layer's `experts` into `slots` from an event on the copy stream to one
    where they are complete, timed as the layer's copy time (encoded copies: a round's decode
    may overlap the next copies' time); the event they complete (None without streams, where
    copies are synchronous)."""
    begin = rt.record(rt.copy)
    rt.copy_rows(layer, experts, slots, stage)
    done = rt.record(rt.finish)
    rt.timed(layer, begin, done, True)
    return done


def stall(rt: Launcher, layer: int, copied: Any) -> None:
    """The compute stream waits for `copied`; the wait is timed as the layer's stall."""
    start = rt.record(rt.compute)
    rt.wait(rt.compute, copied)
    rt.timed(layer, start, rt.record(rt.compute), False)
