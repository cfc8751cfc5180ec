"""Lossless codec libraries on bf16 expert weights: compression ratio, decode GB/s, bit-exactness.

Candidates, each skipped with a one-line reason when it cannot run here:

- zipnn: byte grouping + Huffman, decoded on the CPU (``ZipNN(input_format="torch")``).
- dfloat11: Huffman-coded exponents, decoded on the GPU by the PTX kernel the package ships,
  launched through cupy. The package's ``__init__`` pulls in its model loader (``pkg_resources``,
  accelerate, huggingface_hub), so this script loads only its encoder (``dfloat11_utils.py``)
  and ``decode.ptx`` from the installed package and launches the kernel as its
  ``compress_model`` correctness check does.
- nvCOMP (``nvidia.nvcomp``): ANS, Bitcomp, Cascaded, GDeflate, Zstd, LZ4, Snappy on the GPU,
  with a 16-bit data-type hint where the codec takes one; all units in one batched call.

The sample is split into units (``--unit``: one expert's tensors concatenated by default, the
unit OLED-MoE copies host->GPU; or every tensor alone; or everything as one buffer); each
library compresses every unit on its own. The ratio is compressed bytes over original bytes
(every table and header included); decode GB/s is decoded output bytes per second, timed with
CUDA events on one stream (GPU) or perf_counter (CPU) over --reps runs after --warmup runs.

    python tools/codec_libraries.py --random [--experts 16] [--json out.json]
    python tools/codec_libraries.py --model oled/data/default

The libraries are not dependencies of the project: install them first (`pip install zipnn
dfloat11 dahuffman nvidia-nvcomp-cu13`, or from wheels on a machine without network access:
`pip install --no-index --no-deps --target DIR WHEELS` and `PYTHONPATH=DIR`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import io
import json
import math
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

# LLaDA2.0-mini's routed expert (hidden 2048, moe_intermediate 512): fused gate+up and down
EXPERT_SHAPES = {"gate_up_proj": (1024, 2048), "down_proj": (2048, 512)}

# the launch configuration dfloat11 0.5.0 encodes for and decodes with (dfloat11.py)
DF11_BYTES_PER_THREAD = 8
DF11_THREADS_PER_BLOCK = 512

# (algorithm, options): 16-bit hints where the codec takes a data type
NVCOMP_CODECS: list[tuple[str, dict[str, Any]]] = [
    ("ANS", {"data_type": "<f2"}),
    ("ANS", {"data_type": "|u1"}),
    ("Bitcomp", {"data_type": "<u2"}),
    ("Cascaded", {"data_type": "<u2"}),
    ("GDeflate", {"algorithm_type": 0}),
    ("GDeflate", {"algorithm_type": 1}),
    ("Zstd", {}),
    ("LZ4", {"data_type": "<u2"}),
    ("Snappy", {}),
]

# torch dtype to view a bf16 buffer as, so that the array nvCOMP sees matches the hint
VIEW_DTYPES = {"<f2": torch.float16, "<u2": torch.uint16, "<i2": torch.int16, "|u1": torch.uint8}


class Unavailable(Exception):
    """A library that cannot run here; the message says why."""


@dataclass
class Sample:
    """The units to compress: flat, contiguous bf16 CPU tensors."""

    source: str
    unit: str
    names: list[str]
    units: list[torch.Tensor]
    tensors: int

    @property
    def nbytes(self) -> int:
        """Original bytes of all units."""
        return sum(u.numel() * u.element_size() for u in self.units)


@dataclass
class Row:
    """One codec's result on the sample."""

    library: str
    codec: str
    where: str
    ratio: float
    decode_gbps: float
    bit_exact: bool
    notes: list[str] = field(default_factory=list)


@dataclass
class Timing:
    """Repetitions and warm-up runs of each decode measurement."""

    reps: int
    warmup: int


