"""The C kernels on their own: ISA choice, packed layouts, k-invariance on every ISA path.

Every test runs the AVX2 library (which any CPU the kernels accept can run) and, where the
CPU has AVX-512 F/BW/VL/DQ + VNNI, the AVX-512 one too.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from speculative.models.base import KERNEL_OPS, RowInput
from speculative.models.native import load_native
from speculative.models.native.ckernels import (
    ISA_ENV,
    ISA_NEEDS,
    KernelLinear,
    KernelsUnavailable,
    cpu_features,
    kernel_isa,
    library_isa,
    load_kernels,
    pack_q4_blocks,
    pack_q8_blocks,
)
from speculative.models.native.quant import (
    GroupQuant4,
    quantize_group4,
    quantize_int8_per_channel,
)

PRECISIONS = ["fp32", "bf16", "int8", "int4"]
FORMATS = [*PRECISIONS, "int8dot"]  # int8dot: the int4 model's head (int8 activations)
ROWS = [*range(1, 17), 40, 64]  # 64 rows: more than one 48-row panel of activations


def _compiler_or_skip() -> None:
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler: the C kernels cannot be built here")


def _has_avx512() -> bool:
    return set(ISA_NEEDS["avx512"]) <= cpu_features()


@pytest.fixture(params=["avx2", "avx512"])
def isa(request: pytest.FixtureRequest) -> str:
    """Each kernel ISA path; avx512 is skipped (with the reason) on CPUs without it."""
    _compiler_or_skip()
    if request.param == "avx512" and not _has_avx512():
        missing = sorted(set(ISA_NEEDS["avx512"]) - cpu_features())
        pytest.skip(f"this CPU lacks {', '.join(missing)}: the avx512 kernels cannot run")
    return request.param


def _layer(precision: str, out_features: int = 72, in_features: int = 96) -> KernelLinear:
    """A seeded layer; 72 outputs are not a multiple of either panel width (16, 8)."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.1
    bias = torch.randn(out_features, generator=generator)
    return KernelLinear.pack(weight, bias, precision)


def test_isa_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    _compiler_or_skip()
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert kernel_isa() == "avx2" and library_isa(load_kernels()) == "avx2"
    monkeypatch.setenv(ISA_ENV, "auto")
    assert kernel_isa() == ("avx512" if _has_avx512() else "avx2")
    monkeypatch.delenv(ISA_ENV)
    assert kernel_isa() == kernel_isa("auto")
    monkeypatch.setenv(ISA_ENV, "sse2")
    with pytest.raises(KernelsUnavailable, match=ISA_ENV):
        kernel_isa()


