"""The C decoder (``kernels.c``): build it once, pack weights for it, call it via ctypes.

The library is compiled on first use with the system C compiler (``cc``, OpenMP) into
``~/.cache/speculative/kernels/`` under a hash of the source and flags, so later processes
just load it. There is one build per instruction set: ``avx2`` (AVX2 + FMA + F16C, the
baseline) and ``avx512`` (adds AVX-512 F/BW/VL/DQ + VNNI). ``$SPECULATIVE_KERNEL_ISA``
(``auto``, the default: the best this CPU runs; ``avx2``; ``avx512``) picks one; both give
the same bits. Without a compiler or on a CPU without the features,
:func:`load_kernels` raises :class:`KernelsUnavailable` (naming the missing feature) and
the native runtime falls back to its PyTorch decoder.

Weights are repacked at load time into the kernels' panel layouts (:func:`pack_panels`,
:func:`pack_q4_blocks`, :func:`pack_q8_blocks`); the values stay exactly the model's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from speculative.models.base import KERNEL_OPS
from speculative.models.native.config import NativeConfig
from speculative.models.native.decoder_base import DecoderBase, PackedLayer, Segment
from speculative.models.native.hugepages import huge_page_bytes, place_on_huge_pages
from speculative.models.native.layers import LayerWeights
from speculative.models.native.linear import as_group_quant4, dense_values, tensor_bytes
from speculative.models.native.loading import Weight
from speculative.models.native.quant import (
    GROUP_SIZE,
    quantize_int8_per_channel,
)
from speculative.models.precision import traits
from speculative.sampling.probs import EXACT_RENORMALIZE_LIMIT, RowProbs

SOURCE = Path(__file__).with_name("kernels.c")
COMMON_FLAGS = (
    "-O3",
    "-ffp-contract=off",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-Werror=implicit-function-declaration",
)
# One library per instruction set; "avx512" adds AVX-512 VNNI integer dots for int4 (the
# same sums as AVX2's, so both give the same bits).
ISA_FLAGS = {
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": (
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx512vnni",
    ),
}
# bit -> name, as spec_cpu_features() reports them
CPU_FEATURES = {
    1: "avx2",
    2: "fma",
    4: "f16c",
    8: "avx512f",
    16: "avx512bw",
    32: "avx512vl",
    64: "avx512dq",
    128: "avx512vnni",
}
ISA_NEEDS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni"),
}
ISA_ENV = "SPECULATIVE_KERNEL_ISA"
ISA_CHOICES = ("auto", "avx2", "avx512")
ABI_VERSION = 19
PANEL = 16  # outputs per packed panel, fp32 / bf16 / int8
Q4_PANEL = 8  # outputs per packed panel, int4
LINEAR_CACHED = 1  # kernels.c's Linear.flags bit (KernelLinear.cached)


class KernelsUnavailable(ValueError):
    """The C decoder cannot be built or run here (the reason is the message).

    A ValueError so that asking for ``backend="kernels"`` where it cannot run is reported
    like any other unusable option (one line from the CLI)."""


def kernel_cache_dir() -> Path:
    """Where compiled kernels live: ``<package cache>/kernels``."""
    from speculative.models.loading import cache_root

    return cache_root() / "kernels"


def build_kernels(cache_dir: Path | None = None, isa: str = "avx2") -> Path:
    """Compile ``kernels.c`` for ``isa`` unless a build of this exact source and flags exists."""
    if isa not in ISA_FLAGS:
        raise KernelsUnavailable(f"unknown kernel ISA {isa!r}; expected one of {tuple(ISA_FLAGS)}")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or shutil.which(compiler) is None:
        raise KernelsUnavailable(f"no C compiler ({compiler or 'cc/gcc'}) found")
    flags = COMMON_FLAGS + ISA_FLAGS[isa]
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join((compiler, *flags)).encode()).hexdigest()[:16]
    folder = cache_dir or kernel_cache_dir()
    target = folder / f"libspeculative-{isa}-{digest}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", str(built), "-lm"],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise KernelsUnavailable(f"compiling {SOURCE.name} failed: {result.stderr.strip()}")
        os.replace(built, target)  # atomic: concurrent builders agree on the result
    return target


@functools.cache
def _open_library(path: str) -> ctypes.CDLL:
    """dlopen ``path`` once per process and declare the entry points."""
    try:
        library = ctypes.CDLL(path)
    except OSError as error:
        raise KernelsUnavailable(f"cannot load {Path(path).name}: {error}") from error
    if library.spec_abi_version() != ABI_VERSION:
        raise KernelsUnavailable("stale kernel build (ABI version mismatch)")
    pointer, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    library.spec_isa.restype = ctypes.c_char_p
    library.spec_work_floats.argtypes = [pointer, i32, i32]
    library.spec_work_floats.restype = ctypes.c_int64
    library.spec_forward.argtypes = [pointer, pointer, i32, i32, pointer, pointer, i32]
    library.spec_forward.argtypes += [pointer, pointer, pointer, pointer, i32]
    library.spec_forward.restype = None
    library.spec_forward_batch.argtypes = [pointer, pointer, i32, pointer, pointer, pointer]
    library.spec_forward_batch.argtypes += [pointer, pointer, pointer, pointer, pointer, pointer]
    library.spec_forward_batch.argtypes += [i64]
    library.spec_forward_batch.argtypes += [pointer, pointer, pointer, i32]
    library.spec_forward_batch.restype = None
    library.spec_linear_work_floats.argtypes = [i32, i32]
    library.spec_linear_work_floats.restype = ctypes.c_int64
    library.spec_linear.argtypes = [pointer, pointer, i32, pointer, pointer, i32]
    library.spec_linear.restype = None
    library.spec_fused_linear_work_floats.argtypes = [i32, i32]
    library.spec_fused_linear_work_floats.restype = ctypes.c_int64
    library.spec_fused_linear.argtypes = [pointer, pointer, pointer, pointer, pointer]
    library.spec_fused_linear.argtypes += [ctypes.c_float, i32, pointer, pointer, i32]
    library.spec_fused_linear.restype = None
    library.spec_parts_linear.argtypes = [pointer, pointer, ctypes.c_int64, pointer, i32]
    library.spec_parts_linear.argtypes += [ctypes.c_float, i32, pointer, pointer, i32]
    library.spec_parts_linear.restype = None
    library.spec_nucleus.argtypes = [pointer, i64, i64, ctypes.c_float, ctypes.c_double]
    library.spec_nucleus.argtypes += [ctypes.c_double, ctypes.c_float, pointer, pointer, i32]
    library.spec_nucleus.argtypes += [pointer, i64, i32]
    library.spec_nucleus.restype = i32
    library.spec_peak_fma.argtypes = [i32, i64]
    library.spec_peak_fma.restype = ctypes.c_double
    library.spec_peak_int8.argtypes = [i32, i64]
    library.spec_peak_int8.restype = ctypes.c_double
    library.spec_read_bandwidth.argtypes = [pointer, i64, i32]
    library.spec_read_bandwidth.restype = ctypes.c_double
    library.spec_soft_ce.argtypes = [pointer, i32, pointer, pointer, i64, i64]
    library.spec_soft_ce.argtypes += [pointer] * 4 + [i32]
    library.spec_soft_ce.restype = None
    return library


def cpu_features(cache_dir: Path | None = None) -> set[str]:
    """The CPU features kernels.c cares about that this CPU has (asked via the AVX2 build's
    ``__builtin_cpu_supports``, which runs on any x86-64)."""
    bits = _open_library(str(build_kernels(cache_dir, "avx2"))).spec_cpu_features()
    return {name for bit, name in CPU_FEATURES.items() if bits & bit}


def kernel_isa(requested: str | None = None, cache_dir: Path | None = None) -> str:
    """The kernel instruction set to run: ``requested`` or ``$SPECULATIVE_KERNEL_ISA``
    (``auto`` when unset: the best this CPU has). Raises KernelsUnavailable, naming the
    missing CPU feature, when the CPU cannot run the requested one."""
    choice = (requested or os.environ.get(ISA_ENV) or "auto").strip().lower()
    if choice not in ISA_CHOICES:
        raise KernelsUnavailable(f"{ISA_ENV}={choice!r}: expected one of {ISA_CHOICES}")
    have = cpu_features(cache_dir)
    if choice == "auto":
        choice = "avx512" if set(ISA_NEEDS["avx512"]) <= have else "avx2"
    missing = [f for f in ISA_NEEDS[choice] if f not in have]
    if missing:
        raise KernelsUnavailable(f"kernel ISA {choice} needs CPU feature {missing[0]}, absent here")
    return choice


def load_kernels(cache_dir: Path | None = None, isa: str | None = None) -> ctypes.CDLL:
    """The compiled C decoder for ``isa`` (default: :func:`kernel_isa`), built if needed.
    Raises KernelsUnavailable."""
    chosen = kernel_isa(isa, cache_dir)
    library = _open_library(str(build_kernels(cache_dir, chosen)))
    if library.spec_isa().decode() != chosen:
        raise KernelsUnavailable(f"kernel build for {chosen} reports {library.spec_isa()!r}")
    return library


def library_isa(library: ctypes.CDLL) -> str:
    """The instruction set a loaded kernel library was built for ("avx2" or "avx512")."""
    return library.spec_isa().decode()


# ---- structures mirrored from kernels.c ------------------------------------------------


class _Linear(ctypes.Structure):
    _fields_ = [
        ("format", ctypes.c_int32),
        ("in_features", ctypes.c_int32),
        ("out_features", ctypes.c_int32),
        ("flags", ctypes.c_int32),  # LINEAR_CACHED
        ("weight", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qk_norm", ctypes.c_void_p),  # [2, head_dim] query then key norm weights, or NULL
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
        ("kv_f16", ctypes.c_int32),
        ("layers", ctypes.c_void_p),
        ("final_norm", ctypes.c_void_p),
        ("lm_head", _Linear),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("op_seconds", ctypes.c_void_p),  # NULL, or where forwards add their ops' seconds
        ("layer_out", ctypes.c_void_p),  # NULL, or where forwards copy chosen layers' outputs
        ("layer_mask", ctypes.c_uint64),  # bit l: copy the residual stream after layer l
    ]


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[out, in] uint8 in 0..15 -> [out, in / 2]: byte j of each group of 32 holds q[j] in
    its low nibble and q[j + 16] in its high nibble (GGUF Q4_1's order)."""
    out_features, in_features = q.shape
    groups = q.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    return (groups[..., :16] | (groups[..., 16:] << 4)).reshape(out_features, -1).contiguous()


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """t with zero rows appended up to a multiple of ``multiple`` rows."""
    extra = -t.shape[0] % multiple
    if not extra:
        return t
    return torch.cat([t, t.new_zeros((extra, *t.shape[1:]))])


