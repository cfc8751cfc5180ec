"""The package's C libraries and what they share with Python, each fact described once.

A `Struct` lists its fields with their C types; a `Table` names a list of constants. A `Part`
(one C source's share: its structs and tables) turns them into a C header that the build
writes beside the sources (the C declarations, the enums and, in the source that defines
`OLED_<PART>_CONTRACT`, the contract: the compiler's own offsets and sizes of every field and
the tables' values), and into the Python side: the ctypes mirror of each struct (`Struct.ctype`)
and each table's names (`Table.at`, `Table.index`). On load the contract is checked against
the mirrors (`check`), so a library built from other sources, or a compiler that lays a struct
out otherwise, is a ContractError before anything runs.

`Library` builds sources with their generated headers once per source and machine into the
cache directory ($OLED_HOME/native), with the system's C compiler (`$CC`, else `cc`, else
`gcc`), and loads the result with ctypes.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import zip_longest
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from oled.paths import cache_home

# no FMA contraction or fast math: the same rounding as numpy
FLAGS = (
    "-O2",
    "-std=c11",
    "-shared",
    "-fPIC",
    "-fno-strict-aliasing",
    "-ffp-contract=off",
    "-fno-fast-math",
)
PYTHON_PLANNER = 'runtime.planner = "python" in the recipe, or --set runtime.planner=python'

SCALARS: dict[str, type[Any]] = {
    "int64_t": ctypes.c_int64,
    "int32_t": ctypes.c_int32,
    "uint8_t": ctypes.c_uint8,
    "double": ctypes.c_double,
    "float": ctypes.c_float,
    "size_t": ctypes.c_size_t,
}


class NativeUnavailable(OSError):
    """A C library cannot be built or loaded here: what this machine lacks (a C compiler, a
    loadable library), so an OSError, which commands report as one line."""


class ContractError(RuntimeError):
    """Compiled code and its Python mirrors (ctypes structs, tables) disagree: a defect of the
    package, never a reason to fall back to Python, so it is raised wherever the library is
    asked for."""


# -- the description -----------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One field of a struct: its name, its C type (a scalar of SCALARS, a nested Struct, or
    any pointer type, which ctypes sees as an address) and what it holds."""

    name: str
    ctype: str | Struct
    doc: str = ""

    @classmethod
    def many(cls, ctype: str, names: str, doc: str = "") -> tuple[Field, ...]:
        """Fields of one C type, named in `names` (space-separated); `doc` goes with the first."""
        return tuple(cls(n, ctype, doc if i == 0 else "") for i, n in enumerate(names.split()))

    @property
    def mirror(self) -> type[Any]:
        """The field's ctypes type."""
        if isinstance(self.ctype, Struct):
            return self.ctype.ctype
        return SCALARS.get(self.ctype, ctypes.c_void_p)

    def c_line(self) -> str:
        ctype = self.ctype.name if isinstance(self.ctype, Struct) else self.ctype
        space = "" if ctype.endswith("*") else " "
        doc = f" /* {self.doc} */" if self.doc else ""
        return f"    {ctype}{space}{self.name};{doc}"


@dataclass(frozen=True)
class Struct:
    """A struct that C and Python share, described once."""

    name: str
    fields: tuple[Field, ...]
    doc: str = ""

    @cached_property
    def ctype(self) -> Any:
        """The ctypes mirror (one ctypes.Structure class per description; Any: its fields are
        made at run time)."""
        fields = [(f.name, f.mirror) for f in self.fields]
        return type(self.name, (ctypes.Structure,), {"_fields_": fields, "__doc__": self.doc})

    def c_decl(self) -> str:
        lines = [f"/* {self.doc} */"] if self.doc else []
        lines += [f"typedef struct {self.name} {{", *(f.c_line() for f in self.fields)]
        return "\n".join([*lines, f"}} {self.name};"])

    def c_rows(self) -> str:
        rows = ", ".join(f"FIELD({self.name}, {f.name})" for f in self.fields)
        return f"static const ContractRow {_c_name(self.name)}_FIELDS[] = {{{rows}}};"