def test_avx512_refused_without_the_cpu_feature(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking for avx512 where the CPU lacks a feature names that feature in one line."""
    _compiler_or_skip()
    import speculative.models.native.ckernels as ck

    monkeypatch.setattr(ck, "cpu_features", lambda cache_dir=None: {"avx2", "fma", "f16c"})
    with pytest.raises(KernelsUnavailable, match="needs CPU feature avx512f") as error:
        ck.load_kernels(isa="avx512")
    assert "\n" not in str(error.value)
    monkeypatch.setenv(ISA_ENV, "avx512")
    with pytest.raises(KernelsUnavailable, match="avx512f"):
        ck.kernel_isa()
    assert ck.kernel_isa("auto") == "avx2"
    monkeypatch.setattr(ck, "cpu_features", lambda cache_dir=None: {"fma", "f16c"})
    with pytest.raises(KernelsUnavailable, match="kernel ISA avx2 needs CPU feature avx2"):
        ck.kernel_isa("auto")


def test_q8_blocks_hold_the_documented_layout() -> None:
    """pack_q8_blocks: chunk j byte 4 * o + t = q[o][4j + t] per (panel of 8, group of 32)."""
    q = torch.randint(-127, 128, (10, 64), generator=torch.Generator().manual_seed(2))
    blocks = pack_q8_blocks(q.to(torch.int8))  # [2 panels, 2 groups, 256]
    assert blocks.shape == (2, 2, 256)
    for o in range(10):
        p, lane = divmod(o, 8)
        for g in range(2):
            for j in range(8):
                for t in range(4):
                    assert blocks[p, g, 32 * j + 4 * lane + t] == q[o, 32 * g + 4 * j + t]
    assert not blocks[1].reshape(2, 8, 8, 4)[:, :, 2:].any()  # padded outputs


def test_q4_blocks_hold_the_documented_layout() -> None:
    """pack_q4_blocks: chunk c byte 4 * o + t = q[o][4c + t] | q[o][16 + 4c + t] << 4,
    then d[8] and m[8] as fp16, per (panel of 8 outputs, group of 32 inputs)."""
    generator = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (12, 64), generator=generator, dtype=torch.uint8)
    d = torch.rand(12, 2, generator=generator).half()
    m = -torch.rand(12, 2, generator=generator).half()
    blocks = pack_q4_blocks(q, d, m)  # [2 panels, 2 groups, 160]
    assert blocks.shape == (2, 2, 160) and blocks.dtype == torch.uint8
    for o in range(12):
        p, lane = divmod(o, 8)
        for g in range(2):
            block = blocks[p, g]
            for c in range(4):
                for t in range(4):
                    byte = int(block[32 * c + 4 * lane + t])
                    assert byte & 15 == q[o, 32 * g + 4 * c + t]
                    assert byte >> 4 == q[o, 32 * g + 16 + 4 * c + t]
            assert block[128:144].view(torch.float16)[lane] == d[o, g]
            assert block[144:160].view(torch.float16)[lane] == m[o, g]
    assert not blocks[1, :, :128].reshape(2, 4, 8, 4)[:, :, 4:].any()  # padded outputs


@pytest.mark.parametrize("precision", FORMATS)
def test_linear_rows_are_k_invariant(isa: str, precision: str) -> None:
    """Each row of a k-row call equals, bitwise, the same row computed alone."""
    library = load_kernels(isa=isa)
    layer = _layer(precision)
    x = torch.randn(max(ROWS), layer.in_features, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([layer(library, x[i : i + 1]) for i in range(max(ROWS))])
    for rows in ROWS:
        for threads in (1, 2):
            together = layer(library, x[:rows], threads)
            assert torch.equal(together, alone[:rows]), f"{isa} {precision} rows={rows}"


@pytest.mark.parametrize("precision", FORMATS)
def test_cached_matrices_give_the_same_bits(isa: str, precision: str) -> None:
    """A matrix packed as ``cached`` (a drafting head's: other tiles for few rows, no
    non-temporal stream) computes every row bitwise as the streamed one does."""
    library = load_kernels(isa=isa)
    streamed = _layer(precision, out_features=200, in_features=256)
    cached = dataclasses.replace(streamed, cached=True)
    assert cached.struct().flags != streamed.struct().flags
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(8))
    for rows in (1, 2, 3, 9):
        for threads in (1, 2):
            assert torch.equal(
                cached(library, x[:rows], threads), streamed(library, x[:rows], threads)
            ), f"{isa} {precision} rows={rows} threads={threads}"


@pytest.mark.parametrize("precision", FORMATS)
def test_linear_matches_dense_reference(isa: str, precision: str) -> None:
    """A packed layer computes x . W^T + b with the precision's stored weights."""
    library = load_kernels(isa=isa)
    generator = torch.Generator().manual_seed(6)
    weight = torch.randn(72, 96, generator=generator) * 0.1
    bias = torch.randn(72, generator=generator)
    x = torch.randn(9, 96, generator=generator)
    layer = KernelLinear.pack(weight, bias, precision)
    if precision == "fp32":
        stored = weight
    elif precision == "bf16":
        stored = weight.bfloat16().float()
    elif precision in ("int8", "int8dot"):
        qweight, scale = quantize_int8_per_channel(weight)
        stored = qweight.float() * scale[:, None]
    else:
        quant = quantize_group4(weight)
        stored = GroupQuant4(
            quant.q, quant.scale.half().float(), quant.minimum.half().float()
        ).dequantize()
    expected = x @ stored.T + bias
    got = layer(library, x)
    if precision in ("int4", "int8dot"):  # int8 activations per 32 inputs (~0.4 % of a
        # group's largest value)
        error = (got - expected).abs().max() / expected.abs().max()
        assert error < 0.02, f"{precision} relative error {error:.4f}"
    else:
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("precision", FORMATS)
def test_isa_paths_give_the_same_bits(precision: str) -> None:
    """Both libraries run the same per-lane arithmetic (q4: exact integer dots)."""
    _compiler_or_skip()
    if not _has_avx512():
        pytest.skip("this CPU cannot run the avx512 kernels: nothing to compare")
    layer = _layer(precision, out_features=200, in_features=256)
    x = torch.randn(23, 256, generator=torch.Generator().manual_seed(7))
    a = layer(load_kernels(isa="avx2"), x, 2)
    b = layer(load_kernels(isa="avx512"), x, 2)
    assert torch.equal(a, b)


def _saved_llama(folder: Path, seed: int, hidden: int, heads: int, kv_heads: int) -> Path:
    """A seeded two-layer Llama of the given width and heads, saved to ``folder``."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=hidden,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_kernels")
    return _saved_llama(folder, seed=0, hidden=64, heads=4, kv_heads=2)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_model_block_equals_single_steps(
    tiny_folder: Path, isa: str, precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward over k tokens gives bitwise the logits of k decode steps, for k = 1..16,
    40 and 64, on this ISA path (the forward's whole pipeline, not just the linears)."""
    monkeypatch.setenv(ISA_ENV, isa)
    model = load_native(tiny_folder, precision, max_length=160, backend="kernels")
    assert model.backend == "kernels" and model.decoder.isa == isa
    ids = torch.randint(0, 96, (1, 100), generator=torch.Generator().manual_seed(8))
    context = 20
    model.reset()
    model.forward(ids[:, :context])
    steps = torch.cat([model.forward(ids[:, context + i : context + i + 1]) for i in range(64)], 1)
    for k in ROWS:
        model.rollback(model.cache_length - context)
        block = model.forward(ids[:, context : context + k])
        assert torch.equal(block, steps[:, :k]), f"{isa} {precision} k={k}"


@pytest.fixture(scope="module")
def wide_head_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose heads are 64 wide, as the default model's (the attention's
    AVX-512 vectors cover a 64-wide head in four)."""
    folder = tmp_path_factory.mktemp("tiny_wide_heads")
    return _saved_llama(folder, seed=1, hidden=128, heads=2, kv_heads=1)


def _batched_pass_logits(folder: Path, precision: str) -> list[torch.Tensor]:
    """Logits of three sequences (contexts of 21, 90 and 131 tokens: cached slots in
    blocks of 8 and 4 and single ones) through one pass of a decode row each, then one of
    5 tokens each (tiles), then one sequence alone with 7 tokens."""
    model = load_native(folder, precision, max_length=160, backend="kernels")
    ids = torch.randint(0, 96, (3, 150), generator=torch.Generator().manual_seed(9))
    contexts = (21, 90, 131)
    slots = [model.acquire_slot() for _ in contexts]
    for slot, row, n in zip(slots, ids, contexts, strict=True):
        model.forward_rows([RowInput(slot, row[:n])])
    decode = model.forward_rows(
        [RowInput(s, row[n : n + 1]) for s, row, n in zip(slots, ids, contexts, strict=True)]
    )
    tiles = model.forward_rows(
        [RowInput(s, row[n + 1 : n + 6]) for s, row, n in zip(slots, ids, contexts, strict=True)]
    )
    alone = model.forward_rows([RowInput(slots[0], ids[0, 27:34])])
    return [*decode, *tiles, *alone]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_isa_paths_give_the_same_forward_bits(
    wide_head_folder: Path, precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole batched forwards (decode rows, tiles, a single sequence) give the same logits
    on both libraries: the AVX-512 attention runs the AVX2 one's per-lane arithmetic in
    16-lane vectors."""
    _compiler_or_skip()
    if not _has_avx512():
        pytest.skip("this CPU cannot run the avx512 kernels: nothing to compare")
    found = {}
    for isa in ("avx2", "avx512"):
        monkeypatch.setenv(ISA_ENV, isa)
        found[isa] = _batched_pass_logits(wide_head_folder, precision)
    for a, b in zip(found["avx2"], found["avx512"], strict=True):
        assert torch.equal(a, b)


