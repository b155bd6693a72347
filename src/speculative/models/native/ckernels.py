"""The C decoder (``kernels.c``): build it once, pack weights for it, call it via ctypes.

The library is compiled on first use with the system C compiler (``cc``; AVX2 + FMA +
OpenMP) into ``~/.cache/speculative/kernels/`` under a hash of the source and flags, so
later processes just load it. Without a compiler or on a CPU without AVX2/FMA,
:func:`load_kernels` raises :class:`KernelsUnavailable` and the native runtime falls
back to its PyTorch decoder.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from speculative.models.native.config import NativeConfig
from speculative.models.native.decoder_base import DecoderBase, layer_weight_bytes
from speculative.models.native.layers import LayerWeights, lm_head_precision
from speculative.models.native.linear import tensor_bytes
from speculative.models.native.loading import Weight
from speculative.models.native.quant import (
    GROUP_SIZE,
    GroupQuant4,
    quantize_group4,
    quantize_int8_per_channel,
)

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = (
    "-O3",
    "-mavx2",
    "-mfma",
    "-mf16c",
    "-ffp-contract=off",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-Werror=implicit-function-declaration",
)
ABI_VERSION = 3
FORMATS = {"fp32": 0, "bf16": 1, "int8": 2, "int4": 3}


class KernelsUnavailable(ValueError):
    """The C decoder cannot be built or run here (the reason is the message).

    A ValueError so that asking for ``backend="kernels"`` where it cannot run is reported
    like any other unusable option (one line from the CLI)."""


def kernel_cache_dir() -> Path:
    """Where compiled kernels live: ``<package cache>/kernels``."""
    from speculative.models.loading import cache_root

    return cache_root() / "kernels"


def build_kernels(cache_dir: Path | None = None) -> Path:
    """Compile ``kernels.c`` unless a build of this exact source and flags exists."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or shutil.which(compiler) is None:
        raise KernelsUnavailable(f"no C compiler ({compiler or 'cc/gcc'}) found")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    folder = cache_dir or kernel_cache_dir()
    target = folder / f"libspeculative-{digest}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise KernelsUnavailable(f"compiling {SOURCE.name} failed: {result.stderr.strip()}")
        os.replace(built, target)  # atomic: concurrent builders agree on the result
    return target


def load_kernels(cache_dir: Path | None = None) -> ctypes.CDLL:
    """The compiled C decoder, built if needed. Raises KernelsUnavailable."""
    path = build_kernels(cache_dir)
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        raise KernelsUnavailable(f"cannot load {path.name}: {error}") from error
    if library.spec_abi_version() != ABI_VERSION:
        raise KernelsUnavailable("stale kernel build (ABI version mismatch)")
    if not library.spec_cpu_supported():
        raise KernelsUnavailable("this CPU lacks AVX2/FMA/F16C")
    pointer, i32 = ctypes.c_void_p, ctypes.c_int32
    library.spec_work_floats.argtypes = [pointer, i32, i32]
    library.spec_work_floats.restype = ctypes.c_int64
    library.spec_forward.argtypes = [pointer, pointer, i32, i32, pointer, pointer]
    library.spec_forward.argtypes += [pointer, pointer, pointer, pointer, i32]
    library.spec_forward.restype = None
    return library


# ---- structures mirrored from kernels.c ------------------------------------------------


