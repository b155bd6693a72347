"""What each weight precision means beyond its matrix products: one table, so that the
output projection's format, the KV cache's default, a drafting head's formats and the
bytes a step reads are decided in one place instead of by ``if precision == ...`` where
each is needed. How a precision's products run is the runtimes' business
(:mod:`speculative.models.native.linear`, :mod:`~speculative.models.native.ckernels`);
their tables name the same precisions (tested).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrecisionTraits:
    """One weight precision's choices.

    bytes_per_weight: weight bytes a step reads per parameter, as packed (int4: Q4_1's
        4 bits plus a 16-bit scale and minimum per 32 weights; per-row scales left out),
        which a self-drafter must undercut.
    lm_head: the output projection's precision (int4 keeps 8 bits there, as llama.cpp's
        Q4 files do).
    kernel_lm_head: the C kernels' format for that projection (the int4 model runs its
        int8 head against int8 activations: integer dots).
    kv_cache: what ``--kv-cache auto`` means: fp32 for an fp32 model, IEEE half for the
        precisions that already round their weights (as llama.cpp does).
    head_layer, head_rows: a drafting head's layer and output-row formats at this target
        precision, never more bytes per weight than the target reads (fp32 targets run
        the shipped heads at their stored bf16 values).
    """

    bytes_per_weight: float
    lm_head: str
    kernel_lm_head: str
    kv_cache: str
    head_layer: str
    head_rows: str


PRECISION_TRAITS: dict[str, PrecisionTraits] = {
    "fp32": PrecisionTraits(4.0, "fp32", "fp32", "fp32", "bf16", "bf16"),
    "bf16": PrecisionTraits(2.0, "bf16", "bf16", "fp16", "bf16", "bf16"),
    "int8": PrecisionTraits(1.0, "int8", "int8", "fp16", "int8", "int8"),
    # measured: int4 head layers give the same drafts as int8 for 0.6 of the bytes
    "int4": PrecisionTraits(0.625, "int8", "int8dot", "fp16", "int4", "int4"),
}


def traits(precision: str) -> PrecisionTraits:
    """The traits of a known weight precision (ValueError naming the known ones)."""
    found = PRECISION_TRAITS.get(precision)
    if found is None:
        known = ", ".join(PRECISION_TRAITS)
        raise ValueError(f"unknown precision {precision!r}; expected one of {known}")
    return found


def cheaper_precisions(precision: str) -> list[str]:
    """The precisions whose steps read fewer weight bytes than ``precision``'s (a target
    at a precision outside the table, e.g. a transformers dtype, counts as fp32)."""
    own = PRECISION_TRAITS.get(precision, PRECISION_TRAITS["fp32"]).bytes_per_weight
    return [p for p, t in PRECISION_TRAITS.items() if t.bytes_per_weight < own]