def test_roofline_names_the_binding_limit(
    tiny_folder: Path, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Peaks are measured (positive, finite); the roofline counts bytes and multiply-adds
    per k and names the larger floor as the binding one."""
    from speculative.models.native.profile import (
        MachinePeaks,
        decoder_work,
        measure_peaks,
        pass_floors,
        roofline,
    )

    peaks = measure_peaks(load_kernels(isa=isa), threads=1, repeats=1)
    assert peaks.isa == isa
    for value in (peaks.fma_macs_per_s, peaks.int8_macs_per_s, peaks.read_gbps):
        assert 0 < value < float("inf")
    monkeypatch.setenv(ISA_ENV, isa)
    model = load_native(tiny_folder, "int4", max_length=64, backend="kernels")
    work = decoder_work(model.decoder)
    per_slot = 2 * 2 * 32  # keys and values of 2 layers, 2 kv heads x 16 dims each
    assert work["kv_bytes_per_slot"] == per_slot * model.decoder.kv_dtype.itemsize
    assert model.decoder.kv_dtype == torch.float16  # below fp32 the cache holds halves
    wide = load_native(tiny_folder, "int4", max_length=64, backend="kernels", kv_cache="fp32")
    assert decoder_work(wide.decoder)["kv_bytes_per_slot"] == per_slot * 4
    layer = 64 * (64 + 2 * 32) + 64 * 64 + 64 * 2 * 160 + 160 * 64  # qkv, o, gate_up, down
    assert work["int8_macs"] == 2 * layer + 96 * 64  # the head runs int8 dots too
    assert work["fma_macs"] == 0
    slow_memory = MachinePeaks(isa, 1, 1e12, 1e12, 1e-3)  # 1 MB/s: memory binds
    slow_compute = MachinePeaks(isa, 1, 1e3, 1e3, 1e6)  # 1 kMAC/s: compute binds
    times = {1: 1.0, 4: 2.0}
    by_memory = roofline(work, slow_memory, context=10, times_ms=times)
    by_compute = roofline(work, slow_compute, context=10, times_ms=times)
    assert {v["binds"] for v in by_memory.values()} == {"memory"}
    assert {v["binds"] for v in by_compute.values()} == {"compute"}
    assert by_memory["4"]["bytes"] > by_memory["1"]["bytes"]  # 3 more KV slots
    assert by_compute["4"]["multiply_adds"] > 4 * work["int8_macs"]
    floor = by_compute["1"]["compute_floor_ms"]
    assert by_compute["1"]["over_floor"] == pytest.approx(1.0 / floor)
    # a batched pass streams the weights once for all its rows, each row its own cache
    one, two = (10, 1), (30, 2)
    alone = [pass_floors(work, slow_memory, [row]) for row in (one, two)]
    both = pass_floors(work, slow_memory, [one, two])
    assert both.bytes == alone[0].bytes + alone[1].bytes - work["weight_bytes"]
    assert both.multiply_adds == alone[0].multiply_adds + alone[1].multiply_adds
    assert both.int8_multiply_adds == 3 * work["int8_macs"]
    assert both.memory_ms < alone[0].memory_ms + alone[1].memory_ms
    assert pass_floors(work, slow_compute, [one, two]).binds == "compute"


def test_the_op_clock_times_every_op_and_leaves_the_logits_alone(
    tiny_folder: Path, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clocked forward gives bitwise the unclocked one's logits; every op of it gets
    time, all of it inside the call's wall time; a stopped clock adds nothing; the PyTorch
    decoder has no clock, and ``kernel_op_ms`` leaves the clock stopped."""
    from speculative.engine.costs import kernel_op_ms

    monkeypatch.setenv(ISA_ENV, isa)
    model = load_native(tiny_folder, "int4", max_length=64, backend="kernels")
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(3))
    model.reset()
    model.forward(ids[:, :10])
    unclocked = model.forward(ids[:, 10:14])
    model.rollback(4)
    seconds = torch.zeros(len(KERNEL_OPS), dtype=torch.float64)
    assert model.clock_kernel_ops(seconds)
    started = time.perf_counter()
    clocked = model.forward(ids[:, 10:14])
    wall = time.perf_counter() - started
    assert torch.equal(clocked, unclocked)
    assert (seconds > 0).all(), dict(zip(KERNEL_OPS, seconds.tolist(), strict=True))
    assert seconds.sum() <= wall
    model.rollback(4)
    assert model.clock_kernel_ops(None)
    before = seconds.clone()
    model.forward(ids[:, 10:14])
    assert torch.equal(seconds, before)
    with pytest.raises(ValueError, match="float64"):
        model.clock_kernel_ops(torch.zeros(len(KERNEL_OPS)))

    by_k = kernel_op_ms(model, ids[0, :10].tolist(), [1, 4], repeats=2)
    assert by_k is not None and list(by_k) == [1, 4]
    assert all(list(ops) == [*KERNEL_OPS, "outside"] for ops in by_k.values())
    assert model.decoder._model.op_seconds is None  # the clock stopped after timing
    on_torch = load_native(tiny_folder, "int4", max_length=64, backend="torch")
    assert not on_torch.clock_kernel_ops(seconds)
    assert kernel_op_ms(on_torch, ids[0, :10].tolist(), [1], repeats=1) is None