@dataclass(frozen=True)
class Table:
    """Named constants that C and Python share: a C enum `PREFIX_NAME` (and `total`, the
    count, when given) and, in Python, `at.name` and `index[name]`."""

    name: str  # as the contract reports it
    prefix: str
    entries: Mapping[str, int]
    total: str | None = None
    doc: str = ""
    c_names: Mapping[str, str] | None = None  # entry -> an existing C constant: no enum

    @classmethod
    def of(cls, name: str, prefix: str, names: Sequence[str], **kw: Any) -> Table:
        """A table numbering `names` from 0 in order."""
        return cls(name, prefix, {n: i for i, n in enumerate(names)}, **kw)

    @property
    def index(self) -> dict[str, int]:
        return dict(self.entries)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)

    @cached_property
    def at(self) -> SimpleNamespace:
        """The values by attribute: `table.at.hits`."""
        return SimpleNamespace(**{_py_name(k): v for k, v in self.entries.items()})

    def c_enum(self) -> str:
        if self.c_names is not None:
            return ""
        items = [f"{self.prefix}_{_c_name(k)} = {v}" for k, v in self.entries.items()]
        if self.total:
            items.append(f"{self.total} = {len(self.entries)}")
        doc = f"/* {self.doc} */\n" if self.doc else ""
        return doc + "enum {\n    " + ",\n    ".join(items) + "\n};"

    def c_constant(self, key: str) -> str:
        if self.c_names is not None:
            return self.c_names[key]
        return f"{self.prefix}_{_c_name(key)}"

    def c_rows(self) -> str:
        rows = ", ".join(f'ENTRY("{k}", {self.c_constant(k)})' for k in self.entries)
        return f"static const ContractRow {_c_name(self.name)}_ROWS[] = {{{rows}}};"


@dataclass(frozen=True)
class Part:
    """One C source's share of the description: its tables and structs (nested ones first),
    written as the header `<name>_state.h`."""

    name: str
    tables: tuple[Table, ...] = ()
    structs: tuple[Struct, ...] = ()
    doc: str = ""

    @property
    def header_name(self) -> str:
        return f"{self.name}_state.h"

    def header(self) -> str:
        """The generated C header."""
        guard = f"OLED_{self.name.upper()}_STATE_H"
        flag = f"OLED_{self.name.upper()}_CONTRACT"
        body = [t.c_enum() for t in self.tables if t.c_names is None]
        body += [s.c_decl() for s in self.structs]
        contract = [s.c_rows() for s in self.structs] + [t.c_rows() for t in self.tables]
        entries = [f"STRUCT({s.name}, {_c_name(s.name)}_FIELDS)" for s in self.structs]
        entries += [f'TABLE("{t.name}", {_c_name(t.name)}_ROWS)' for t in self.tables]
        return "\n\n".join(
            [
                f"/* Generated from {self.doc or 'its Python description'}: do not edit. */",
                f"#ifndef {guard}\n#define {guard}",
                '#include <stddef.h>\n#include <stdint.h>\n\n#include "oled_contract.h"',
                *body,
                f"#ifdef {flag}",
                *contract,
                "static const Contract CONTRACT[] = {" + ", ".join(entries) + "};",
                f"int64_t oled_{self.name}_contract(const Contract **out) "
                "{ *out = CONTRACT; return N_ROWS(CONTRACT); }",
                f"void oled_{self.name}_contract_rows(int64_t *sizes) "
                "{ sizes[0] = (int64_t)sizeof(ContractRow); sizes[1] = (int64_t)sizeof(Contract); }",
                f"#endif /* {flag} */",
                f"#endif /* {guard} */\n",
            ]
        )

    def check(self, lib: ctypes.CDLL) -> None:
        """This part's contract in `lib` against the mirrors; ContractError at a difference."""
        sizes = (ctypes.c_int64 * 2)()
        getattr(lib, f"oled_{self.name}_contract_rows")(sizes)
        mine = [ctypes.sizeof(_Row), ctypes.sizeof(_Table)]
        if list(sizes) != mine:
            raise ContractError(
                f"{self.name}.c's contract rows are {list(sizes)} bytes, the mirrors {mine}"
            )
        check(
            lib,
            self.name,
            {s.name: s.ctype for s in self.structs},
            {t.name: t.index for t in self.tables},
        )