def pack_panels(dense: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [panels, in, PANEL] (kernels.c's fp32 / bf16 / int8 layout): the PANEL
    weights of one input side by side, rows past ``out`` zero."""
    in_features = dense.shape[1]
    padded = _pad_rows(dense, PANEL)
    return padded.reshape(-1, PANEL, in_features).transpose(1, 2).contiguous()


def pack_q4_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_1 values -> kernels.c's q4 layout, [panels, groups, 160] uint8.

    q: [out, in] uint8 in 0..15; d, m: [out, in / 32] float16 (weight = d * q + m). Per
    panel of 8 outputs and group of 32 inputs: four 32-byte chunks (chunk c byte 4 * o + t
    = q[o][4c + t] | q[o][16 + 4c + t] << 4), then d[8] and m[8] as fp16."""
    groups = q.shape[1] // GROUP_SIZE
    q = _pad_rows(q, Q4_PANEL).reshape(-1, Q4_PANEL, groups, 2, 4, 4)  # [P, o, g, half, c, t]
    nibbles = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # [P, o, g, c, t]
    nibbles = nibbles.permute(0, 2, 3, 1, 4).reshape(-1, groups, 128)  # [P, g, c*o*t]

    def table(t: torch.Tensor) -> torch.Tensor:  # [out, groups] fp16 -> [P, g, 16] bytes
        t = _pad_rows(t.to(torch.float16), Q4_PANEL).reshape(-1, Q4_PANEL, groups)
        return t.transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat([nibbles, table(d), table(m)], dim=2).contiguous()


def pack_q8_blocks(q: torch.Tensor) -> torch.Tensor:
    """int8 [out, in] -> kernels.c's q8d layout, [panels, groups, 256] int8: per panel of 8
    outputs and group of 32 inputs, eight 32-byte chunks, chunk j byte 4 * o + t =
    q[o][4j + t]."""
    groups = q.shape[1] // GROUP_SIZE
    q = _pad_rows(q, 8).reshape(-1, 8, groups, 8, 4)  # [P, o, g, j, t]
    return q.permute(0, 2, 3, 1, 4).reshape(-1, groups, 256).contiguous()


FUSED_ARGMAX_ROWS = 64  # passes up to this many rows also return each row's argmax


class _PassArguments:
    """spec_forward_batch's small argument arrays (per sequence: new rows, first cache
    position, slot, first row with logits, mask offset; per row: RoPE position; the fused
    argmax) and its work buffer, kept between calls and refilled from Python ints: right
    after a forward the caches are cold, and each numpy or torch call then costs tens of
    microseconds (these arrays, built per call with numpy and torch, took 0.25 ms of a
    5.6 ms int4 decode step). One per decoder: its forwards run one at a time, as its KV
    cache already requires (a server runs them all on one compute thread)."""

    def __init__(self) -> None:
        self._sequences = self._rows = 0
        self._grow(8, 64)
        self.best = (ctypes.c_int32 * FUSED_ARGMAX_ROWS)()  # each row's argmax
        self.best_at = ctypes.addressof(self.best)
        self._work = torch.empty(0)
        self.masked = False  # whether the last fill met a segment with a mask

    def fill(self, segments: Sequence[Segment]) -> int:
        """Write the segments' fields; returns the number of rows whose logits are wanted."""
        n = len(segments)
        rows = [s.rows for s in segments]
        total = sum(rows)
        if n > self._sequences or total > self._rows:
            self._grow(max(n, 2 * self._sequences), max(total, 2 * self._rows))
        self.rows[:n] = rows
        self.start[:n] = [s.start for s in segments]
        self.slot[:n] = [s.slot for s in segments]
        logits_from = [s.logits_from for s in segments]
        self.logits_from[:n] = logits_from
        self.mask_offset[:n] = [-1] * n
        self.masked = any(s.mask is not None for s in segments)
        positions: list[int] = []
        for s in segments:
            positions += s.position_list()
        self.positions[:total] = positions
        return total - sum(logits_from)

    def work(self, floats: int) -> int:
        """The address of a float32 work buffer of at least ``floats`` (kept, grown)."""
        if self._work.numel() < floats:
            self._work = torch.empty(floats)
        return self._work.data_ptr()

    def _grow(self, sequences: int, rows: int) -> None:
        self._sequences, self._rows = sequences, rows
        self.rows = (ctypes.c_int32 * sequences)()
        self.start = (ctypes.c_int32 * sequences)()
        self.slot = (ctypes.c_int32 * sequences)()
        self.logits_from = (ctypes.c_int32 * sequences)()
        self.mask_offset = (ctypes.c_int64 * sequences)()
        self.positions = (ctypes.c_int64 * rows)()
        self.rows_at, self.start_at = ctypes.addressof(self.rows), ctypes.addressof(self.start)
        self.slot_at = ctypes.addressof(self.slot)
        self.logits_from_at = ctypes.addressof(self.logits_from)
        self.mask_offset_at = ctypes.addressof(self.mask_offset)
        self.positions_at = ctypes.addressof(self.positions)


class FusedArgmax:
    """The argmax of every logits row of one forward, computed by the kernels (-1 where a
    row holds a NaN). ``logits`` is kept alive, so no other tensor can take its memory
    while this answers for it: a tensor whose data lies inside it is a view of it.

    Answering costs a few Python operations, no torch or numpy call: right after a forward
    the caches are cold, and each distinct op then costs tens of microseconds."""

    def __init__(self, logits: torch.Tensor, best: list[int], vocab: int) -> None:
        self.logits = logits  # [rows, vocab] float32, the forward's output
        self.best = best  # [rows]
        self.vocab = vocab
        self.row_bytes = 4 * vocab
        self.start = logits.data_ptr()

    def rows(self, view: torch.Tensor) -> list[int] | None:
        """[..., n, vocab] consecutive whole rows of ``logits`` (a view, such as the slice
        a session hands on) -> the first index of each row's largest value, in row order,
        as ``view.argmax(-1).flatten().tolist()``; None for anything else or a row with a
        NaN."""
        shape = view.shape
        if not shape or shape[-1] != self.vocab or not view.is_contiguous():
            return None
        n = view.numel() // self.vocab
        first = self._first_row(view, n)
        if first is None:
            return None
        best = self.best[first : first + n]
        return None if min(best, default=0) < 0 else best

    def row(self, view: torch.Tensor) -> int:
        """The argmax of one [vocab] row of ``logits`` (a view of it): the index of its
        first largest value; -1 for any other tensor or a row with a NaN."""
        if view.shape != (self.vocab,) or view.stride() != (1,):
            return -1
        first = self._first_row(view, 1)
        return -1 if first is None else self.best[first]

    def _first_row(self, view: torch.Tensor, n: int) -> int | None:
        """The index of the first of ``n`` whole float32 rows of ``logits`` that ``view``
        starts at, or None when it does not start at one or the n rows run past them."""
        offset = view.data_ptr() - self.start
        first, misaligned = divmod(offset, self.row_bytes)
        if offset < 0 or misaligned or first + n > len(self.best) or view.dtype != torch.float32:
            return None
        return first


# kernels.c's NUCLEUS_MAX, and the largest nucleus the sampling layer renormalizes the way C
# does (libm exp, an in-order sum); larger nuclei take the sampling layer's own path
NUCLEUS_MAX = EXACT_RENORMALIZE_LIMIT
# How far the mass before or through the cut must stay from top_p for spec_nucleus to answer:
# its masses are within about 1e-7 of the sampling layer's float64 ones.
NUCLEUS_MARGIN = 2e-6
NUCLEUS_GAP = 1e-5  # how far below the last member the next tempered logit must lie


class KernelNucleus:
    """A logits row's top-p distribution (the nucleus, renormalized) by ``spec_nucleus``
    (kernels.c): one call of a few passes over the row, where the sampling layer's own path
    takes a softmax, a search and several numpy calls over 49k entries, each slow on the
    caches a forward left cold. It answers only where its cut is certain to be the sampling
    layer's (see ``spec_nucleus``), with the sampling layer's bits, so a row is the same
    either way."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library
        self._scratch = threading.local()  # this thread's _NucleusScratch

    def __call__(
        self,
        logits: torch.Tensor,
        temperature: float,
        top_p: float,
        largest: int = -1,
        threads: int = 1,
    ) -> RowProbs | None:
        """logits: [vocab] float32 raw logits -> the top-p nucleus of
        softmax(logits / temperature), renormalized: ``row_probs``'s row, the same ids and
        bits; None where the sampling layer must cut it itself. ``largest``: the index of
        the row's largest logit where the caller knows it (the forward's fused argmax: the
        search then reads the row once), else -1. ``threads``: how many threads (at most 2)
        read the row; the answer is the same for any number."""
        if logits.dim() != 1 or logits.dtype != torch.float32 or not logits.is_contiguous():
            return None
        scratch = self._scratch_for(logits.shape[0])
        count = self.library.spec_nucleus(
            logits.data_ptr(), logits.shape[0], largest, temperature, top_p, NUCLEUS_MARGIN,
            NUCLEUS_GAP, scratch.kept_at, scratch.probs_at, NUCLEUS_MAX, scratch.entries_at,
            scratch.capacity, threads,
        )  # fmt: skip
        if count < 0:
            return None
        # lists straight from the C arrays: no numpy call on the caches a forward left cold
        return RowProbs.of_lists(scratch.probs_c[:count], scratch.kept_c[:count])

    def _scratch_for(self, vocab: int) -> _NucleusScratch:
        """This thread's buffers, allocated once: a fresh 200 kB array would cost a mapping
        and its page faults per call, and each numpy call after a forward costs tens of µs."""
        scratch = getattr(self._scratch, "buffers", None)
        if scratch is None or scratch.capacity < vocab:
            scratch = self._scratch.buffers = _NucleusScratch(vocab)
        return scratch


class _NucleusScratch:
    """spec_nucleus's output and scratch rows for one thread, with their addresses."""

    def __init__(self, vocab: int) -> None:
        self.kept = np.empty(NUCLEUS_MAX, dtype=np.int32)  # the members' ids
        self.probs = np.empty(NUCLEUS_MAX, dtype=np.float32)  # and probabilities
        # the candidates, one (float32 logit, int32 id, float64 weight) per row entry
        self.entries = np.empty((vocab, 2), dtype=np.float64)
        self.capacity = vocab
        self.kept_at, self.probs_at = self.kept.ctypes.data, self.probs.ctypes.data
        self.kept_c = (ctypes.c_int32 * NUCLEUS_MAX).from_buffer(self.kept)  # the same memory
        self.probs_c = (ctypes.c_float * NUCLEUS_MAX).from_buffer(self.probs)
        self.entries_at = self.entries.ctypes.data


@dataclass
class KernelLinear:
    """One weight matrix in a packed format of kernels.c; keeps its tensors alive."""

    format: str
    # fp32 / bf16 (as int16) / int8: [panels, in, 16]; int4: [panels, groups, 160] uint8;
    # int8dot: [panels, groups, 256] int8
    weight: torch.Tensor
    in_features: int
    out_features: int
    scale: torch.Tensor | None = None  # int8, int8dot: [out] float32
    bias: torch.Tensor | None = None  # [out] float32
    # run many times in a row with its weights in cache (a drafting head's matrices): the
    # kernels then tile even one row for compute, not for a stream from memory
    cached: bool = False

    @classmethod
    def pack(
        cls, weight: Weight, bias: torch.Tensor | None, precision: str, cached: bool = False
    ) -> KernelLinear:
        """Pack weight [out, in] (dense or GroupQuant4) and bias [out] for ``precision``
        (a format of :data:`FORMATS`); ``cached``: see the field."""
        found = FORMATS.get(precision)
        if found is None:
            raise ValueError(f"unknown precision {precision!r}; expected one of {tuple(FORMATS)}")
        packed = found.pack(weight, None if bias is None else bias.float().contiguous())
        packed.cached = cached
        return packed

    def struct(self) -> _Linear:
        return _Linear(
            FORMATS[self.format].code,
            self.in_features,
            self.out_features,
            LINEAR_CACHED if self.cached else 0,
            _address(self.weight),
            _address(self.scale),
            _address(self.bias),
        )

    def weight_bytes(self) -> int:
        return tensor_bytes(self.weight, self.scale, self.bias)

    def __call__(self, library: ctypes.CDLL, x: torch.Tensor, threads: int = 1) -> torch.Tensor:
        """x [rows, in] float32 -> [rows, out]: this layer alone, run by ``library``."""
        x = x.float().contiguous()
        rows = x.shape[0]
        y = torch.empty(rows, self.out_features)
        work = torch.empty(library.spec_linear_work_floats(rows, self.in_features) + 8)
        layer = self.struct()
        library.spec_linear(
            ctypes.byref(layer), x.data_ptr(), rows, y.data_ptr(), work.data_ptr(), threads
        )
        return y

    def multiply_adds(self) -> int:
        """Multiply-adds of one token row through this layer (padding excluded)."""
        return self.in_features * self.out_features


def _layer_struct(layer: PackedLayer[KernelLinear]) -> _Layer:
    """kernels.c's ``Layer`` for a block packed for the kernels."""
    return _Layer(
        _address(layer.input_norm),
        _address(layer.post_attention_norm),
        _address(layer.qk_norm),
        layer.qkv.struct(),
        layer.o.struct(),
        layer.gate_up.struct(),
        layer.down.struct(),
    )


@dataclass
class KernelModel:
    """kernels.c's ``Model`` for packed layers; holds the layer array it points to (the
    caller keeps the layers' and tables' tensors alive)."""

    struct: _Model
    layer_array: ctypes.Array

    @property
    def pointer(self) -> object:
        """What spec_forward / spec_work_floats take."""
        return ctypes.byref(self.struct)


def kernel_model(
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    eps: float,
    layers: Sequence[PackedLayer[KernelLinear]],
    final_norm: torch.Tensor | None,  # [hidden], or None: the head reads the residual stream
    lm_head: KernelLinear,
    cos: torch.Tensor,  # [max_length, head_dim / 2] float32
    sin: torch.Tensor,  # [max_length, head_dim / 2] float32
    kv_f16: bool = False,  # the KV cache it reads and writes holds float16 (else float32)
) -> KernelModel:
    """The ``Model`` struct of a stack of packed decoder layers and an output head."""
    layer_array = (_Layer * len(layers))(*(_layer_struct(layer) for layer in layers))
    struct = _Model(
        num_layers=len(layers),
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=lm_head.out_features,
        max_length=cos.shape[0],
        eps=eps,
        kv_f16=int(kv_f16),
        layers=ctypes.addressof(layer_array),
        final_norm=_address(final_norm),
        lm_head=lm_head.struct(),
        cos=cos.data_ptr(),
        sin=sin.data_ptr(),
    )
    return KernelModel(struct, layer_array)


def kernel_shape_problem(hidden: int, intermediate: int, q_size: int, head_dim: int) -> str | None:
    """Why kernels.c cannot run these shapes (None when it can)."""
    for name, width in (("hidden", hidden), ("intermediate", intermediate), ("q_size", q_size)):
        if width % GROUP_SIZE:
            return f"{name} size {width} is not a multiple of {GROUP_SIZE}"
    if head_dim % 16:
        return f"head_dim {head_dim} is not a multiple of 16"
    return None


_Packer = Callable[[Weight, torch.Tensor | None], KernelLinear]  # weight, bias -> packed


def _pack_int4(weight: Weight, bias: torch.Tensor | None) -> KernelLinear:
    """Q4_1 blocks with fp16 scales, as GGUF stores them (lossless for GGUF files)."""
    quant = as_group_quant4(weight)
    out_features, in_features = quant.q.shape
    blocks = pack_q4_blocks(quant.q, quant.scale, quant.minimum)
    return KernelLinear("int4", blocks, in_features, out_features, bias=bias)


def _pack_fp32(weight: Weight, bias: torch.Tensor | None) -> KernelLinear:
    dense = dense_values(weight)
    return KernelLinear("fp32", pack_panels(dense), dense.shape[1], dense.shape[0], bias=bias)


def _pack_bf16(weight: Weight, bias: torch.Tensor | None) -> KernelLinear:
    dense = dense_values(weight)
    bits = pack_panels(dense.to(torch.bfloat16).view(torch.int16))
    return KernelLinear("bf16", bits, dense.shape[1], dense.shape[0], bias=bias)


def _int8_packer(format: str, pack: Callable[[torch.Tensor], torch.Tensor]) -> _Packer:
    """Per-channel int8 weights packed by ``pack`` (panels, or blocks for integer dots)."""

    def packer(weight: Weight, bias: torch.Tensor | None) -> KernelLinear:
        qweight, scale = quantize_int8_per_channel(dense_values(weight))
        out_features, in_features = qweight.shape
        scale = scale.float().contiguous()
        return KernelLinear(format, pack(qweight), in_features, out_features, scale, bias)

    return packer


@dataclass(frozen=True)
class KernelFormat:
    """A packed weight format of kernels.c: its value in the C ABI, its packer, and
    whether its products run as integer dots (int8 activations) or float FMAs."""

    code: int
    pack: _Packer
    integer_dots: bool = False


# "int8dot": int8 weights run against int8 activations (integer dots), the int4 model's head
FORMATS: dict[str, KernelFormat] = {
    "fp32": KernelFormat(0, _pack_fp32),
    "bf16": KernelFormat(1, _pack_bf16),
    "int8": KernelFormat(2, _int8_packer("int8", pack_panels)),
    "int4": KernelFormat(3, _pack_int4, integer_dots=True),
    "int8dot": KernelFormat(4, _int8_packer("int8dot", pack_q8_blocks), integer_dots=True),
}


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
        kv_dtype: torch.dtype = torch.float32,  # the cache's elements: float32 or float16
    ) -> None:
        if kv_dtype not in (torch.float32, torch.float16):
            raise ValueError(f"the kernels keep a float32 or float16 KV cache, not {kv_dtype}")
        problem = kernel_shape_problem(
            config.hidden_size, config.intermediate_size, config.q_size, config.head_dim
        )
        if problem is not None:
            raise KernelsUnavailable(problem)
        super().__init__()
        self.slot_dim = 0
        self.config = config
        self.kv_dtype = kv_dtype
        self.layers = [
            PackedLayer.pack(w, functools.partial(KernelLinear.pack, precision=precision))
            for w in layers
        ]
        self.final_norm = final_norm.float().contiguous()
        head_format = traits(precision).kernel_lm_head
        self.lm_head = KernelLinear.pack(head, None, head_format)
        # every weight streamed per step in one arena on 2 MiB pages (values unchanged)
        linears = [
            x for layer in self.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]
        self._weight_arena = place_on_huge_pages([*linears, self.lm_head])
        self._cos = rotations.real.contiguous()  # [max_length, head_dim / 2]
        self._sin = rotations.imag.contiguous()
        self.max_positions = rotations.shape[0]
        self._library = library
        self.isa = library_isa(library)  # "avx2" or "avx512"
        self.library = library
        self.kernels = {"layers": f"C {self.isa} ({precision})", "lm_head": f"C {head_format}"}
        self._rebuild()
        self._causal_only = torch.zeros(1, dtype=torch.uint8)  # mask stand-in: none given

    def _rebuild(self) -> None:
        """The ``Model`` struct over the layer list (after :meth:`truncated`: a new one over
        the same weights), and its own fused-argmax record and top-p scratch."""
        config = self.config
        model = kernel_model(
            hidden=config.hidden_size,
            heads=config.num_heads,
            kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            intermediate=config.intermediate_size,
            eps=config.rms_norm_eps,
            layers=self.layers,
            final_norm=self.final_norm,
            lm_head=self.lm_head,
            cos=self._cos,
            sin=self._sin,
            kv_f16=self.kv_dtype == torch.float16,
        )
        self._layer_array, self._model = model.layer_array, model.struct
        self._cache_resized()
        self._argmax: FusedArgmax | None = None  # the last forward's
        self._nucleus_search = KernelNucleus(self._library)
        self._call = _PassArguments()

    def clock_ops(self, seconds: torch.Tensor | None) -> bool:
        """Have every later forward add its ops' wall seconds (thread 0's clock after each
        op's closing barrier) to ``seconds`` ([len(KERNEL_OPS)] float64, kept alive by the
        caller), or stop clocking (None)."""
        if seconds is not None and (
            seconds.dtype != torch.float64
            or seconds.shape != (len(KERNEL_OPS),)
            or not seconds.is_contiguous()
        ):
            raise ValueError(f"op seconds must be a contiguous [{len(KERNEL_OPS)}] float64 tensor")
        self._model.op_seconds = None if seconds is None else seconds.data_ptr()
        return True

    def copy_layers_into(self, layers: Sequence[int], out: torch.Tensor | None) -> None:
        """Have later forwards copy the residual stream after each of ``layers`` (0-based,
        increasing) into ``out`` ([len(layers), rows, hidden] float32, the forward's rows;
        kept alive by the caller), or stop (None)."""
        if out is None:
            self._model.layer_out, self._model.layer_mask = None, 0
            return
        if list(layers) != sorted(set(layers)) or not all(
            0 <= layer < self.config.num_layers for layer in layers
        ):
            raise ValueError(f"layers must be increasing indices below {self.config.num_layers}")
        if out.dtype != torch.float32 or not out.is_contiguous() or out.shape[0] != len(layers):
            raise ValueError("out must be a contiguous [len(layers), rows, hidden] float32 tensor")
        self._model.layer_out = out.data_ptr()
        self._model.layer_mask = sum(1 << layer for layer in layers)

    def weight_pages(self) -> str:
        """Where the packed weights live: how much of them on transparent huge pages (reads
        /proc/self/smaps, tens of milliseconds: asked by ``profile``, not at load)."""
        if self._weight_arena is None:
            return "4 KiB pages"
        on_huge = huge_page_bytes(self.lm_head.weight.data_ptr())
        if on_huge is None:
            return "huge-page arena (THP state unknown)"
        return f"huge-page arena, {on_huge / 2**20:.0f} MiB on 2 MiB pages"

    def _cache_resized(self) -> None:
        """The kernels read a slot's positions per (layer, head) as the struct's
        ``max_length``: the cache's, which grows with use (the RoPE tables stay the
        context window's)."""
        self._model.max_length = self._positions

    def cache_shape(self, batch: int, positions: int) -> tuple[int, ...]:
        """[batch, layers, kv_heads, positions, head_dim]."""
        cfg = self.config
        return (batch, cfg.num_layers, cfg.num_kv_heads, positions, cfg.head_dim)

    def copy_cache_from(
        self,
        source: KernelDecoder,
        length: int,
        source_slot: int = 0,
        target_slot: int = 0,
        start: int = 0,
    ) -> None:
        """See :meth:`DecoderBase.copy_cache_from`."""
        self.hold_positions(length)
        s, t, layers, kept = source_slot, target_slot, self.config.num_layers, slice(start, length)
        self.k_cache[t, :, :, kept] = source.k_cache[s, :layers, :, kept]
        self.v_cache[t, :, :, kept] = source.v_cache[s, :layers, :, kept]

    def keep_slots(self, first: int, slots: list[int], cache_slot: int | None = None) -> None:
        """Move cache slots ``slots`` (increasing, >= first) to first, first + 1, ... of
        sequence ``cache_slot`` (every sequence when None)."""
        index = torch.tensor(slots, dtype=torch.long)
        kept = slice(first, first + len(slots))
        for cache in (self.k_cache, self.v_cache):
            view = cache if cache_slot is None else cache.narrow(0, cache_slot, 1)
            view[:, :, :, kept] = view.index_select(3, index)

    def forward_segments(
        self,
        hidden: torch.Tensor,  # [rows, hidden] float32 embeddings, owned: updated in place
        # into the features (final norm applied); segment i owns the next segments[i].rows
        segments: Sequence[Segment],
    ) -> torch.Tensor:  # [sum of logit_rows, vocab]
        """All segments in one spec_forward_batch call: each weight is streamed once for
        every row of every sequence; the output head runs over the rows asked for."""
        if hidden.dtype != torch.float32 or not hidden.is_contiguous():
            raise ValueError("hidden must be contiguous float32 (it is updated in place)")
        rows = hidden.shape[0]
        self.hold_positions(max((s.start + s.rows for s in segments), default=0))
        threads = torch.get_num_threads()
        model = ctypes.byref(self._model)
        call = self._call
        wanted = call.fill(segments)
        masks = self._masks(segments, call) if call.masked else self._causal_only
        work = call.work(self._library.spec_work_floats(model, rows, threads))
        logits = torch.empty(wanted, self.vocab_size)
        fused = wanted <= FUSED_ARGMAX_ROWS  # the kernels' argmax of every row, taken
        # while their threads hold the logits
        self._library.spec_forward_batch(
            model,
            hidden.data_ptr(),
            len(segments),
            call.rows_at,
            call.start_at,
            call.slot_at,
            call.positions_at,
            masks.data_ptr(),
            call.mask_offset_at,
            call.logits_from_at if wanted < rows else None,  # None: every row's logits
            self.k_cache.data_ptr(),
            self.v_cache.data_ptr(),
            self.k_cache.stride(0),  # floats per slot: [layers, kv_heads, positions, head_dim]
            logits.data_ptr(),
            call.best_at if fused else None,
            work,
            threads,
        )
        self._argmax = FusedArgmax(logits, call.best[:wanted], self.vocab_size) if fused else None
        return logits

    def _masks(self, segments: Sequence[Segment], call: _PassArguments) -> torch.Tensor:
        """The segments' masks, concatenated (uint8 [Σ rows²] over the masked ones); each
        one's offset in them goes to ``call``'s mask offsets (-1: causal)."""
        masks, offset = [], 0
        for i, s in enumerate(segments):
            if s.mask is None:
                continue
            masks.append(s.mask.to(torch.uint8).reshape(-1))  # [rows * rows]
            call.mask_offset[i] = offset
            offset += s.rows * s.rows
        return torch.cat(masks).contiguous()

    def nucleus(self, logits: torch.Tensor, temperature: float, top_p: float) -> RowProbs | None:
        """See :class:`KernelNucleus`; a row of the last forward's output comes with its
        fused argmax, so the search skips its pass for the largest logit."""
        largest = -1 if self._argmax is None else self._argmax.row(logits)
        return self._nucleus_search(
            logits, temperature, top_p, largest, threads=torch.get_num_threads()
        )

    def argmax_rows(self, logits: torch.Tensor) -> list[int] | None:
        """See :meth:`FusedArgmax.rows` (None before any forward)."""
        return None if self._argmax is None else self._argmax.rows(logits)
