"""The recipe schema: a model, a budget, policies, decoding, a workload, tracking and a study.

Every default a command uses lives here (decoding's come from `DecodeConfig`, which the decoder
validates); commands and `--set` only override them.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from oled import registry as reg
from oled.decoding.config import DecodeConfig
from oled.model.config import BUILTIN
from oled.offload.budget import Budget
from oled.recipe.toml import dump_toml
from oled.registry import suggest

DEFAULT_MODEL = "builtin:tiny"  # the trained default model shipped in the package
TRACE = "trace:"


def registered_builtin(kind: str, value: str) -> str:
    """`value`, checked to name a registered `kind` when it is `builtin:NAME`."""
    if value.startswith(BUILTIN):
        name = value.removeprefix(BUILTIN)
        entries = reg.registry(kind)
        if name not in entries:
            raise ValueError(f"unknown {kind} '{name}'{suggest(name, entries.names())}")
    return value


class Strict(BaseModel):
    """Base of every recipe section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ModelSection(Strict):
    """Which checkpoint to run."""

    path: str  # a checkpoint directory or builtin:NAME (a registered model preset)

    @property
    def name(self) -> str:
        """The built-in's name or the checkpoint directory's."""
        if self.path.startswith(BUILTIN):
            return self.path.removeprefix(BUILTIN)
        return Path(self.path).expanduser().resolve().name or self.path

    @field_validator("path")
    @classmethod
    def _known_builtin(cls, value: str) -> str:
        return registered_builtin("model", value)


BudgetSection = Budget  # the `runtime.budget` table: the budget the runtime sizes (one object)


class RuntimeSection(Strict):
    """Device, precision and the expert budget."""

    device: str = "auto"
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    cpu_threads: int | None = Field(default=None, ge=1)
    budget: Budget = Field(default_factory=lambda: Budget(resident=True))
    stage_capacity: int = Field(
        default=8, ge=1
    )  # experts per round of uncached copies (2 rounds held)
    prefetch: int = Field(default=0, ge=0)  # experts per MoE layer copied a layer ahead (0 = off)
    # what the copies ahead follow: the next layer's router on this layer's input, or what the
    # next layer routed the forward before (on the link's spare time; replays can judge it)
    ahead_from: Literal["router", "previous"] = "router"
    cost: str = "calibrate"  # "calibrate" or a cost profile name such as "h200"
    cuda_graphs: bool = True  # replay forwards as CUDA graphs on CUDA (the same tokens)
    kernels: Literal["auto", "triton", "torch"] = "auto"  # fused Triton kernels on CUDA
    planner: Literal["auto", "compiled", "python"] = "auto"  # host decisions (same decisions)
    max_batch: int = Field(
        default=8, ge=1
    )  # generations `oled serve` decodes together (1: in turn)
    max_queue: int = Field(default=64, ge=0)  # requests `oled serve` keeps waiting (more: 429)
    # a prompt's tokens per batched forward while others decode, whole blocks (0: all at once)
    prefill_chunk: int = Field(default=0, ge=0)
    # how misses cross the link: bf16 rows, encoded bit-exact, or fp8 / int4 (lossy: other tokens)
    transfer: Literal["plain", "lossless", "fp8", "int4"] = "plain"
    # processes (one per device) that split every layer's experts in contiguous shares
    # (oled.model.parallel); an offload budget applies to each device over its own share
    devices: int = Field(default=1, ge=1)

    @field_validator("kernels", "transfer", "ahead_from", mode="before")
    @classmethod
    def _known(cls, value: Any, info: ValidationInfo) -> Any:
        """A name outside the choices, said as the runtime's own checks say it."""
        name = info.field_name or ""
        choices = get_args(cls.model_fields[name].annotation)
        if isinstance(value, str) and value not in choices:
            raise ValueError(f"unknown {name} {value!r}; choose from {', '.join(choices)}")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError(f"expected auto, cpu, cuda or cuda:N (got {value!r})")
        return value


RUNTIME = RuntimeSection()  # the runtime defaults
DECODING = DecodeConfig()  # the decoding defaults


