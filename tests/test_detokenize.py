"""The incremental decoder: after every token its text is the whole decoding of the tokens
so far, while it decodes a bounded window per token (not the whole prefix); a decoder
that rewrites across tokens is caught by its checks and decoded whole from then on."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest

from speculative.detokenize import IncrementalDecoder
from tiny import byte_tokenizer

TEXT = "Größe: 5 €, naïve café — 日本語 ok. The end is near; then more text.\n" * 40


class Counting:
    """A decode function that counts the tokens it was asked to decode."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self.decode = decode
        self.tokens = 0

    def __call__(self, ids: Sequence[int]) -> str:
        self.tokens += len(ids)
        return self.decode(ids)


def byte_chunks(rng: random.Random, junk: bool) -> tuple[list[int], Callable]:
    """TEXT as UTF-8 chunks of 1–4 bytes (characters cut apart), with stray bytes that
    are not UTF-8 here and there when ``junk``; decoded as byte-level BPE decodes."""
    data, vocab, i = TEXT.encode(), [], 0
    while i < len(data):
        n = rng.randint(1, 4)
        vocab.append(data[i : i + n] + (b"\xff" if junk and rng.random() < 0.02 else b""))
        i += n
    return list(range(len(vocab))), lambda ids: b"".join(vocab[i] for i in ids).decode(
        "utf-8", "replace"
    )


def sentencepiece_like(rng: random.Random) -> tuple[list[int], Callable]:
    """Words with a leading "▁" for their space, the first token's space dropped (as
    SentencePiece's Metaspace decoder drops it)."""
    words = TEXT.split(" ")
    vocab = ["▁" + w if k else w for k, w in enumerate(words)]
    return list(
        range(len(vocab))
    ), lambda ids: "".join(vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")


def hf_bytes(rng: random.Random) -> tuple[list[int], Callable]:
    tokenizer = byte_tokenizer()
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    return ids, lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


@pytest.mark.parametrize("make", ["bytes", "junk", "sentencepiece", "hf"])
def test_the_text_is_the_whole_decoding_after_every_token(make: str) -> None:
    rng = random.Random(0)
    tokens, decode = {
        "bytes": lambda: byte_chunks(rng, junk=False),
        "junk": lambda: byte_chunks(rng, junk=True),
        "sentencepiece": lambda: sentencepiece_like(rng),
        "hf": lambda: hf_bytes(rng),
    }[make]()
    counting = Counting(decode)
    decoder = IncrementalDecoder(counting)
    for n, token in enumerate(tokens, 1):
        assert decoder.add(token) == decode(tokens[:n])
    assert decoder.verify() and not decoder.whole  # windowed all the way
    # the whole prefix decoded after every token would cost n²/2 token decodes
    assert len(tokens) > 400 and counting.tokens < 24 * len(tokens) < len(tokens) ** 2 / 2 / 10


def test_a_clean_up_across_the_anchor_is_caught_by_the_context() -> None:
    """A tokenizer's clean-up (" ." → ".") changes the text before a new token; the
    window's context sees it and the decoder decodes whole for that token."""
    pieces = ["a", " b", " ", ".", " c"] * 10

    def decode(ids: Sequence[int]) -> str:
        return "".join(pieces[i] for i in ids).replace(" .", ".")

    decoder = IncrementalDecoder(decode)
    for n in range(1, len(pieces) + 1):
        assert decoder.add(n - 1) == decode(range(n))
    assert decoder.verify()


def test_a_decoder_that_reaches_past_the_window_is_caught_by_the_checks() -> None:
    """Control: a decoding that drops everything after an end marker reaches further back
    than any window, so the windowed text alone goes wrong; the whole-decoding check
    finds it, and the decoder decodes whole from then on."""
    pieces = ["w"] * 20 + ["<end>"] + ["x"] * 60

    def decode(ids: Sequence[int]) -> str:
        return "".join(pieces[i] for i in ids).partition("<end>")[0]

    decoder = IncrementalDecoder(decode)
    texts = [decoder.add(i) for i in range(40)]
    assert texts != [decode(range(n)) for n in range(1, 41)]  # windowed, it went wrong
    assert not decoder.verify() and decoder.whole and decoder.text == decode(range(40))
    decoder.add(40)
    assert decoder.text == decode(range(41))  # whole from then on
    checked = IncrementalDecoder(decode)
    assert [checked.add(i) for i in range(len(pieces))][-1] == decode(range(len(pieces)))
    assert checked.whole  # the first check (at 64 tokens) found it without being asked


@pytest.mark.parametrize("make", ["bytes", "junk", "sentencepiece"])
def test_a_decoder_started_with_a_prompt_goes_on_as_one_fed_token_by_token(make: str) -> None:
    """``starting_with`` decodes a long start once; the text after every later token is
    the whole decoding, and the tokens after the start cost windows, not the prefix."""
    rng = random.Random(1)
    tokens, decode = {
        "bytes": lambda: byte_chunks(rng, junk=False),
        "junk": lambda: byte_chunks(rng, junk=True),
        "sentencepiece": lambda: sentencepiece_like(rng),
    }[make]()
    start = len(tokens) // 2
    counting = Counting(decode)
    decoder = IncrementalDecoder.starting_with(counting, tokens[:start])
    assert decoder.text == decode(tokens[:start])
    at_start = counting.tokens
    assert at_start <= start + 8  # one whole decoding (and the window's context)
    for n in range(start + 1, len(tokens) + 1):
        assert decoder.add(tokens[n - 1]) == decode(tokens[:n])
    assert decoder.verify()
    later = counting.tokens - at_start - 2 * len(tokens)  # the whole-decoding checks
    assert later < 24 * (len(tokens) - start)