class _Linear(ctypes.Structure):
    _fields_ = [
        ("format", ctypes.c_int32),
        ("in_features", ctypes.c_int32),
        ("out_features", ctypes.c_int32),
        ("pad_", ctypes.c_int32),
        ("weight", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("minimum", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("intermediate", ctypes.c_int32),
        ("vocab", ctypes.c_int32),
        ("max_length", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("pad_", ctypes.c_int32),
        ("layers", ctypes.c_void_p),
        ("final_norm", ctypes.c_void_p),
        ("lm_head", _Linear),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
    ]


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[out, in] uint8 in 0..15 -> [out, in / 2]: byte j of each group of 32 holds q[j] in
    its low nibble and q[j + 16] in its high nibble (GGUF Q4_1's order)."""
    out_features, in_features = q.shape
    groups = q.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    return (groups[..., :16] | (groups[..., 16:] << 4)).reshape(out_features, -1).contiguous()


@dataclass
class KernelLinear:
    """One weight matrix in a format of kernels.c; keeps its tensors alive."""

    format: str
    weight: torch.Tensor  # fp32/bf16(as int16)/int8: [out, in]; int4: [out, in / 2] uint8
    in_features: int
    out_features: int
    scale: torch.Tensor | None = None  # int8: [out] float32; int4: [out, in / 32] float16
    minimum: torch.Tensor | None = None  # int4: [out, in / 32] float16
    bias: torch.Tensor | None = None  # [out] float32

    @classmethod
    def pack(
        cls, weight: torch.Tensor | GroupQuant4, bias: torch.Tensor | None, precision: str
    ) -> KernelLinear:
        """Pack weight [out, in] (dense or GroupQuant4) and bias [out] for ``precision``."""
        if precision not in FORMATS:
            raise ValueError(f"unknown precision {precision!r}; expected one of {tuple(FORMATS)}")
        bias = None if bias is None else bias.float().contiguous()
        if precision == "int4":
            quant = weight if isinstance(weight, GroupQuant4) else quantize_group4(weight.float())
            out_features, in_features = quant.q.shape
            # fp16 scales: GGUF Q4_1 stores them so, making this lossless for GGUF files
            return cls(
                "int4",
                pack_nibbles(quant.q),
                in_features,
                out_features,
                scale=quant.scale.to(torch.float16).contiguous(),
                minimum=quant.minimum.to(torch.float16).contiguous(),
                bias=bias,
            )
        dense = (weight.dequantize() if isinstance(weight, GroupQuant4) else weight).float()
        out_features, in_features = dense.shape
        if precision == "fp32":
            return cls("fp32", dense.contiguous(), in_features, out_features, bias=bias)
        if precision == "bf16":
            bits = dense.to(torch.bfloat16).contiguous().view(torch.int16)
            return cls("bf16", bits, in_features, out_features, bias=bias)
        qweight, scale = quantize_int8_per_channel(dense)
        return cls(
            "int8",
            qweight.contiguous(),
            in_features,
            out_features,
            scale=scale.float().contiguous(),
            bias=bias,
        )

    def struct(self) -> _Linear:
        return _Linear(
            FORMATS[self.format],
            self.in_features,
            self.out_features,
            0,
            _address(self.weight),
            _address(self.scale),
            _address(self.minimum),
            _address(self.bias),
        )

    def weight_bytes(self) -> int:
        return tensor_bytes(self.weight, self.scale, self.minimum, self.bias)


@dataclass
class KernelLayer:
    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor  # [hidden]
    qkv: KernelLinear
    o: KernelLinear
    gate_up: KernelLinear
    down: KernelLinear

    def struct(self) -> _Layer:
        return _Layer(
            _address(self.input_norm),
            _address(self.post_attention_norm),
            self.qkv.struct(),
            self.o.struct(),
            self.gate_up.struct(),
            self.down.struct(),
        )

    def weight_bytes(self) -> int:
        return layer_weight_bytes(self)


def kernel_shape_problem(
    hidden: int, intermediate: int, q_size: int, head_dim: int
) -> str | None:
    """Why kernels.c cannot run these shapes (None when it can)."""
    for name, width in (("hidden", hidden), ("intermediate", intermediate), ("q_size", q_size)):
        if width % GROUP_SIZE:
            return f"{name} size {width} is not a multiple of {GROUP_SIZE}"
    if head_dim % 16:
        return f"head_dim {head_dim} is not a multiple of 16"
    return None


class KernelDecoder(DecoderBase):
    """Decoder layers, final norm, output head and KV cache, run by kernels.c."""

    def __init__(
        self,
        config: NativeConfig,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,  # [hidden]
        head: Weight,  # [vocab, hidden]
        rotations: torch.Tensor,  # [max_length, head_dim / 2] complex64
        precision: str,
        library: ctypes.CDLL,
    ) -> None:
        problem = kernel_shape_problem(
            config.hidden_size, config.intermediate_size, config.q_size, config.head_dim
        )
        if problem is not None:
            raise KernelsUnavailable(problem)
        super().__init__()
        self.config = config
        self.layers = [
            KernelLayer(
                input_norm=w.input_norm.float().contiguous(),
                post_attention_norm=w.post_attention_norm.float().contiguous(),
                qkv=KernelLinear.pack(w.qkv, w.qkv_bias, precision),
                o=KernelLinear.pack(w.o, None, precision),
                gate_up=KernelLinear.pack(w.gate_up, None, precision),
                down=KernelLinear.pack(w.down, None, precision),
            )
            for w in layers
        ]
        self.final_norm = final_norm.float().contiguous()
        self.lm_head = KernelLinear.pack(head, None, lm_head_precision(precision))
        self._cos = rotations.real.contiguous()  # [max_length, head_dim / 2]
        self._sin = rotations.imag.contiguous()
        self._library = library
        self._layer_array = (_Layer * len(self.layers))(*(x.struct() for x in self.layers))
        self._model = _Model(
            num_layers=config.num_layers,
            hidden=config.hidden_size,
            heads=config.num_heads,
            kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            intermediate=config.intermediate_size,
            vocab=self.lm_head.out_features,
            max_length=rotations.shape[0],
            eps=config.rms_norm_eps,
            pad_=0,
            layers=ctypes.addressof(self._layer_array),
            final_norm=self.final_norm.data_ptr(),
            lm_head=self.lm_head.struct(),
            cos=self._cos.data_ptr(),
            sin=self._sin.data_ptr(),
        )

    def cache_shape(self, batch: int) -> tuple[int, ...]:
        """[batch, layers, kv_heads, max_length, head_dim]."""
        cfg = self.config
        return (batch, cfg.num_layers, cfg.num_kv_heads, self._model.max_length, cfg.head_dim)

    def copy_cache_from(self, source: KernelDecoder, length: int) -> None:
        """Copy slots [0, length) of ``source``'s cache (same layout, batch of one)."""
        self.k_cache[:, :, :, :length] = source.k_cache[:, :, :, :length]
        self.v_cache[:, :, :, :length] = source.v_cache[:, :, :, :length]

    def keep_slots(self, first: int, slots: list[int]) -> None:
        """Move cache slots ``slots`` (increasing, >= first) to first, first + 1, ..."""
        index = torch.tensor(slots, dtype=torch.long)
        kept = slice(first, first + len(slots))
        self.k_cache[:, :, :, kept] = self.k_cache.index_select(3, index)
        self.v_cache[:, :, :, kept] = self.v_cache.index_select(3, index)

    def forward(
        self,
        hidden: torch.Tensor,  # [batch, k, hidden] float32 embeddings, owned (updated in place)
        start: int,
        positions: torch.Tensor,  # [batch, k] int64
        attention_mask: torch.Tensor | None,  # [k, k] bool or None (causal)
    ) -> torch.Tensor:  # [batch, k, vocab]
        batch, k, _ = hidden.shape
        hidden = hidden.float().contiguous()
        positions = positions.to(torch.int64).contiguous()
        mask = None
        if attention_mask is not None:
            mask = attention_mask.to(torch.uint8).contiguous()  # [k, k]
        threads = torch.get_num_threads()
        model = ctypes.byref(self._model)
        work = torch.empty(self._library.spec_work_floats(model, k, threads))
        logits = torch.empty(batch, k, self.vocab_size)
        for b in range(batch):
            self._library.spec_forward(
                model,
                hidden[b].data_ptr(),
                k,
                start,
                positions[b].data_ptr(),
                None if mask is None else mask.data_ptr(),
                self.k_cache[b].data_ptr(),
                self.v_cache[b].data_ptr(),
                logits[b].data_ptr(),
                work.data_ptr(),
                threads,
            )
        return logits