class DecodingSection(Strict):
    """Block diffusion decoding (oled.decoding.config)."""

    block_length: int = Field(default=DECODING.block_length, ge=1)
    threshold: float = Field(default=DECODING.threshold, gt=0, le=1)
    max_new_tokens: int = Field(default=DECODING.max_new_tokens, ge=1)
    temperature: float = Field(default=DECODING.temperature, ge=0)
    seed: int = DECODING.seed
    use_cache: bool = DECODING.use_cache  # keep a finished block's KV as the prefix
    steps: int | None = Field(
        default=DECODING.steps, ge=1
    )  # per block: >= block_length/steps a forward
    strict_threshold: bool = DECODING.strict_threshold  # commit > threshold, as LLaDA2's generate

    @model_validator(mode="after")
    def _decodable(self) -> DecodingSection:
        """The checks across fields are the decoder's own (DecodeConfig)."""
        self.config()
        return self

    def config(self) -> DecodeConfig:
        """The decoder's settings."""
        return DecodeConfig(**self.model_dump())


class Component(BaseModel):
    """A policy component: `kind` names a registry entry, other keys are its parameters."""

    model_config = ConfigDict(extra="allow")

    kind: str

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class PolicySection(Strict):
    """The three policy components; omitted ones are None (the runtime's default)."""

    allocation: Component | None = None
    retention: Component | None = None
    compensation: Component | None = None

    def build(self) -> dict[str, Any]:
        """The policy objects by kind (None where a component is omitted)."""
        return {kind: _build(kind, getattr(self, kind)) for kind in reg.POLICY_KINDS}


def _build(kind: str, component: Component | None) -> Any:
    return (
        None if component is None else reg.registry(kind).build(component.kind, **component.params)
    )


