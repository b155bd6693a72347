"""Read Llama-family weights from a Hugging Face folder or a GGUF file.

Both readers produce a :class:`Checkpoint`: a config plus tensors under HF names. A
tensor is either dense float32 or, for GGUF Q4_1, a :class:`GroupQuant4` kept exact so
the int4 runtime can execute the file's own 4-bit values.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from speculative.models.native.config import NativeConfig, config_from_hf
from speculative.models.native.quant import GroupQuant4, decode_q4_1, decode_q8_0

if TYPE_CHECKING:
    from speculative.models.gguf_file import GGUFFile, GGUFTensor

Weight = torch.Tensor | GroupQuant4


@dataclass
class Checkpoint:
    """Architecture plus weights named as in Hugging Face Llama checkpoints."""

    config: NativeConfig
    tensors: dict[str, Weight]
    name: str
    # "half": HF rotate-half layout of q/k rows; "interleaved": llama.cpp's (x0, x1) pairs.
    qk_layout: str = "half"

    def dense(self, key: str) -> torch.Tensor:
        """A weight as float32, dequantizing if needed."""
        value = self.tensors[key]
        if isinstance(value, GroupQuant4):
            return value.dequantize()
        return value.float()


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a HF folder (config.json + *.safetensors) or a .gguf file."""
    path = Path(path)
    if path.is_dir():
        return load_hf_folder(path)
    if path.suffix == ".gguf" and path.is_file():
        return load_gguf(path)
    raise ValueError(f"{path} is neither a Hugging Face model folder nor an existing .gguf file")


def load_hf_folder(folder: Path) -> Checkpoint:
    """Read config.json and every *.safetensors file of a HF checkpoint folder."""
    from safetensors.torch import load_file

    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder} has no config.json")
    config = config_from_hf(json.loads(config_path.read_text()))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weights")
    tensors: dict[str, Weight] = {}
    for file in files:
        tensors.update({k: v.float() for k, v in load_file(str(file)).items()})
    return Checkpoint(config, tensors, name=folder.name)


GGUF_ARCHITECTURES = {"llama", "mistral", "qwen2", "qwen3"}
# llama.cpp's converter permutes the q/k rows of llama-style models to interleaved RoPE
# pairs; Qwen's keep Hugging Face's rotate-half order (llama.cpp's NEOX rope).
_GGUF_ROTATE_HALF = {"qwen2", "qwen3"}


# Llama 3's frequency scaling as llama.cpp's converter stores it (not a weight)
_GGUF_ROPE_FACTORS = "rope_freqs.weight"
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_to_hf_name(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def _gguf_field(reader: GGUFFile, key: str, default: object = None) -> object:
    value = reader.fields.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"GGUF file lacks metadata {key!r}")
        return default
    return value


def gguf_config(reader: GGUFFile) -> NativeConfig:
    """Architecture from GGUF metadata (llama / mistral / qwen2 / qwen3)."""
    arch = str(_gguf_field(reader, "general.architecture"))
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; the native runtime reads "
            f"{sorted(GGUF_ARCHITECTURES)}"
        )
    scaling = reader.fields.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(
            f"unsupported RoPE scaling {scaling!r} in the GGUF file; the native runtime "
            "runs plain RoPE and Llama 3's (rope_freqs)"
        )
    num_heads = int(_gguf_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_gguf_field(reader, f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _gguf_field(reader, f"{arch}.vocab_size", 0) or len(
        _gguf_field(reader, "tokenizer.ggml.tokens")  # type: ignore[arg-type]
    )
    return NativeConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_gguf_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_gguf_field(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_gguf_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(
            _gguf_field(
                reader,
                f"{arch}.attention.key_length",
                _gguf_field(reader, f"{arch}.rope.dimension_count", hidden // num_heads),
            )
        ),
        rms_norm_eps=float(_gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        max_position_embeddings=int(_gguf_field(reader, f"{arch}.context_length", 2048)),
    )


def _decode_gguf_tensor(tensor: GGUFTensor) -> Weight:
    """One GGUF tensor as float32 or exact Q4_1 groups (shape in torch order)."""
    from gguf import GGMLQuantizationType, dequantize

    kind = tensor.tensor_type
    shape = tuple(int(s) for s in reversed(tensor.shape))
    data = tensor.data
    if kind == GGMLQuantizationType.Q4_1 and len(shape) == 2:
        return decode_q4_1(data, (shape[0], shape[1]))
    if kind == GGMLQuantizationType.Q8_0 and len(shape) == 2:
        return decode_q8_0(data, (shape[0], shape[1]))
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return torch.from_numpy(np.asarray(data, dtype=np.float32).reshape(shape).copy())
    values = dequantize(data, kind).astype(np.float32)
    return torch.from_numpy(values.reshape(shape).copy())


def rope_interleave_index(rows: int, num_heads: int) -> torch.Tensor:
    """Row order taking HF rotate-half q/k rows to llama.cpp's interleaved pairs.

    Interleaved row (head, pair, j) is HF row (head, j, pair), the permutation
    llama.cpp's converter applies (transformers' GGUF loader undoes it). Returns [rows].
    """
    half = rows // num_heads // 2
    index = torch.arange(rows).reshape(num_heads, 2, half)  # hf row = (head, j, pair)
    return index.transpose(1, 2).reshape(rows)


def load_gguf(path: Path) -> Checkpoint:
    """Read a llama.cpp GGUF file (llama/mistral/qwen2/qwen3 architectures)."""
    from speculative.models.gguf_file import read_gguf

    reader = read_gguf(path)
    config = gguf_config(reader)
    tensors: dict[str, Weight] = {}
    for tensor in reader.tensors:
        if tensor.name == _GGUF_ROPE_FACTORS:
            factors = _decode_gguf_tensor(tensor)
            assert isinstance(factors, torch.Tensor)
            config = replace(config, rope_factors=tuple(factors.flatten().tolist()))
            continue
        tensors[gguf_to_hf_name(tensor.name)] = _decode_gguf_tensor(tensor)
    rotate_half = str(_gguf_field(reader, "general.architecture")) in _GGUF_ROTATE_HALF
    layout = "half" if rotate_half else "interleaved"
    return Checkpoint(config, tensors, name=path.stem, qk_layout=layout)
