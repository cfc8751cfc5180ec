"""LLaDA2 MoE configuration: the fields of a checkpoint's `config.json`, checked on load."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

from oled.registry import register, suggest

ARCHITECTURES = ("LLaDA2MoeModelLM", "BailingMoeV2ForCausalLM")


class ConfigError(ValueError):
    """A config.json that is missing, malformed or asks for something we do not support."""


class ConfigWarning(UserWarning):
    """A config.json field that LLaDA2's reference code ignores, set to a value that honouring
    it would change the model: OLED-MoE ignores it too, and says so."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and routing hyper-parameters of a LLaDA2 MoE model (DESIGN.md section 4)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    first_k_dense_replace: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int | None  # None (null): no shared expert, as the reference code reads it
    moe_intermediate_size: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    partial_rotary_factor: float = 0.5
    score_function: str = "sigmoid"
    moe_router_enable_expert_bias: bool = True
    router_dtype: str = "fp32"
    norm_topk_prob: bool = True
    use_qk_norm: bool = True
    use_qkv_bias: bool = False
    use_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    moe_shared_expert_intermediate_size: int | None = None
    pad_token_id: int | None = None
    eos_token_id: int | None = None
    architectures: tuple[str, ...] = ("LLaDA2MoeModelLM",)
    model_type: str = "llada2_moe"

    def __post_init__(self) -> None:
        self.validate()

    # Derived shapes -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the decoder layers that hold routed experts."""
        return list(range(self.first_k_dense_replace, self.num_hidden_layers))

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    @property
    def shared_intermediate_size(self) -> int:
        """The shared expert's width as the reference code sizes it (0: none):
        moe_intermediate_size x num_shared_experts; moe_shared_expert_intermediate_size is
        ignored there, and here (see `ignored_fields`)."""
        return self.moe_intermediate_size * (self.num_shared_experts or 0)

    def ignored_fields(self) -> list[str]:
        """Fields that the reference code ignores and whose value would change the model if it
        were honoured: each one as a sentence (empty when none)."""
        out = []
        if not self.norm_topk_prob and self.num_experts_per_tok > 1:
            out.append(
                "norm_topk_prob = false: LLaDA2's reference code ignores it and always "
                "normalises the top-k gate weights; so does OLED-MoE"
            )
        shared = self.moe_shared_expert_intermediate_size
        if shared and shared != self.shared_intermediate_size:
            out.append(
                f"moe_shared_expert_intermediate_size = {shared}: LLaDA2's reference code "
                "ignores it and sizes the shared expert as moe_intermediate_size x "
                f"num_shared_experts = {self.shared_intermediate_size}; so does OLED-MoE"
            )
        return out

    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    # Checks ---------------------------------------------------------------------------------
    def validate(self, source: str = "config.json") -> None:
        """Raise ConfigError for values this implementation does not support."""

        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"{source}: {key} = {getattr(self, key)!r}: {why}")

        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim"):
            if getattr(self, key) <= 0:
                raise bad(key, "must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", "must divide num_attention_heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise bad(
                "partial_rotary_factor", "head_dim * factor must be even and in (0, head_dim]"
            )
        if self.num_shared_experts is not None and self.num_shared_experts < 0:
            raise bad("num_shared_experts", "must be >= 0 or null")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise bad("first_k_dense_replace", "must be between 0 and num_hidden_layers")
        if self.num_experts % self.n_group:
            raise bad("n_group", "must divide num_experts")
        if not 1 <= self.topk_group <= self.n_group:
            raise bad("topk_group", "must be between 1 and n_group")
        if self.num_experts // self.n_group < 2:
            raise bad("n_group", "each group needs at least 2 experts (group score = top-2 sum)")
        if not 1 <= self.num_experts_per_tok <= self.topk_group * self.num_experts // self.n_group:
            raise bad("num_experts_per_tok", "must fit inside the kept groups")
        if self.score_function != "sigmoid":
            raise bad("score_function", "only sigmoid routing is supported (as in LLaDA2)")
        if self.hidden_act != "silu":
            raise bad("hidden_act", "only silu is supported")
        if self.use_qkv_bias or self.use_bias:
            raise bad("use_qkv_bias" if self.use_qkv_bias else "use_bias", "biases are unsupported")
        if not self.use_qk_norm:
            raise bad("use_qk_norm", "LLaDA2 always normalises q and k; false is unsupported")
        if self.router_dtype not in ("fp32", "float32"):
            raise bad("router_dtype", "routing is computed in fp32")

    # I/O ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        known = {f.name for f in fields(cls)}
        required = [
            f.name
            for f in fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [k for k in required if k not in raw]
        if missing:
            raise ConfigError(f"{source}: missing required key(s): {', '.join(missing)}")
        archs = tuple(raw.get("architectures") or ARCHITECTURES[:1])
        if not set(archs) & set(ARCHITECTURES):
            raise ConfigError(
                f"{source}: architectures = {list(archs)}: expected one of {list(ARCHITECTURES)}"
            )
        if raw.get("rope_scaling"):
            raise ConfigError(f"{source}: rope_scaling = {raw['rope_scaling']!r}: unsupported")
        values = {k: v for k, v in raw.items() if k in known}
        values["architectures"] = archs
        for key in ("eos_token_id", "pad_token_id"):
            if isinstance(values.get(key), list):
                values[key] = values[key][0]
        try:
            cfg = cls(**values)
        except ConfigError as err:
            raise ConfigError(str(err).replace("config.json", source, 1)) from None
        except TypeError as err:
            raise ConfigError(f"{source}: {err}") from None
        for sentence in cfg.ignored_fields():
            warnings.warn(f"{source}: {sentence}", ConfigWarning, stacklevel=2)
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        elif not path.exists():
            raise ConfigError(f"{path}: no such checkpoint directory")
        if not path.exists():
            raise ConfigError(f"{path}: no config.json here: not a LLaDA2 checkpoint directory")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{err.lineno}: invalid JSON: {err.msg}") from None
        return cls.from_dict(raw, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["architectures"] = list(self.architectures)
        return {k: v for k, v in out.items() if v is not None or k == "num_shared_experts"}

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        """The named shape of `SHAPES` (a preset of `oled model init --preset`)."""
        if name not in SHAPES:
            hint = suggest(name, SHAPES)
            raise ValueError(f"unknown preset {name!r}{hint}; choose from {', '.join(SHAPES)}")
        return SHAPES[name]()


def mini_config() -> ModelConfig:
    """LLaDA2.0-mini's configuration, as in its config.json."""
    return ModelConfig(
        vocab_size=157184,
        hidden_size=2048,
        intermediate_size=5120,
        num_hidden_layers=20,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        first_k_dense_replace=1,
        num_experts=256,
        num_experts_per_tok=8,
        num_shared_experts=1,
        moe_intermediate_size=512,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        rope_theta=600000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=16384,
        pad_token_id=156892,
        eos_token_id=156892,
    )


def flash_config() -> ModelConfig:
    """LLaDA2.0-flash's configuration (its model card's config.json): mini's, at 32 layers,
    hidden 4096, dense intermediate 9216, 32 heads and expert intermediate 1024 (102.9B
    parameters, 99.9B of them in routed experts)."""
    return replace(
        mini_config(),
        hidden_size=4096,
        intermediate_size=9216,
        num_hidden_layers=32,
        num_attention_heads=32,
        moe_intermediate_size=1024,
    )


def tiny_config() -> ModelConfig:
    """Decodes quickly on 2 CPU cores: 4 layers (1 dense), hidden 128, 32 experts, top-4."""
    return replace(
        mini_config(),
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=64,
        n_group=4,
        topk_group=2,
        max_position_embeddings=4096,
        pad_token_id=1024 - 292,
        eos_token_id=1024 - 292,
    )


def small_config() -> ModelConfig:
    """A step up for CPU policy studies: 8 layers, hidden 256, 64 experts, top-6."""
    return replace(
        tiny_config(),
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        head_dim=32,
        num_experts=64,
        num_experts_per_tok=6,
        moe_intermediate_size=128,
        n_group=8,
        topk_group=4,
        pad_token_id=4096 - 292,
        eos_token_id=4096 - 292,
    )


# The one table of named model shapes: the presets of `oled model init --preset`; the ones in
# BUILTIN_MODELS are also checkpoints a recipe names as `builtin:NAME` (made on first use; the
# real model's shape is too large for that).
SHAPES: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny_config,
    "small": small_config,
    "mini-shape": mini_config,
    "flash-shape": flash_config,
}
BUILTIN = "builtin:"
BUILTIN_MODELS = ("tiny", "small")
SHIPPED = "tiny"  # the built-in whose trained weights ship in the package (oled/data/default)
for _name in BUILTIN_MODELS:
    register("model", _name, SHAPES[_name])


def shipped_default() -> Path | None:
    """The trained default model shipped with the package (oled/data/default), if present."""
    path = Path(str(resources.files("oled").joinpath("data/default")))
    return path if (path / "config.json").exists() else None


def builtin_name(model: str) -> str | None:
    """The built-in's name of a model given as `builtin:NAME` (None for a directory);
    ValueError unless it names one of BUILTIN_MODELS."""
    if not model.startswith(BUILTIN):
        return None
    name = model.removeprefix(BUILTIN)
    if name not in BUILTIN_MODELS:
        raise ValueError(
            f"unknown built-in model {model!r}; choose from {BUILTIN}{list(BUILTIN_MODELS)}"
        )
    return name


def builtin_config(name: str) -> ModelConfig:
    """A built-in's config without making its checkpoint: the shipped default's, else its
    shape's (the random checkpoint made on first use has that shape)."""
    shipped = shipped_default() if name == SHIPPED else None
    return ModelConfig.from_json(shipped) if shipped else ModelConfig.from_name(name)
