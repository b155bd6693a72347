"""A tiny seeded Llama target for ``speculative check --target tiny`` and the matrix.

A TEST FIXTURE, not a language model: random weights (seeded), a 20-word vocabulary, and
random (untrained, seeded) EAGLE and Medusa heads, written once into a folder so that the
ordinary loading path (native or transformers runtime) and the drafter registry
(``eagle:DIR``, ``medusa:DIR``, ``auto:DIR``) are what the check exercises. Peaked,
seed-dependent next-token distributions (large init) make drafts and target disagree
often, so broken rules show quickly.
"""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = (
    "the", "a", "cat", "dog", "sat", "ran", "on", "mat", "rug",
    "and", "then", "it", "was", "big", "small", "red", "blue", "end",
)  # fmt: skip
HIDDEN = 64
EOS_SCALE = 0.3  # the EOS row of the output head, shrunk
# token ids (EOS is 1); repetitive, so that n-gram lookup drafts from the first round
TINY_PROMPTS = ([2, 4, 6, 8, 2, 4, 6], [3, 5, 7, 9, 3, 5])


def tiny_vocab() -> dict[str, int]:
    return {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}


def save_tiny_target(folder: Path, seed: int = 0, layers: int = 2) -> Path:
    """Write the tiny model (config, safetensors, tokenizer) and its two heads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = tiny_vocab()
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="</s>"
    )
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=1,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # EOS possible but rare: continuations mostly run their length
        model.lm_head.weight[config.eos_token_id] *= EOS_SCALE
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    save_random_heads(folder, seed, len(vocab))
    return folder


def save_random_heads(folder: Path, seed: int, vocab: int) -> None:
    """Random (seeded) EAGLE and Medusa heads for the tiny Llama in ``folder`` (hidden
    size HIDDEN, 4 heads, 2 KV heads), into ``folder/eagle`` and ``folder/medusa``."""
    from speculative.heads.modules import HeadConfig, build_head
    from speculative.heads.store import save_head
    from speculative.models.native import load_native

    target = load_native(folder, "fp32", max_length=64, backend="torch", max_slots=1)
    configs = (
        HeadConfig("eagle", HIDDEN, vocab, intermediate_size=2 * HIDDEN, num_heads=4,
                   num_kv_heads=2),
        HeadConfig("medusa", HIDDEN, vocab, medusa_heads=3),
    )  # fmt: skip
    for config in configs:
        with torch.random.fork_rng():
            torch.manual_seed(seed + 1)
            module = build_head(config).eval()
            for parameter in module.parameters():  # Medusa starts at zero: make it differ
                parameter.data.add_(0.1 * torch.randn_like(parameter))
        save_head(folder / config.method, config, module, torch.arange(vocab), target, "tiny")


def tiny_target_folder(cache: Path, seed: int = 0) -> Path:
    """The tiny target in ``cache/tiny-<seed>``, written on first use."""
    folder = Path(cache) / f"tiny-v2-{seed}"
    if not (folder / "medusa" / "config.json").is_file():
        save_tiny_target(folder, seed)
    return folder