# ---- weights on transparent huge pages -------------------------------------------------


def test_weights_placed_on_huge_pages_give_the_same_bits(
    isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """place_on_huge_pages copies packed weights into one 2 MiB-aligned arena and points
    the layers at the copies: the layers' outputs are bitwise those of the original
    tensors. Below 2 MiB in all, or with $SPECULATIVE_HUGE_PAGES=0, nothing moves."""
    from speculative.models.native import hugepages

    library = load_kernels(isa=isa)
    layers = [_layer("int4", 4096, 1024), _layer("int8dot", 1024, 1024), _layer("fp32")]
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(1))
    x_small = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    inputs = [x, x, x_small]
    before = [layer(library, v, threads=2) for layer, v in zip(layers, inputs, strict=True)]
    originals = [layer.weight for layer in layers]
    arena = hugepages.place_on_huge_pages(layers)
    assert arena is not None
    start = arena.data_ptr() + (-arena.data_ptr() % hugepages.HUGE_PAGE_BYTES)
    end = arena.data_ptr() + arena.numel()
    assert layers[0].weight.data_ptr() == start  # the first weight opens a huge page
    for layer, original, v, out in zip(layers, originals, inputs, before, strict=True):
        assert start <= layer.weight.data_ptr() < end and layer.weight.data_ptr() % 64 == 0
        assert torch.equal(layer.weight, original)
        assert torch.equal(layer(library, v, threads=2), out)
    assert hugepages.place_on_huge_pages([_layer("int4")]) is None  # too small to gain
    monkeypatch.setenv(hugepages.ENV, "0")
    moved = _layer("int4", 4096, 1024)
    kept = moved.weight
    assert hugepages.place_on_huge_pages([moved]) is None and moved.weight is kept


