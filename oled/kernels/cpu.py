"""Routed experts on the CPU in C (cpu_experts.c): the weights streamed once per call at close to
the host's memory bandwidth, on the threads of torch's OpenMP runtime (`team`).

`expert_rows` computes what `oled.model.experts.expert_rows` computes with torch, for experts
whose few tokens (decode) make torch's matrix products slow: the same rounding points, sums in
another order (tests/kernels states the agreement). The build is tuned to the machine
(-march=native, tagged by the CPU's features), so that vector units such as AVX-512 are used;
the results do not depend on the vector width or the thread count.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from oled.clib import Field, Library, NativeUnavailable, Part, Struct

JOB = Struct(
    "ExpertJob",
    (
        *Field.many("int64_t", "hidden inter groups threads"),
        Field("x", "const uint16_t *", "[T, H] activations, bf16"),
        *Field.many("const uint16_t *", "w13 w2", "the layer's tables [E, 2I, H], [E, H, I]"),
        Field("expert", "const int64_t *", "[G] expert of each group"),
        Field("offs", "const int64_t *", "[G + 1] first pair of each group, then N"),
        Field("token", "const int64_t *", "[N] activation row of each pair"),
        Field("weight", "const float *", "[N] gate weight of each pair"),
        *Field.many("float *", "xf act", "scratch [N, H], [N, I]"),
        Field("out", "float *", "[N, H] weighted outputs"),
        Field("parallel", "void *", "GOMP_parallel of torch's OpenMP, or NULL: own threads"),
    ),
    doc="One layer's CPU experts: pairs grouped by expert.",
)
GROUPS = Struct(
    "PairGroups",
    (
        *Field.many("int64_t", "pairs k experts", "T*K pairs, K, experts in the table"),
        Field("slot", "const int64_t *", "[T*K] expert of each pair, or -1: computed elsewhere"),
        Field("pair_weight", "const float *", "[T*K] gate weight of each pair"),
        Field("count", "int64_t *", "scratch [E]"),
        Field("order", "int64_t *", "[N] pair of each CPU pair, by expert then pair"),
        Field("expert", "int64_t *", "[G] expert of each group"),
        Field("offs", "int64_t *", "[G + 1] first pair of each group, then N"),
        Field("token", "int64_t *", "[N] activation row of each pair (order // K)"),
        Field("weight", "float *", "[N] gate weight of each pair"),
        *Field.many("int64_t", "groups largest", "out: G, the largest group's pairs"),
    ),
    doc="A layer's CPU pairs grouped by expert (each array sized for T*K pairs).",
)
PART = Part("experts", structs=(JOB, GROUPS), doc="oled/kernels/cpu.py")
LANES = 16  # cpu_experts.c sums rows in 16 lanes: H and I must be multiples
MAX_TOKENS = 8  # experts with more pairs go to torch's matrix products (faster from there)
VERSION = 2  # of cpu_experts.c's speed: a new one makes stored cost calibrations measure again


def _declare(lib: ctypes.CDLL) -> None:
    for fn in (lib.oled_experts, lib.oled_experts_read, lib.oled_group):
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_void_p]


LIBRARY = Library(
    "experts",
    (Path(__file__).parent / "cpu_experts.c",),
    (PART,),
    declare=_declare,
    flags=("-O3", "-march=native", "-ffp-contract=fast", "-pthread"),
)


MODES = ("auto", "torch")
_mode = "auto"


def use(mode: str) -> None:
    """CPU experts for the whole process: "auto" (the C kernel wherever it can run, unless
    `oled.kernels.use("torch")`) or "torch" (torch's products; benchmarks compare the two)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"unknown CPU expert kernels {mode!r}; choose from {', '.join(MODES)}")
    _mode = mode


def chosen(x: Tensor, w13: Tensor, w2: Tensor) -> bool:
    """These tensors' experts go through the C kernel."""
    from oled import kernels

    return _mode == "auto" and kernels.mode() != "torch" and unsupported(x, w13, w2) is None


def describe(w13: Tensor, w2: Tensor) -> str:
    """The CPU experts of these tables, in words (for reports and the calibration's key)."""
    x = torch.empty(1, w13.shape[-1], dtype=w13.dtype)
    if not chosen(x, w13.cpu()[:1], w2.cpu()[:1]):
        return "torch"
    threads = "torch's OpenMP threads" if team() else "threads of its own"
    return f"C (version {VERSION}) up to {MAX_TOKENS} tokens, on {threads}"


def unsupported(x: Tensor, w13: Tensor, w2: Tensor) -> str | None:
    """Why these tensors cannot go through the C kernel (None when they can)."""
    if x.device.type != "cpu" or w13.device.type != "cpu":
        return "not on the CPU"
    if not (x.dtype == w13.dtype == w2.dtype == torch.bfloat16):
        return f"dtypes {x.dtype}, {w13.dtype}, {w2.dtype}, not bfloat16"
    if x.shape[-1] % LANES or w2.shape[-1] % LANES:
        return f"hidden {x.shape[-1]} and expert intermediate {w2.shape[-1]} not multiples of 16"
    if not (x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()):
        return "non-contiguous tensors"
    lib = _library()
    return str(lib) if isinstance(lib, NativeUnavailable) else None


@functools.cache
def _library() -> ctypes.CDLL | NativeUnavailable:
    """The library, loaded and its contract checked once per process (a layer's CPU experts
    ask for it on the hot path), or why it cannot be had."""
    try:
        return LIBRARY.load()
    except NativeUnavailable as e:
        return e


@functools.cache
def team() -> int | None:
    """The address of GOMP_parallel in the OpenMP runtime that this process has loaded (torch's,
    libgomp or LLVM's libomp, which keeps the same entry), or None (the kernel then runs on
    threads of its own)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    paths = dict.fromkeys(line.split()[-1] for line in maps if "omp" in line.rsplit("/", 1)[-1])
    for path in paths:
        try:
            return ctypes.cast(ctypes.CDLL(path).GOMP_parallel, ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
    return None


@dataclass
class Groups:
    """A layer's CPU pairs grouped by expert (`group`): `order` [N] int64 index of each pair in
    the T*K flattened pairs, by expert then by index (a stable sort), `experts` [G] int64, `offs`
    [G + 1] int64 (group g's pairs are order[offs[g]:offs[g + 1]]), `tokens` [N] int64 (order //
    K) and `weights` [N] fp32 of each pair, `largest` the largest group's pairs."""

    order: np.ndarray
    experts: np.ndarray
    offs: np.ndarray
    tokens: np.ndarray
    weights: np.ndarray
    largest: int

    @property
    def counts(self) -> np.ndarray:
        """[G] pairs of each group."""
        return np.diff(self.offs)


def group(slots: np.ndarray, weights: np.ndarray, experts: int, space: Space) -> Groups:
    """The pairs of `slots` [T, K] (an expert below `experts`, or -1 for pairs computed
    elsewhere) with their gate weights [T, K] fp32, grouped in C (numpy's and torch's calls on a
    few pairs cost more than the kernel). The arrays are views of `space`'s buffers, `order`
    in its output index (so it waits for their last use); valid until its next call."""
    t, k = slots.shape
    p = t * k
    slots = np.ascontiguousarray(slots, np.int64)
    weights = np.ascontiguousarray(weights, np.float32)
    space.wait()
    arrays = {
        "order": space.array("out index", np.int64, p),
        "expert": space.array("group experts", np.int64, p),
        "offs": space.array("group offs", np.int64, p + 1),
        "token": space.array("group tokens", np.int64, p),
        "weight": space.array("group weights", np.float32, p),
        "count": space.array("group counts", np.int64, experts),
    }
    job = GROUPS.ctype(
        pairs=p,
        k=k,
        experts=experts,
        slot=slots.ctypes.data,
        pair_weight=weights.ctypes.data,
        **{name: a.ctypes.data for name, a in arrays.items()},
    )
    n = _library_call("oled_group", job)
    if n < 0:
        raise ValueError(f"a CPU pair's expert is past the table's {experts} experts")
    g = job.groups
    return Groups(
        arrays["order"][:n],
        arrays["expert"][:g],
        arrays["offs"][: g + 1],
        arrays["token"][:n],
        arrays["weight"][:n],
        job.largest,
    )


_NUMPY: dict[type, torch.dtype] = {np.int64: torch.int64, np.float32: torch.float32}


class Space:
    """Buffers of `expert_rows` and `group` kept between calls, grown to the largest: scratch,
    and the outputs ("out index" [N] int64, "out rows" [N, H] fp32) in pinned memory when
    `pinned` (so that they go up to a GPU without a copy of their own). A call's outputs are
    views, valid until the next call; `busy`, when set, is an event (with `synchronize()`)
    after their last use that the next call waits for (`wait`) before writing."""

    def __init__(self, *, pinned: bool = False) -> None:
        self.pinned = pinned
        self.busy: Any = None
        self._bufs: dict[str, Tensor] = {}
        self._arrays: dict[str, np.ndarray] = {}

    def take(self, name: str, dtype: torch.dtype, n: int, *row: int) -> Tensor:
        """A view [n, *row] of buffer `name` (grown to at least twice its size when short)."""
        size = n * (int(np.prod(row)) if row else 1)
        buf = self._bufs.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < size:
            pin = self.pinned and name.startswith("out")
            grown = max(size, 2 * buf.numel() if buf is not None and buf.dtype == dtype else 0)
            buf = self._bufs[name] = torch.empty(grown, dtype=dtype, pin_memory=pin)
            self._arrays[name] = buf.numpy()
        return buf[:size].view(n, *row)

    def array(self, name: str, dtype: type, size: int) -> np.ndarray:
        """Buffer `name` as a numpy array of at least `size` values (all of it: callers slice)."""
        a = self._arrays.get(name)
        if a is None or a.dtype != dtype or len(a) < size:
            self.take(name, _NUMPY[dtype], size)
            a = self._arrays[name]
        return a

    def wait(self) -> None:
        """Until the last outputs' use is over."""
        if self.busy is not None:
            self.busy.synchronize()
            self.busy = None

    def outputs(self, n: int, hidden: int) -> tuple[Tensor, Tensor]:
        """(index [n] int64, rows [n, hidden] fp32), after the last outputs' use."""
        self.wait()
        return self.take("out index", torch.int64, n), self.take(
            "out rows", torch.float32, n, hidden
        )


def expert_rows(
    x: Tensor,
    experts: np.ndarray,
    offs: np.ndarray,
    tokens: np.ndarray,
    weights: np.ndarray,
    w13: Tensor,
    w2: Tensor,
    *,
    out: Tensor | None = None,
    space: Space | None = None,
) -> Tensor:
    """Weighted SwiGLU outputs [N, H] fp32 of N (token, expert) pairs grouped by expert.

    x [T, H]; experts [G] int64 (rows of w13/w2); offs [G + 1] int64, group g's pairs are
    offs[g]:offs[g + 1]; tokens [N] int64 row of x of each pair; weights [N] fp32; w13 [E, 2I,
    H]; w2 [E, H, I]. Written into `out` [N, H] fp32 when given; scratch from `space` when
    given. Uses torch's thread count. Call `unsupported` first.
    """
    n, h, inter = int(offs[-1]), x.shape[-1], w2.shape[-1]
    experts, offs, tokens = (np.ascontiguousarray(a, np.int64) for a in (experts, offs, tokens))
    weights = np.ascontiguousarray(weights, np.float32)
    space = space or Space()
    xf, act = space.take("xf", torch.float32, n, h), space.take("act", torch.float32, n, inter)
    if out is None:
        out = torch.empty(n, h, dtype=torch.float32)
    _run(
        "oled_experts",
        experts,
        w13,
        w2,
        x=x.data_ptr(),
        offs=offs.ctypes.data,
        token=tokens.ctypes.data,
        weight=weights.ctypes.data,
        xf=xf.data_ptr(),
        act=act.data_ptr(),
        out=out.data_ptr(),
    )
    return out


def read(experts: Tensor, w13: Tensor, w2: Tensor) -> int:
    """Read these experts' weights (experts [G] int64, rows of w13/w2) once, as `expert_rows`
    streams them, on the same threads: the ceiling of its speed (for benchmarks). Returns the
    sum of their 64-bit words (mod 2**64, signed). Call `unsupported` first."""
    return _run("oled_experts_read", np.ascontiguousarray(experts.numpy(), np.int64), w13, w2)


def _run(entry: str, experts: np.ndarray, w13: Tensor, w2: Tensor, **buffers: int) -> int:
    """Call the library's `entry` on a job over `experts` [G] int64 (contiguous) of the tables
    w13 [E, 2I, H] and w2 [E, H, I], on torch's thread count and team; `buffers`: the job's
    other fields (addresses)."""
    job = JOB.ctype(
        hidden=w13.shape[-1],
        inter=w2.shape[-1],
        groups=len(experts),
        threads=torch.get_num_threads(),
        w13=w13.data_ptr(),
        w2=w2.data_ptr(),
        expert=experts.ctypes.data,
        parallel=team(),
        **buffers,
    )
    return _library_call(entry, job)


def _library_call(entry: str, job: Any) -> int:
    """The library's `entry` on `job` (a ctypes struct)."""
    lib = _library()
    assert not isinstance(lib, NativeUnavailable), "call `unsupported` first"
    return int(getattr(lib, entry)(ctypes.byref(job)))