def random_tensors(experts: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    """N(0, 0.02) bf16 tensors of LLaDA2.0-mini's expert shapes, seeded."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for e in range(experts):
        for proj, shape in EXPERT_SHAPES.items():
            w = torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02
            out.append((f"experts.{e}.{proj}.weight", w.to(torch.bfloat16)))
    return out


def checkpoint_tensors(directory: Path) -> list[tuple[str, torch.Tensor]]:
    """Every bf16 tensor whose key contains `.mlp.experts.` in a safetensors directory."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"no *.safetensors in {directory}")
    out = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if ".mlp.experts." in key and f.get_slice(key).get_dtype() == "BF16":
                    out.append((key, f.get_tensor(key)))
    if not out:
        raise SystemExit(f"no bf16 `.mlp.experts.` tensors in {directory}")
    return out


def expert_of(key: str) -> str:
    """The expert a key belongs to: its prefix up to `experts.N`."""
    m = re.match(r"(.*?experts\.\d+)\.", key)
    return m.group(1) if m else key


def make_sample(source: str, tensors: list[tuple[str, torch.Tensor]], unit: str) -> Sample:
    """Group the tensors into units (tensor, expert or all), each flattened and concatenated."""
    groups: dict[str, list[torch.Tensor]] = {}
    for key, t in tensors:
        name = {"tensor": key, "expert": expert_of(key), "all": "all"}[unit]
        groups.setdefault(name, []).append(t.contiguous().view(-1))
    units = [torch.cat(ts) if len(ts) > 1 else ts[0] for ts in groups.values()]
    return Sample(source, unit, list(groups), units, len(tensors))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality of two 16-bit buffers, compared as int16."""
    a = a.reshape(-1).view(torch.uint8).view(torch.int16)
    b = b.reshape(-1).view(torch.uint8).view(torch.int16)
    return a.shape == b.shape and torch.equal(a.to(b.device), b)


def version(dist: str) -> str:
    """An installed distribution's version, or '?'."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def gpu_name() -> str:
    """The current CUDA device's name."""
    return torch.cuda.get_device_name(torch.cuda.current_device())


def time_gpu(decode: Callable[[], object], stream: torch.cuda.Stream, timing: Timing) -> float:
    """Seconds per decode() on `stream`, by CUDA events around timing.reps runs after warm-up."""
    with torch.cuda.stream(stream):
        for _ in range(timing.warmup):
            decode()
        stream.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(timing.reps):
            decode()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / timing.reps


# --- zipnn --------------------------------------------------------------------------------------


def bench_zipnn(sample: Sample, timing: Timing, threads: int) -> list[Row]:
    """zipnn (CPU): per unit ZipNN.compress / decompress of a torch bf16 tensor."""
    try:
        from zipnn import ZipNN
    except ImportError as e:
        raise Unavailable(f"not importable ({e})") from e
    znn = ZipNN(input_format="torch", threads=threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.from_numpy on zipnn's read-only output bytes
        # compress a copy: zipnn 0.5.4 bit-reorders its input tensor in place
        comp = [bytes(znn.compress(u.clone())) for u in sample.units]
        exact = all(
            same_bits(znn.decompress(c), u) for c, u in zip(comp, sample.units, strict=True)
        )

        def decode() -> None:
            for c in comp:
                znn.decompress(c)

        for _ in range(timing.warmup):
            decode()
        t0 = time.perf_counter()
        for _ in range(timing.reps):
            decode()
        seconds = (time.perf_counter() - t0) / timing.reps
    ratio = sum(len(c) for c in comp) / sample.nbytes
    return [
        Row(
            f"zipnn {version('zipnn')}",
            "byte-grouped Huffman",
            f"cpu ({znn.threads} threads)",
            ratio,
            sample.nbytes / seconds / 1e9,
            exact,
        )
    ]


# --- dfloat11 -----------------------------------------------------------------------------------


def dfloat11_parts() -> tuple[ModuleType, Path]:
    """dfloat11's encoder module and decode.ptx, loaded without running the package __init__."""
    spec = importlib.util.find_spec("dfloat11")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("not installed")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    ptx = pkg / "decode.ptx"
    utils_path = pkg / "dfloat11_utils.py"
    if not (ptx.exists() and utils_path.exists()):
        raise Unavailable(f"{pkg} lacks decode.ptx or dfloat11_utils.py (not the 0.5 layout)")
    mod_spec = importlib.util.spec_from_file_location("dfloat11_utils_standalone", utils_path)
    assert mod_spec is not None and mod_spec.loader is not None
    utils = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(utils)
    except ImportError as e:  # dahuffman, tqdm
        raise Unavailable(f"its encoder needs {e.name}") from e
    return utils, ptx


@dataclass
class DF11Unit:
    """One unit in dfloat11's format, on the GPU, and its output buffer."""

    luts: torch.Tensor
    encoded: torch.Tensor
    sign_mantissa: torch.Tensor
    positions: torch.Tensor
    gaps: torch.Tensor
    out: torch.Tensor
    shared_mem: int
    nbytes: int


def df11_encode(utils: ModuleType, unit: torch.Tensor, device: torch.device) -> DF11Unit:
    """Encode one flat bf16 tensor as dfloat11.compress_model does (one Huffman table per unit)."""
    quiet = io.StringIO()
    with (
        contextlib.redirect_stdout(quiet),
        contextlib.redirect_stderr(quiet),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        _, counter = utils.get_codec(unit)
        codec, _, table = utils.get_32bit_codec(counter)
        luts = utils.get_luts(table)
        encoded, sign_mantissa, positions, gaps, _ = utils.encode_weights(
            [unit], codec, DF11_BYTES_PER_THREAD, DF11_THREADS_PER_BLOCK
        )
    pos = positions.numpy().astype("int64")
    shared_mem = DF11_THREADS_PER_BLOCK * 4 + 4 + int((pos[1:] - pos[:-1]).max()) * 2
    nbytes = (
        luts.numel()
        + encoded.numel()
        + sign_mantissa.numel()
        + positions.numel() * 4
        + gaps.numel()
    )
    return DF11Unit(
        luts.to(device),
        encoded.to(device),
        sign_mantissa.to(device),
        positions.view(torch.uint8).to(device),
        gaps.to(device),
        torch.empty(unit.numel(), dtype=torch.bfloat16, device=device),
        shared_mem,
        nbytes,
    )


def bench_dfloat11(sample: Sample, timing: Timing) -> list[Row]:
    """dfloat11 (GPU): its encoder per unit, its PTX kernel decoding into preallocated buffers."""
    try:
        import cupy as cp
    except ImportError as e:
        raise Unavailable("needs cupy and a CUDA device") from e
    if not torch.cuda.is_available():
        raise Unavailable("needs cupy and a CUDA device")
    utils, ptx = dfloat11_parts()
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        encoded = [df11_encode(utils, u, device) for u in sample.units]
        refs = [u.to(device) for u in sample.units]
    stream.synchronize()

    with cp.cuda.Device(device.index):
        kernel = cp.RawModule(path=str(ptx)).get_function("decode")
        most = max(e.shared_mem for e in encoded)
        if most > 48 * 1024:  # past the default dynamic shared memory limit
            attr = getattr(cp.cuda.driver, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", 8)
            cp.cuda.driver.funcSetAttribute(kernel.ptr, attr, most)
    with warnings.catch_warnings():  # cupy 14 deprecates ExternalStream for Stream.from_external
        warnings.simplefilter("ignore", DeprecationWarning)
        cp_stream = cp.cuda.ExternalStream(stream.cuda_stream, device.index)
    span = DF11_THREADS_PER_BLOCK * DF11_BYTES_PER_THREAD

    def decode() -> None:
        with cp.cuda.Device(device.index):
            for e in encoded:
                n_luts, n_bytes, n_elements = e.luts.shape[0], e.encoded.numel(), e.out.numel()
                kernel(
                    grid=(math.ceil(n_bytes / span),),
                    block=(DF11_THREADS_PER_BLOCK,),
                    shared_mem=e.shared_mem,
                    stream=cp_stream,
                    args=(
                        e.luts.data_ptr(),
                        e.encoded.data_ptr(),
                        e.sign_mantissa.data_ptr(),
                        e.positions.data_ptr(),
                        e.gaps.data_ptr(),
                        e.out.data_ptr(),
                        cp.uint32(n_luts),
                        cp.uint32(n_bytes),
                        cp.uint32(n_elements),
                    ),
                )

    seconds = time_gpu(decode, stream, timing)
    exact = all(same_bits(e.out, r) for e, r in zip(encoded, refs, strict=True))
    ratio = sum(e.nbytes for e in encoded) / sample.nbytes
    notes = [f"one kernel launch per unit, up to {most} B of shared memory"]
    return [
        Row(
            f"dfloat11 {version('dfloat11')}",
            "Huffman exponent (DF11)",
            f"gpu ({gpu_name()})",
            ratio,
            sample.nbytes / seconds / 1e9,
            exact,
            notes,
        )
    ]


# --- nvCOMP -------------------------------------------------------------------------------------


def nvcomp_tensor(array: Any) -> torch.Tensor:
    """A torch view of an nvcomp.Array on the GPU."""
    try:
        return torch.from_dlpack(array)
    except (TypeError, RuntimeError, BufferError):
        return torch.as_tensor(array, device="cuda")


def bench_nvcomp_codec(
    nvcomp: ModuleType,
    algorithm: str,
    options: dict[str, Any],
    refs: list[torch.Tensor],
    stream: torch.cuda.Stream,
    timing: Timing,
) -> tuple[float, float, bool, list[str]]:
    """Ratio, seconds per batched decode, bit-exactness and notes of one nvCOMP codec."""
    hint = options.get("data_type", "|u1")
    view = VIEW_DTYPES[hint]
    sid = stream.cuda_stream
    codec = nvcomp.Codec(algorithm=algorithm, cuda_stream=sid, **options)
    batched = hasattr(nvcomp, "BatchArray")  # nvCOMP >= 6: BatchArray, out=, decompression_config
    with torch.cuda.stream(stream):
        inputs = [r.view(torch.uint8).view(view) for r in refs]
        if batched:
            enc = codec.encode(nvcomp.as_arrays(inputs, sid))
            sizes = list(enc.buffer_sizes)
        else:
            enc = codec.encode([nvcomp.as_array(t, sid) for t in inputs])
            sizes = [e.buffer_size for e in enc]
    stream.synchronize()
    notes = []
    if batched:
        outs = [torch.empty_like(t) for t in inputs]
        out_batch = nvcomp.as_arrays(outs, sid)
        config = codec.decompression_config(enc)

        def decode() -> object:
            return codec.decode(enc, out=out_batch, decompression_config=config)

        notes.append("into preallocated buffers")
    else:

        def decode() -> object:
            return codec.decode(enc, data_type=hint)

        notes.append("nvCOMP < 6: decode allocates its output and reads the headers each call")
    with torch.cuda.stream(stream):
        decoded = decode()
    stream.synchronize()
    if batched:
        got = outs
    else:
        got = [nvcomp_tensor(d) for d in decoded]  # type: ignore[union-attr]
    exact = all(same_bits(g, r) for g, r in zip(got, refs, strict=True))
    del got, decoded
    seconds = time_gpu(decode, stream, timing)
    nbytes = sum(r.numel() * r.element_size() for r in refs)
    return sum(sizes) / nbytes, seconds, exact, notes


def bench_nvcomp(sample: Sample, timing: Timing, skipped: list[str]) -> list[Row]:
    """nvCOMP (GPU): each codec of NVCOMP_CODECS over all units in one batched call."""
    if not torch.cuda.is_available():
        raise Unavailable("needs a CUDA device")
    try:
        import nvidia.nvcomp as nvcomp
    except (ImportError, OSError) as e:
        raise Unavailable(f"not importable ({e})") from e
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        refs = [u.to(device) for u in sample.units]
    stream.synchronize()
    codecs = list(NVCOMP_CODECS)
    if hasattr(nvcomp, "BitshuffleMode"):  # nvCOMP >= 6: LZ4 over bit planes
        msb = nvcomp.BitshuffleMode.NVCOMP_BITSHUFFLE_MSB_FIRST
        codecs.append(("LZ4", {"data_type": "<u2", "bitshuffle_mode": msb}))
    rows = []
    lib = f"nvcomp {getattr(nvcomp, '__version__', version('nvidia-nvcomp-cu13'))}"
    for algorithm, options in codecs:
        label = algorithm + "".join(f" {k}={getattr(v, 'name', v)}" for k, v in options.items())
        label = label.replace("bitshuffle_mode=NVCOMP_BITSHUFFLE_", "bitshuffle=")
        try:
            ratio, seconds, exact, notes = bench_nvcomp_codec(
                nvcomp, algorithm, options, refs, stream, timing
            )
        except Exception as e:  # one codec's failure should not end the others
            skipped.append(f"nvcomp {label}: {type(e).__name__}: {e}".splitlines()[0])
            continue
        where = f"gpu ({gpu_name()})"
        rows.append(Row(lib, label, where, ratio, sample.nbytes / seconds / 1e9, exact, notes))
    return rows


# --- report -------------------------------------------------------------------------------------

LIBRARIES = ("zipnn", "dfloat11", "nvcomp")


def table(rows: list[Row]) -> str:
    """The rows as a fixed-width text table."""
    head = ("library", "codec", "decodes on", "ratio", "decode GB/s", "bit-exact")
    cells = [head] + [
        (
            r.library,
            r.codec,
            r.where,
            f"{r.ratio:.4f}",
            f"{r.decode_gbps:.2f}",
            "yes" if r.bit_exact else "NO",
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    right = {3, 4}
    lines = [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cell, widths, strict=True))
        )
        for cell in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def note_lines(rows: list[Row]) -> list[str]:
    """Each distinct note once, with the codecs it applies to (or a library's every codec)."""
    by_note: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        for n in r.notes:
            by_note.setdefault((r.library, n), []).append(r.codec)
    lines = []
    for (library, note), codecs in by_note.items():
        every = len(codecs) == sum(r.library == library for r in rows)
        which = "every codec" if every and len(codecs) > 1 else ", ".join(codecs)
        lines.append(f"{library} ({which}): {note}")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--random",
        action="store_true",
        help="N(0, 0.02) bf16 tensors of LLaDA2.0-mini's expert shapes",
    )
    src.add_argument(
        "--model",
        type=Path,
        help="a safetensors checkpoint directory: its bf16 `.mlp.experts.` tensors",
    )
    p.add_argument(
        "--experts", type=int, default=16, help="experts drawn with --random (default 16)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of --random (default 0)")
    p.add_argument(
        "--unit",
        choices=("expert", "tensor", "all"),
        default="expert",
        help="what each library compresses on its own: one expert's tensors concatenated (default), each tensor, or all",
    )
    p.add_argument(
        "--libraries",
        default=",".join(LIBRARIES),
        help=f"comma-separated subset of {','.join(LIBRARIES)}",
    )
    p.add_argument(
        "--reps", type=int, default=10, help="timed decodes of the whole sample (default 10)"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed decodes first (default 2)")
    p.add_argument(
        "--threads", type=int, default=0, help="zipnn threads (0: its default, min(cpus, 16))"
    )
    p.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = p.parse_args(argv)
    unknown = set(args.libraries.split(",")) - set(LIBRARIES)
    if unknown:
        p.error(f"unknown libraries: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Build the sample, run every library that can run here, print and optionally save."""
    args = parse_args(argv)
    if args.random:
        source = f"random N(0, 0.02) bf16, {args.experts} LLaDA2.0-mini experts, seed {args.seed}"
        tensors = random_tensors(args.experts, args.seed)
    else:
        source = str(args.model)
        tensors = checkpoint_tensors(args.model)
    sample = make_sample(source, tensors, args.unit)
    del tensors
    timing = Timing(args.reps, args.warmup)
    print(f"sample: {sample.source}")
    print(
        f"  {sample.tensors} tensors, {sample.nbytes / 1e6:.1f} MB bf16, "
        f"{len(sample.units)} units of {sample.unit} ({sample.nbytes / len(sample.units) / 1e6:.3f} MB each on average)"
    )
    print(f"  decode timed over {timing.reps} runs after {timing.warmup} warm-up runs")

    runs: dict[str, Callable[[list[str]], list[Row]]] = {
        "zipnn": lambda skipped: bench_zipnn(sample, timing, args.threads),
        "dfloat11": lambda skipped: bench_dfloat11(sample, timing),
        "nvcomp": lambda skipped: bench_nvcomp(sample, timing, skipped),
    }
    rows: list[Row] = []
    skipped: list[str] = []
    for name in args.libraries.split(","):
        try:
            rows += runs[name](skipped)
        except Unavailable as e:
            skipped.append(f"{name}: {e}")
    print()
    print(table(rows) if rows else "no library could run here")
    for line in note_lines(rows):
        print(f"note: {line}")
    for line in skipped:
        print(f"skipped: {line}")
    if args.json:
        report = {
            "sample": {
                "source": sample.source,
                "unit": sample.unit,
                "units": len(sample.units),
                "tensors": sample.tensors,
                "bytes": sample.nbytes,
            },
            "timing": asdict(timing),
            "rows": [asdict(r) for r in rows],
            "skipped": skipped,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
