"""Weight bytes, the memory-bandwidth floor and the roofline of a native model's forward.

Timing forwards (the verify-cost curve T(k)/T(1)) is model-agnostic and lives in
:mod:`speculative.engine.costs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def weight_bytes(model: object) -> int:
    """Bytes of weights a decode step reads (packed linears; embedding rows excluded)."""
    measure = getattr(model, "weight_bytes", None)
    if not callable(measure):
        raise ValueError("weight_bytes needs a model with a weight_bytes() method")
    return int(measure())


def bandwidth_floor_ms(weight_bytes: int, gbps: float = 22.0) -> float:
    """Time to stream ``weight_bytes`` once at ``gbps`` GB/s, in milliseconds."""
    if gbps <= 0:
        raise ValueError(f"gbps must be positive, got {gbps}")
    return weight_bytes / (gbps * 1e9) * 1e3


# ---- the roofline of a kernels decoder ----------------------------------------------


@dataclass(frozen=True)
class MachinePeaks:
    """What this machine does per second on ``threads`` threads, measured by kernels.c's
    microbenchmarks with the kernels' own instructions."""

    isa: str  # the kernel library measured ("avx2" or "avx512")
    threads: int
    fma_macs_per_s: float  # fp32 multiply-adds (8-lane FMAs): fp32 / bf16 / int8 layers
    int8_macs_per_s: float  # int8 multiply-adds of the q4 integer dot (maddubs or VNNI)
    read_gbps: float  # streaming read bandwidth from memory (256 MB, beyond the caches)

    def to_dict(self) -> dict[str, object]:
        return {
            "isa": self.isa,
            "threads": self.threads,
            "fma_gmacs": self.fma_macs_per_s / 1e9,
            "int8_gmacs": self.int8_macs_per_s / 1e9,
            "read_gbps": self.read_gbps,
        }


def measure_peaks(library: Any, threads: int, repeats: int = 7) -> MachinePeaks:
    """Best of ``repeats`` runs of each microbenchmark (a shared machine only slows them)."""
    from speculative.models.native.ckernels import library_isa
    from speculative.models.native.hugepages import zeros_on_huge_pages

    fma = max(library.spec_peak_fma(threads, 2_000_000) for _ in range(repeats))
    int8 = max(library.spec_peak_int8(threads, 200_000) for _ in range(repeats))
    # 256 MB, written so every page is real, on the pages the weights live on (2 MiB ones
    # unless SPECULATIVE_HUGE_PAGES=0: a 4 KiB-page stream reads about 20 % slower here)
    buffer = zeros_on_huge_pages((64 * 1024 * 1024,)).fill_(1.0)
    read = max(
        library.spec_read_bandwidth(buffer.data_ptr(), buffer.numel(), threads)
        for _ in range(repeats)
    )
    return MachinePeaks(library_isa(library), threads, fma, int8, read / 1e9)


def decoder_work(decoder: Any) -> dict[str, int]:
    """Per-token work of a kernels decoder: multiply-adds on the fp32 FMA path and on the
    int8 dot path (int4 layers and the int4 model's int8 head), weight bytes, and KV-cache
    bytes per visible slot (keys and values of every layer, at the cache's element size:
    float16 by default below fp32 targets)."""
    from speculative.models.native.ckernels import FORMATS

    linears = [decoder.lm_head]
    for layer in decoder.layers:
        linears += [layer.qkv, layer.o, layer.gate_up, layer.down]
    cfg = decoder.config
    element = decoder.kv_dtype.itemsize  # bytes per cached key or value element
    return {
        "fma_macs": sum(x.multiply_adds() for x in linears if not FORMATS[x.format].integer_dots),
        "int8_macs": sum(x.multiply_adds() for x in linears if FORMATS[x.format].integer_dots),
        "attention_macs_per_slot": 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim,
        "weight_bytes": int(decoder.weight_bytes()),
        "kv_bytes_per_slot": 2 * element * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim,
    }


@dataclass(frozen=True)
class PassFloors:
    """What one forward must read and compute, and the least time each takes at the
    machine's measured peaks."""

    bytes: int  # every weight once, and each sequence's KV cache over the slots it sees
    multiply_adds: int  # all of them, attention's included
    int8_multiply_adds: int  # those on the int8 dot path
    memory_ms: float  # bytes at the measured read bandwidth
    compute_ms: float  # fp32 multiply-adds at the FMA peak plus int8 ones at the dot peak

    @property
    def floor_ms(self) -> float:
        return max(self.memory_ms, self.compute_ms)

    @property
    def binds(self) -> str:
        return "memory" if self.memory_ms >= self.compute_ms else "compute"


def pass_floors(
    work: dict[str, int], peaks: MachinePeaks, rows: Sequence[tuple[int, int]]
) -> PassFloors:
    """The floors of one forward over ``rows``: (cached slots, new tokens) per sequence.
    The weights stream once for all of them; token j of a sequence's block attends to its
    cached + j + 1 slots (reading its own KV cache of cached + k slots)."""
    tokens = sum(k for _, k in rows)
    pairs = sum(k * cached + k * (k + 1) // 2 for cached, k in rows)  # (token, slot)
    nbytes = work["weight_bytes"] + work["kv_bytes_per_slot"] * sum(c + k for c, k in rows)
    fma = tokens * work["fma_macs"] + pairs * work["attention_macs_per_slot"]
    int8 = tokens * work["int8_macs"]
    return PassFloors(
        bytes=nbytes,
        multiply_adds=fma + int8,
        int8_multiply_adds=int8,
        memory_ms=nbytes / (peaks.read_gbps * 1e9) * 1e3,
        compute_ms=(fma / peaks.fma_macs_per_s + int8 / peaks.int8_macs_per_s) * 1e3,
    )


def roofline(
    work: dict[str, int],
    peaks: MachinePeaks,
    context: int,
    times_ms: dict[int, float],
    gbps: float = 22.0,
) -> dict[str, dict[str, object]]:
    """For each k: bytes read, multiply-adds, the memory floor (at ``gbps`` and at the
    measured bandwidth), the compute floor at the measured peaks, which of the two binds,
    and the measured T(k) over the binding floor (:func:`pass_floors` of one sequence of
    k tokens after ``context``)."""
    out: dict[str, dict[str, object]] = {}
    for k, ms in times_ms.items():
        floors = pass_floors(work, peaks, [(context, k)])
        out[str(k)] = {
            "bytes": floors.bytes,
            "multiply_adds": floors.multiply_adds,
            "int8_multiply_adds": floors.int8_multiply_adds,
            "memory_floor_ms": floors.bytes / (gbps * 1e9) * 1e3,
            "memory_floor_measured_ms": floors.memory_ms,
            "compute_floor_ms": floors.compute_ms,
            "binds": floors.binds,
            "ms": ms,
            "over_floor": ms / floors.floor_ms,
        }
    return out
