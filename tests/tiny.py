"""Tiny, seeded Llama-architecture models with a word-level tokenizer, built in-process."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from speculative.models.hf import HFCausalLM
from speculative.targets import LoadedModel, hf_loaded

WORDS = [
    "the", "a", "cat", "dog", "sat", "ran", "on", "mat", "rug",
    "and", "then", "it", "was", "big", "small", "red", "blue", "end",
]  # fmt: skip


def tiny_tokenizer(words: list[str] = WORDS) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with one token per byte (no merges) and ``</s>`` (id 1): any
    text, JSON included, one byte a token (what grammar-constrained decoding needs)."""
    vocab = {"<unk>": 0, "</s>": 1}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


def tiny_llama(
    seed: int, vocab: int, layers: int = 2, max_positions: int = 2048, scale: float = 0.2
) -> LlamaForCausalLM:
    """max_positions: the context window both runtimes give the model (the servers' tests
    decode rows of up to 2,000 tokens)."""
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        initializer_range=scale,  # large init: peaked, seed-dependent distributions
        tie_word_embeddings=False,
        eos_token_id=1,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()


def tiny_loaded(seed: int = 0, layers: int = 4, vocab: int | None = None, **kw) -> LoadedModel:
    tokenizer = tiny_tokenizer()
    width = vocab or len(tokenizer.get_vocab())
    lm = HFCausalLM(tiny_llama(seed, width, layers, **kw), tokenizer=tokenizer, name=f"tiny{seed}")
    return hf_loaded(lm, eos=frozenset({1}))


def save_tiny(
    folder: Path,
    seed: int = 0,
    layers: int = 2,
    vocab: int | None = None,
    tokenizer: PreTrainedTokenizerFast | None = None,
    **kw,
) -> Path:
    tokenizer = tokenizer or tiny_tokenizer()
    width = vocab or len(tokenizer.get_vocab())
    tiny_llama(seed, width, layers, **kw).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_trained(
    folder: Path,
    tokenizer: PreTrainedTokenizerFast,
    answers: list[tuple[list[int], str]],
    seed: int = 7,
    goal: float = 0.002,
) -> Path:
    """A tiny Llama trained (about a second) to answer each prompt (token ids) with its
    text and then ``</s>`` (id 1), every token at probability > 0.8 under greedy decoding
    (the summed loss under ``goal``), saved with ``tokenizer`` in ``folder``."""
    model = tiny_llama(seed, len(tokenizer.get_vocab()), layers=2).train()
    batch = []
    for prompt, text in answers:
        reply = [*tokenizer(text, add_special_tokens=False)["input_ids"], 1]
        labels = [-100] * len(prompt) + reply
        batch.append((torch.tensor([prompt + reply]), torch.tensor([labels])))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for _ in range(300):
            loss = sum(model(ids, labels=labels).loss for ids, labels in batch)
            if loss.item() < goal:
                break
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert loss.item() < goal
    model.eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