def test_a_kernel_that_refuses_the_advice_leaves_a_working_arena(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where madvise(MADV_HUGEPAGE) fails (a kernel built without THP answers EINVAL), the
    arena is still usable memory on ordinary pages: loading must not fail over it."""
    import mmap

    from speculative.models.native import hugepages

    refused = []

    class Refusing(mmap.mmap):
        def madvise(self, *args: object) -> None:
            refused.append(args)
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(hugepages.mmap, "mmap", Refusing)
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("this platform's mmap has no MADV_HUGEPAGE")
    raw, offset = hugepages.huge_page_arena(4 * hugepages.HUGE_PAGE_BYTES)
    assert refused  # the advice was asked for and refused
    raw[offset : offset + 1024].fill_(7)
    assert int(raw[offset + 1023]) == 7


def test_an_advised_arena_gets_huge_pages_and_an_unadvised_one_does_not() -> None:
    """Where the kernel offers transparent huge pages, the arena's advice is what puts its
    pages on 2 MiB frames (read back from /proc/self/smaps); in the 'madvise' mode an
    arena without the advice (the control) gets none."""
    from speculative.models.native import hugepages

    mode = hugepages.thp_mode()
    if mode not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {mode or 'unavailable'} on this kernel")
    size = 8 * hugepages.HUGE_PAGE_BYTES
    held = {}
    for advise in (True, False):
        raw, offset = hugepages.huge_page_arena(size, advise=advise)
        raw[offset : offset + size].fill_(1)  # first touch: the pages are allocated now
        held[advise] = hugepages.huge_page_bytes(raw.data_ptr() + offset), raw
    if held[True][0] is None:
        pytest.skip("/proc/self/smaps is not readable here")
    if held[True][0] == 0:
        pytest.skip("the kernel granted no huge page (memory too fragmented to compact)")
    assert held[True][0] >= hugepages.HUGE_PAGE_BYTES
    if mode == "madvise":
        assert held[False][0] == 0
    cache = hugepages.zeros_on_huge_pages((2, 3, 1024, 256))  # a KV cache's 6 MiB
    assert cache.shape == (2, 3, 1024, 256) and cache.dtype == torch.float32
    assert not cache.any() and cache.data_ptr() % hugepages.HUGE_PAGE_BYTES == 0
    cache[:, :, :16] = 1.0  # the kernels' first stores fault the pages in, as huge pages
    assert hugepages.huge_page_bytes(cache.data_ptr()) >= hugepages.HUGE_PAGE_BYTES