class WorkloadSection(Strict):
    """Prompts to generate from and how often."""

    prompts: str = "builtin:short"  # builtin:NAME (a registered workload) or a JSONL path
    warmup: int = Field(default=1, ge=0)
    repeats: int = Field(default=1, ge=1)
    chat: bool = True
    follow: bool = False  # commit the all-resident model's tokens (Runtime.reference)
    agreement: bool = True  # free-running: compare each generation with the resident model's
    routing: str = "model"  # "model" (the routers') or "trace:PATH" (a routing replay)
    trace_prompts: str | None = None  # with a trace: which of its prompts (I, A:B, list; all)

    @field_validator("routing")
    @classmethod
    def _routing(cls, value: str) -> str:
        if value != "model" and not (value.startswith(TRACE) and value.removeprefix(TRACE)):
            raise ValueError(f"expected 'model' or 'trace:PATH' (got {value!r})")
        return value

    @field_validator("trace_prompts", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("prompts")
    @classmethod
    def _known_builtin(cls, value: str) -> str:
        return registered_builtin("workload", value)


class TrackingSection(Strict):
    """Where results go."""

    mlflow: bool = True
    tracking_uri: str | None = None  # default: sqlite:///<cwd>/mlflow.db
    experiment: str = "oled"
    report_dir: str = "reports"


class SearchSpace(Strict):
    """One tuned key: `choices`, or `low`/`high` (with `int`, `log`, `step`)."""

    low: float | None = None
    high: float | None = None
    choices: list[Any] | None = None
    int_: bool = Field(default=False, alias="int")
    log: bool = False
    step: float | None = None

    @model_validator(mode="after")
    def _shape(self) -> SearchSpace:
        if self.choices is not None:
            if self.low is not None or self.high is not None or not self.choices:
                raise ValueError("give either a non-empty 'choices' or 'low' and 'high'")
        elif self.low is None or self.high is None or self.low > self.high:
            raise ValueError("give 'low' <= 'high' (or 'choices')")
        return self

    def sample_value(self) -> Any:
        """A value inside the space (used to check that the tuned key exists)."""
        if self.choices is not None:
            return self.choices[0]
        return int(self.low or 0) if self.int_ else self.low


class TuneSection(Strict):
    """An Optuna study over recipe keys."""

    trials: int = Field(default=20, ge=1)
    storage: str | None = None  # Optuna URL or journal:PATH; default sqlite:///<cwd>/optuna.db
    study_name: str | None = None  # default: the recipe's name
    objective: str = "simulate"  # a registered objective: simulate, run, ...
    direction: Literal["minimize", "maximize"] = "minimize"
    metric: str = "ms_per_iteration"
    trace: str | None = None  # trace file for the simulate objective
    seed: int | None = None
    params: dict[str, SearchSpace] = Field(default_factory=dict)

    @field_validator("objective")
    @classmethod
    def _known_objective(cls, value: str) -> str:
        objectives = reg.registry("objective")
        if value not in objectives:
            raise ValueError(f"unknown objective '{value}'{suggest(value, objectives.names())}")
        return value


class Recipe(Strict):
    """A whole experiment."""

    model: ModelSection
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    decoding: DecodingSection = Field(default_factory=DecodingSection)
    policy: PolicySection = Field(default_factory=PolicySection)
    workload: WorkloadSection = Field(default_factory=WorkloadSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    tune: TuneSection | None = None

    _path: Path | None = PrivateAttr(None)

    @property
    def path(self) -> Path | None:
        """The file the recipe was loaded from, if any."""
        return self._path

    @property
    def name(self) -> str:
        """The file's stem, or `recipe`."""
        return self._path.stem if self._path else "recipe"

    @property
    def folder(self) -> Path | None:
        """The folder of the recipe's file: relative paths it names are looked up there first."""
        return self._path.parent if self._path else None

    def routing_trace(self) -> Path | None:
        """The trace file that `workload.routing` replays (None: the model routes itself)."""
        return routing_trace(self.workload.routing, self.folder)

    def data(self) -> dict[str, Any]:
        """The recipe as plain TOML-ready data (None values dropped)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    def flatten(self) -> dict[str, str]:
        """Dotted keys to string values (for MLflow params)."""
        return {key: _as_str(value) for key, value in _flat(self.data()).items()}

    def hash(self) -> str:
        """Short digest of what decides the measurement (tracking and tune excluded)."""
        data = {k: v for k, v in self.data().items() if k not in ("tracking", "tune")}
        for (section, key), default in HASHED_WHEN_SET.items():
            if key in data[section] and data[section][key] == default:
                del data[section][key]
        text = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def to_toml(self) -> str:
        """The recipe as TOML text that `load_recipe` accepts again."""
        return dump_toml(self.data())

    def with_values(self, values: dict[str, Any], origins: dict[str, str] | None = None) -> Recipe:
        """A copy with dotted keys set, validated; errors name each key by its `origins`
        (default `--set KEY`)."""
        from oled.recipe.load import override

        return override(self, values, origins)


def routing_trace(routing: str, base: Path | None = None) -> Path | None:
    """The trace file of a `workload.routing` value (None for "model"): a relative path is
    looked up next to the recipe (`base`) first, then from the working directory."""
    if not routing.startswith(TRACE):
        return None
    return beside(routing.removeprefix(TRACE), base)


def beside(spec: str | Path, base: Path | None = None) -> Path:
    """A file a recipe names: a relative path next to the recipe (`base`) when it is there,
    else from the working directory."""
    path = Path(spec).expanduser()
    if not path.is_absolute() and base is not None and (base / path).exists():
        return base / path
    return path


# Keys added after recipes were first hashed: at these defaults a recipe hashes as before.
HASHED_WHEN_SET = {
    ("workload", "routing"): "model",
    ("decoding", "use_cache"): True,
    ("runtime", "stage_capacity"): 8,
    ("decoding", "steps"): None,
    ("decoding", "strict_threshold"): False,
    ("workload", "agreement"): True,
    ("runtime", "max_batch"): 8,
    ("runtime", "transfer"): "plain",
    ("runtime", "max_queue"): 64,
    ("runtime", "ahead_from"): "router",
    ("runtime", "devices"): 1,
    ("runtime", "prefill_chunk"): 0,
}


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out |= _flat(value, f"{name}.")
        else:
            out[name] = value
    return out


def _as_str(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)
