"""What drive.c shares with Python, described once: `Drive` (the engine's tables, streams and
the runtime's entry points), `Call` (one layer call's graphs and buffers) and the tables of
the counts' columns (the engine metrics' FIELDS) and the landing buffer's parts. `DRIVE`
turns them into drive.c's generated header (`drive_state.h`), the ctypes mirrors and the
check on load (oled.clib)."""

from __future__ import annotations

from oled.clib import Field, Part, Struct, Table
from oled.offload.encoded import PARTS
from oled.offload.metrics import FIELDS

COUNTS = Table.of(
    "counts",
    "C",
    FIELDS,
    total="N_COUNTS",
    doc="Columns of Drive.counts' rows: the engine metrics' fields (oled.offload.metrics).",
)
LANDING = Table("landing", "LAND", {"parts": PARTS}, doc="Landing rounds in flight.")

DRIVE = Struct(
    "Drive",
    (
        Field("memcpy_async", "memcpy_fn"),
        Field("memcpy_batch", "void *", "batch12_fn or batch13_fn by batch_abi, or NULL"),
        Field("record", "record_fn"),
        Field("wait", "wait_fn"),
        Field("launch", "graph_fn"),
        Field("create", "create_fn"),
        Field("elapsed", "elapsed_fn"),
        *Field.many("int64_t", "batch_abi batch_min", "12 or 13; batch from this many (0: never)"),
        Field("batch_attrs", "void *", "one cudaMemcpyAttributes for every copy"),
        *Field.many("void *", "compute copy", "streams"),
        *Field.many("int64_t *", "src13 src2 cache13 cache2", "[L] table base addresses"),
        *Field.many("int64_t", "stage13 stage2 size13 size2", "stage tables; bytes per expert"),
        Field("stage_capacity", "int64_t", "experts per staged round"),
        Field("bind", "const Bind *", "the planner's (plan.c)"),
        Field("out", "const int64_t *", "its output: header, then the plan's arrays"),
        *Field.many("int64_t", "maps_host maps_dev map_rows num_experts", "[L, map_rows, E] int64"),
        Field("events", "void **", "[n_events] timing events, created on first use"),
        *Field.many("int64_t", "n_events used"),
        Field("log", "int64_t *", "[log_cap, 4]: layer, kind, start event, end event"),
        *Field.many("int64_t", "log_cap logged"),
        Field("stage_free", "void *", "after the last staged pass (NULL: the stage is free)"),
        Field("cpu_ready", "void *", "out: the CPU experts' activations are on the host"),
        Field("counts", "double *", "[L, N_COUNTS] sums since the last collect"),
        *Field.many("void **", "srcs dsts", "[2 E] batched copy arguments"),
        Field("sizes", "size_t *"),
        *Field.many("size_t", "failed attr_index"),
        Field("error", "int64_t", "the runtime's error code of a failed call"),
        # encoded copies (oled.offload.encoded; decode_execs NULL: plain rows), see drive.c
        Field("decoder", "void *"),
        Field("decode_execs", "const int64_t *", "[LAND_PARTS]"),
        Field("land_events", "void *const *", "[2, LAND_PARTS]: after landing, after decode"),
        *Field.many("int64_t", "land13 land2 land_rows plain13 plain2"),
        Field("desc_host", "int64_t *", "[desc_cap, desc_stride] pinned descriptor ring"),
        *Field.many("int64_t", "desc_dev desc_stride desc_cap"),
        Field("desc_used", "int64_t *", "the ring's taken rows, shared with the Python path"),
    ),
    doc="The engine's layer launches (oled.offload.drive_state.DRIVE).",
)
CALL = Struct(
    "Call",
    (
        Field("execs", "int64_t *", "[n_execs] pass graphs by slot-map row (0: not captured)"),
        *Field.many("int64_t", "n_execs ids_host w_host pairs x_dev x_host x_bytes"),
    ),
    doc="One (layer, tokens) key's static call: graphs, routing and activations.",
)
DRIVE_PART = Part(
    "drive", tables=(COUNTS, LANDING), structs=(DRIVE, CALL), doc="oled/offload/drive_state.py"
)
