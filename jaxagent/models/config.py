"""Typed, hashable configuration of the decoder family.

One `DecoderConfig` describes every supported architecture; the differences between
families are switches, not separate implementations:

=============  ================  ==========  =======  ==================
family         HF architecture   q/k/v bias  q/k norm rope scaling
=============  ================  ==========  =======  ==================
Llama 3.x      LlamaForCausalLM  no [1]      no       default / linear / llama3
SmolLM2        LlamaForCausalLM  no          no       default
Qwen2 / 2.5    Qwen2ForCausalLM  yes         no       default / linear / llama3
Qwen3          Qwen3ForCausalLM  no [1]      yes      default / linear / llama3
=============  ================  ==========  =======  ==================

[1] Llama and Qwen3 accept `attention_bias=True` (bias on q, k, v and o).

The config is a frozen dataclass so it can be a static argument of `jax.jit` and a
static field of a pytree.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

#: HF `architectures` names this package loads, with the `model_type` each implies.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

#: LoRA target names (the HF / PEFT module names).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class UnsupportedArchitectureError(ValueError):
    """Raised for a checkpoint whose architecture or options this package cannot run."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters `W + (alpha / rank) * A @ B` on the named projections.

    Attributes:
      rank: inner dimension r of `A [in, r]` and `B [r, out]`.
      alpha: scale numerator; the update is scaled by `alpha / rank`.
      targets: which projections get adapters, a subset of `LORA_TARGETS`.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraConfig.rank must be a positive int, got {self.rank!r}")
        object.__setattr__(self, "targets", tuple(self.targets))
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad or not self.targets:
            raise ValueError(
                f"LoraConfig.targets has unknown entries {bad} (or is empty); choose from {list(LORA_TARGETS)}"
            )

    @property
    def scale(self) -> float:
        return float(self.alpha) / float(self.rank)


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Architecture of one decoder-only transformer (RoPE, GQA, RMSNorm, SwiGLU)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    #: rope scaling as a sorted tuple of (key, value) pairs, e.g. (("factor", 8.0), ...).
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    rope_type: str = "default"
    max_position_embeddings: int = 32768
    model_type: str = "qwen2"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    lora: LoraConfig | None = None
    #: the attention implementation (`jaxagent.models.attention`): "auto", "dense",
    #: "blocked" or "cudnn"; not part of the checkpoint
    attention: str = "auto"

    def __post_init__(self):
        from jaxagent.models.attention import IMPLEMENTATIONS

        if self.attention not in IMPLEMENTATIONS:
            raise ValueError(f"DecoderConfig.attention must be one of {list(IMPLEMENTATIONS)}, got {self.attention!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"DecoderConfig.{name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"DecoderConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedArchitectureError(
                f"rope type {self.rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
            )
        if self.model_type not in SUPPORTED_ARCHITECTURES.values():
            raise UnsupportedArchitectureError(
                f"model_type {self.model_type!r} is not supported; supported: "
                f"{sorted(set(SUPPORTED_ARCHITECTURES.values()))}"
            )
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **kw) -> DecoderConfig:
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------------ rope
    def inv_freq(self) -> np.ndarray:
        """Inverse RoPE frequencies `[head_dim / 2]` float32, as the HF checkpoints expect.

        default: `f_i = theta^(-2i / d)`.  linear: `f_i / factor`.
        llama3 (Llama 3.1 "frequency-dependent" scaling): with wavelength `w_i = 2 pi / f_i`,
        `L = original_max_position_embeddings`, low/high factors `a`, `b`:
        `w_i > L / a` -> `f_i / factor`; `w_i < L / b` -> `f_i`; otherwise the blend
        `(1 - s) f_i / factor + s f_i` with `s = (L / w_i - a) / (b - a)`.
        """
        d = self.head_dim
        inv = (1.0 / (np.float32(self.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))).astype(
            np.float32
        )
        p = dict(self.rope_scaling)
        if self.rope_type == "linear":
            inv = (inv / np.float32(p["factor"])).astype(np.float32)
        elif self.rope_type == "llama3":
            factor = np.float32(p["factor"])
            lo, hi = float(p["low_freq_factor"]), float(p["high_freq_factor"])
            old = float(p["original_max_position_embeddings"])
            wavelen = (np.float32(2 * math.pi) / inv).astype(np.float32)
            scaled = np.where(wavelen > old / lo, inv / factor, inv).astype(np.float32)
            smooth = ((old / wavelen - lo) / (hi - lo)).astype(np.float32)
            smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
            medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
            inv = np.where(medium, smoothed, scaled).astype(np.float32)
        return inv

    # ---------------------------------------------------------- HF conversion
    @classmethod
    def from_hf(cls, hf_config) -> DecoderConfig:
        """Builds a config from a `transformers.PretrainedConfig` (or its dict).

        Raises `UnsupportedArchitectureError` naming the supported architectures when
        the checkpoint is of another kind, or uses an option this decoder does not run.
        """
        d = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and model_type not in SUPPORTED_ARCHITECTURES.values():
            raise UnsupportedArchitectureError(
                f"architecture {archs or model_type!r} is not supported; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)} (model_type {sorted(set(SUPPORTED_ARCHITECTURES.values()))})"
            )
        if arch is not None:
            model_type = SUPPORTED_ARCHITECTURES[arch]
        assert model_type is not None  # the architecture's, or one of SUPPORTED_ARCHITECTURES' (checked above)
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedArchitectureError(f"hidden_act {d.get('hidden_act')!r} is not supported; only 'silu'")
        if d.get("mlp_bias"):
            raise UnsupportedArchitectureError("mlp_bias=True is not supported")
        if d.get("use_sliding_window"):
            raise UnsupportedArchitectureError("use_sliding_window=True is not supported")
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedArchitectureError("partial_rotary_factor != 1 is not supported")
        rope.pop("partial_rotary_factor", None)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedArchitectureError(
                f"rope type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
            )
        heads = d["num_attention_heads"]
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rope_theta=float(theta),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            qk_norm=model_type == "qwen3",
            rope_scaling=tuple(sorted(rope.items())),
            rope_type=rope_type,
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
        )

    def to_hf(self):
        """The equivalent `transformers` config object (LlamaConfig / Qwen2Config / Qwen3Config)."""
        import transformers

        if self.model_type == "qwen2" and (not self.qkv_bias or self.o_bias):
            raise UnsupportedArchitectureError("Qwen2 checkpoints have q/k/v bias and no o bias")
        if self.model_type in ("llama", "qwen3") and self.qkv_bias != self.o_bias:
            raise UnsupportedArchitectureError(f"{self.model_type} checkpoints have bias on all of q/k/v/o or on none")
        if self.qk_norm != (self.model_type == "qwen3"):
            raise UnsupportedArchitectureError("q/k norm exists exactly for model_type 'qwen3'")
        rope = {"rope_type": self.rope_type, "rope_theta": self.rope_theta, **dict(self.rope_scaling)}
        common = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=rope,
            bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        if self.model_type == "llama":
            cfg = transformers.LlamaConfig(attention_bias=self.qkv_bias, **common)
            arch = "LlamaForCausalLM"
        elif self.model_type == "qwen2":
            cfg = transformers.Qwen2Config(**common)
            arch = "Qwen2ForCausalLM"
        else:
            cfg = transformers.Qwen3Config(attention_bias=self.qkv_bias, **common)
            arch = "Qwen3ForCausalLM"
        cfg.architectures = [arch]
        return cfg


def tiny_config(vocab_size: int = 259, **kw) -> DecoderConfig:
    """A 2-layer Qwen2-style decoder (hidden 32, 4 heads / 2 KV heads of dim 8)."""
    base: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qkv_bias=True,
        model_type="qwen2",
    )
    base.update(kw)
    return DecoderConfig(**base)