CONTRACT_H = """/* Generated (oled.clib): how a library reports its structs and tables to Python. */
#ifndef OLED_CONTRACT_H
#define OLED_CONTRACT_H
#include <stddef.h>
#include <stdint.h>
/* per struct its fields {name, offsetof, sizeof} in declaration order and, as `size`, its
 * sizeof; per table its entries {name, value, 0} and -1 as `size` */
typedef struct {
    const char *name;
    int64_t value, size;
} ContractRow;
typedef struct {
    const char *name;
    int64_t size, n_rows;
    const ContractRow *rows;
} Contract;
#define FIELD(type, f) {#f, (int64_t)offsetof(type, f), (int64_t)sizeof(((type *)0)->f)}
#define ENTRY(name, value) {name, value, 0}
#define N_ROWS(rows) ((int64_t)(sizeof(rows) / sizeof((rows)[0])))
#define STRUCT(type, fields) {#type, (int64_t)sizeof(type), N_ROWS(fields), fields}
#define TABLE(name, entries) {name, -1, N_ROWS(entries), entries}
#endif
"""


def _c_name(name: str) -> str:
    return re.sub(r"\W+", "_", name).upper()


def _py_name(name: str) -> str:
    return re.sub(r"\W+", "_", name).lower()


# -- the contract --------------------------------------------------------------------------


class _Row(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_int64), ("size", ctypes.c_int64)]


class _Table(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("size", ctypes.c_int64),
        ("n_rows", ctypes.c_int64),
        ("rows", ctypes.POINTER(_Row)),
    ]


@dataclass(frozen=True)
class Reported:
    """A struct's layout or a table of names as the C side reports it."""

    size: int  # the struct's sizeof; -1 for a table
    rows: tuple[tuple[str, int, int], ...]  # struct: (field, offset, size); table: (name, value, 0)


def contract(lib: ctypes.CDLL, part: str) -> dict[str, Reported]:
    """What `part`'s source reports through oled_`part`_contract, by struct or table name."""
    fn = getattr(lib, f"oled_{part}_contract")
    fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.POINTER(ctypes.POINTER(_Table))]
    tables = ctypes.POINTER(_Table)()
    n = fn(ctypes.byref(tables))
    return {
        t.name.decode(): Reported(
            t.size, tuple((r.name.decode(), r.value, r.size) for r in t.rows[: t.n_rows])
        )
        for t in tables[:n]
    }


def check(
    lib: ctypes.CDLL,
    part: str,
    structs: Mapping[str, type[ctypes.Structure]],
    tables: Mapping[str, Mapping[str, int]],
) -> None:
    """`part`'s contract against the Python mirrors: ctypes `structs` and `tables` (name ->
    value) by the C side's names; ContractError at the first difference."""
    reported = contract(lib, part)
    unchecked = set(reported) ^ (set(structs) | set(tables))
    if unchecked:
        raise ContractError(
            f"{part}.c and its Python mirrors name different structs and tables: "
            f"{sorted(unchecked)}"
        )
    for name, struct in structs.items():
        check_struct(name, struct, reported[name], source=f"{part}.c")
    for name, table in tables.items():
        check_table(name, table, reported[name], source=f"{part}.c")


def check_struct(
    name: str, struct: type[ctypes.Structure], reported: Reported, *, source: str
) -> None:
    """The ctypes mirror `struct` of C's struct `name`: the same fields, in order, at the same
    offsets with the same sizes, and the same size; else ContractError."""
    fields = [f[0] for f in struct._fields_]
    mine = [(f, getattr(struct, f).offset, getattr(struct, f).size) for f in fields]
    for i, (theirs, ours) in enumerate(zip_longest(reported.rows, mine)):
        if theirs != ours:
            raise ContractError(
                f"{source} and its ctypes mirror disagree on {name} field {i}: "
                f"C has {_field(theirs)}, the mirror {_field(ours)}"
            )
    if ctypes.sizeof(struct) != reported.size:
        raise ContractError(
            f"{source} and its ctypes mirror disagree on sizeof({name}): "
            f"{reported.size} in C, {ctypes.sizeof(struct)} in the mirror"
        )


def check_table(name: str, table: Mapping[str, int], reported: Reported, *, source: str) -> None:
    """The Python side's `table` (name -> value) against C's table `name`; else ContractError."""
    theirs = {key: value for key, value, _ in reported.rows}
    for key in dict.fromkeys([*theirs, *table]):
        if theirs.get(key) != table.get(key):
            raise ContractError(
                f"{source} and its Python mirror disagree on the {name}: "
                f"{key!r} is {_value(theirs.get(key))} in C, {_value(table.get(key))} in Python"
            )


