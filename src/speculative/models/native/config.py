"""Architecture hyper-parameters of a Llama-family model, read from HF or GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from speculative.models.base import check_context


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (``rope_type == "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class NativeConfig:
    """The shape of a Llama/Mistral/Qwen2/Qwen3-style decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int | None = None
    # a GGUF's rope_freqs: each pair's frequency is divided by its factor (llama.cpp's form
    # of Llama 3's scaling, computed by its converter); [head_dim // 2] or None
    rope_factors: tuple[float, ...] | None = None
    # the attention window of a model whose layers (some or all) see only the last
    # ``sliding_window`` positions (Mistral 7B v0.1, Qwen2 with use_sliding_window); the
    # native runtime attends over the whole context, which equals the window's attention
    # while the context fits it, so its context window stops there (:func:`context_window`)
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


def config_from_hf(raw: dict[str, Any]) -> NativeConfig:
    """Build a config from a Hugging Face ``config.json`` dictionary."""
    model_type = raw.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; the native runtime handles "
            f"{sorted(SUPPORTED_MODEL_TYPES)}"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"only SwiGLU (hidden_act='silu') is supported, got {raw['hidden_act']!r}")
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = raw.get("head_dim") or hidden // num_heads
    rope_params = raw.get("rope_parameters") or {}
    rope_theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    scaling_raw = raw.get("rope_scaling") or rope_params
    return NativeConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        rope_scaling=rope_scaling_from_dict(scaling_raw),
        max_position_embeddings=raw.get("max_position_embeddings"),
        sliding_window=_sliding_window(raw, model_type, int(raw["num_hidden_layers"])),
    )


def _sliding_window(raw: dict[str, Any], model_type: str, num_layers: int) -> int | None:
    """The window of a config's sliding-window layers, as transformers reads it, or None
    when every layer attends to the whole context. Mistral slides on every layer over
    ``sliding_window`` (4096 where the config does not name it; null turns it off); Qwen2
    and Qwen3 only with ``use_sliding_window``, on the layers an explicit ``layer_types``
    names or else those from ``max_window_layers`` (28) on; Llama never."""
    if model_type == "llama":
        return None
    window = raw.get("sliding_window", 4096)
    if model_type == "mistral":
        slides = True
    elif not raw.get("use_sliding_window"):
        return None
    elif raw.get("layer_types") is not None:
        slides = "sliding_attention" in raw["layer_types"]
    else:
        slides = raw.get("max_window_layers", 28) < num_layers
    return int(window) if slides and window else None


DEFAULT_CONTEXT = 2048  # positions where a checkpoint names no context length


def context_window(config: NativeConfig, requested: int | None = None) -> int:
    """The positions a native model runs: ``requested``, or by default the model's own
    context length (``max_position_embeddings``; a GGUF's ``context_length``). Never past
    a sliding window, which the runtime does not implement: inside it, attention over the
    whole context is the window's attention, so the outputs stay the model's."""
    own = config.max_position_embeddings or DEFAULT_CONTEXT
    window = config.sliding_window
    if requested is None:
        return own if window is None else min(own, window)
    check_context(requested, own)
    if window is not None and requested > window:
        raise ValueError(
            f"this model attends over a sliding window of {window} tokens, which the native "
            f"runtime does not implement: its context stops at {window} tokens, where whole "
            f"attention equals the window's; --runtime transformers runs longer contexts"
        )
    return requested


def rope_scaling_from_dict(raw: dict[str, Any] | None) -> RopeScaling | None:
    """Parse ``rope_scaling``; only ``default`` and ``llama3`` are supported."""
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, llama3")
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )


def rope_inverse_frequencies(config: NativeConfig) -> torch.Tensor:
    """Per-pair rotation frequencies, with llama3 scaling applied. Returns [head_dim // 2]."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    inv_freq = 1.0 / (config.rope_theta**exponents)  # [head_dim // 2]
    if config.rope_factors is not None:
        if len(config.rope_factors) != config.head_dim // 2:
            raise ValueError(
                f"rope_freqs holds {len(config.rope_factors)} factors, not head_dim / 2 = "
                f"{config.head_dim // 2}"
            )
        inv_freq = inv_freq / torch.tensor(config.rope_factors, dtype=torch.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [head_dim // 2]
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)