def _field(row: tuple[str, int, int] | None) -> str:
    return "no field" if row is None else f"{row[0]!r} at offset {row[1]} ({row[2]} bytes)"


def _value(value: int | None) -> str:
    return "missing" if value is None else str(value)


# -- building and loading ------------------------------------------------------------------


@dataclass
class Library:
    """C sources built into one library with the generated headers of `parts`; `declare`
    gives its entry points' signatures. `load` builds once per source and machine and checks
    every part's contract."""

    name: str
    sources: tuple[Path, ...]
    parts: tuple[Part, ...]
    includes: tuple[Path, ...] = ()  # hand-written headers (in the build's tag)
    declare: Callable[[ctypes.CDLL], None] = lambda lib: None
    flags: tuple[str, ...] = ()  # after FLAGS; "-march=native" tags the build by the CPU
    _loaded: ctypes.CDLL | NativeUnavailable | None = field(default=None, repr=False)

    def load(self) -> ctypes.CDLL:
        """The library, built and loaded, every part's contract checked: NativeUnavailable
        when it cannot be had (remembered: a failed build is not retried in this process),
        ContractError whenever a contract does not hold."""
        if self._loaded is None:
            self._loaded = self._open()
        if isinstance(self._loaded, NativeUnavailable):
            raise self._loaded
        for part in self.parts:
            part.check(self._loaded)
        return self._loaded

    def forget(self) -> None:
        """Load anew on the next `load` (for tests that change what the build finds)."""
        self._loaded = None

    def generated(self) -> dict[str, str]:
        """The headers the build writes: file name -> text."""
        return {"oled_contract.h": CONTRACT_H, **{p.header_name: p.header() for p in self.parts}}

    def _open(self) -> ctypes.CDLL | NativeUnavailable:
        target = self._target()
        if isinstance(target, NativeUnavailable):
            return target
        try:
            if not target.exists():
                self._build(target)
            lib = ctypes.CDLL(str(target))
            self.declare(lib)
        except NativeUnavailable as e:
            return e
        except OSError as e:
            return NativeUnavailable(f"cannot build or load {target}: {e}")
        return lib

    def _target(self) -> Path | NativeUnavailable:
        """The library's path in the cache, tagged by the flags, sources and headers."""
        digest = hashlib.sha256(" ".join((*FLAGS, *self.flags)).encode())
        if "-march=native" in self.flags:
            digest.update(cpu_features().encode())
        for path in (*self.sources, *self.includes):
            try:
                digest.update(path.read_bytes())
            except OSError as e:
                return NativeUnavailable(f"cannot read {path}: {e}")
        for text in self.generated().values():
            digest.update(text.encode())
        machine = f"{sys.platform}-{platform.machine()}"
        return cache_home() / "native" / f"{self.name}-{machine}-{digest.hexdigest()[:16]}.so"

    def _build(self, target: Path) -> None:
        cc = compiler()
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as work:
            for name, text in self.generated().items():
                Path(work, name).write_text(text)
            dirs = dict.fromkeys([work, *(str(h.parent) for h in self.includes)])
            tmp = Path(work, target.name)  # then renamed: no torn file
            cmd = [cc, *FLAGS, *self.flags, *(f"-I{d}" for d in dirs), "-o", str(tmp)]
            cmd += [*map(str, self.sources), "-lm"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode:
                raise NativeUnavailable(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
            os.replace(tmp, target)


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model and feature flags (a build for this CPU only is tagged by them)."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return platform.processor()
    keys = ("model name", "flags", "Features", "CPU part")
    return "\n".join(dict.fromkeys(line for line in lines if line.split(":")[0].strip() in keys))


def compiler() -> str:
    """The C compiler to build with: $CC, else `cc`, else `gcc` (found on $PATH)."""
    tried = [f"$CC={os.environ['CC']}"] if os.environ.get("CC") else ["cc"]
    found = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    if not found:
        raise NativeUnavailable(
            f"no C compiler found (tried {', '.join([*tried, 'gcc'])} on $PATH): the compiled "
            f"planner and layer launches need one; install one or set $CC, or plan in Python ({PYTHON_PLANNER})"
        )
    return found


def address(a: Any) -> int:
    """The data address of a numpy array."""
    return int(a.__array_interface__["data"][0])
