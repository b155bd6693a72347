"""``decode(tokens)`` kept up to date token by token, at a cost that does not grow with
the length.

Decoding the whole generation after every token costs O(n) a token (about 0.37 ms at
1,000 tokens on SmolLM2's tokenizer), so O(n²) a generation. :class:`IncrementalDecoder`
decodes only a window: the tokens since the last *anchor*, a point where the text
decoded so far was whole (no trailing U+FFFD, the mark of a character cut short), plus
the few tokens before it as context. The new text is the window's decoding minus its
context's decoding, added to the text up to the anchor, as vLLM's incremental
detokenizer does; the context makes a tokenizer's treatment of a leading token (a
SentencePiece word's space) the same on both sides of the subtraction.

That is exact for tokenizers whose decoding is local (byte-level BPE as SmolLM2's,
SentencePiece, byte tokenizers). One that rewrites across tokens (``clean_up_tokenization
_spaces``: " ." → ".") may differ near an anchor, so the decoder checks itself against a
whole decoding whenever the length doubles and on :meth:`IncrementalDecoder.verify`
(at the end of a generation), and decodes whole from the first difference on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"  # what a decoder writes for a character cut short
WINDOW = 8  # tokens past the anchor before it moves (each add decodes at most 2 × this)
FIRST_CHECK = 64  # tokens at the first whole-decoding check (then 128, 256, ...)


def added_text(
    decode: Callable[[Sequence[int]], str],
    context: Sequence[int],
    new: Sequence[int],
    before: str | None = None,
) -> str | None:
    """The text ``new`` adds after ``context`` (a few tokens before it): decoded together,
    minus the context's own decoding (``before``, when the caller has it), so pieces that
    join across the boundary (a SentencePiece word's space, a character's bytes) join;
    None where the joint text does not start with the context's."""
    before = decode(context) if before is None else before
    after = decode([*context, *new])
    return after[len(before) :] if after.startswith(before) else None


@dataclass
class IncrementalDecoder:
    """The text of ``tokens`` (``decode(tokens)``), kept as tokens are added."""

    decode: Callable[[Sequence[int]], str]
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # decode(tokens)
    whole: bool = False  # decode everything every time (a windowed text differed)
    _context: int = 0  # where the window starts (the anchor before the last)
    _anchor: int = 0  # tokens[:anchor]'s text is text_at_anchor
    _text_at_anchor: str = ""
    _context_text: str = ""  # decode(tokens[context:anchor])
    _next_check: int = FIRST_CHECK
    _verified: int = 0  # the length at the last whole decoding that agreed

    @classmethod
    def starting_with(
        cls, decode: Callable[[Sequence[int]], str], tokens: Sequence[int]
    ) -> IncrementalDecoder:
        """A decoder already holding ``tokens`` (one whole decoding, anchored at its end
        where the text is whole), for a long start such as a prompt: cheaper than adding
        its tokens one by one."""
        decoder = cls(decode, list(tokens), decode(tokens))
        n = len(decoder.tokens)
        decoder._verified = n
        decoder._next_check = max(FIRST_CHECK, 2 * n)
        if not decoder.text.endswith(REPLACEMENT):  # else the window starts at 0 until whole
            decoder._context, decoder._anchor = max(0, n - WINDOW), n
            decoder._text_at_anchor = decoder.text
            decoder._context_text = decode(decoder.tokens[decoder._context : n])
        return decoder

    def add(self, token: int) -> str:
        """Add one token; returns the text of all of them."""
        self.tokens.append(token)
        if self.whole:
            self.text = self.decode(self.tokens)
            return self.text
        window = self.decode(self.tokens[self._context :])
        if not window.startswith(self._context_text):  # the context decoded otherwise
            self.text = self.decode(self.tokens)
            self._move_anchor()
            return self.text
        self.text = self._text_at_anchor + window[len(self._context_text) :]
        if len(self.tokens) >= self._next_check:
            self._next_check *= 2
            self.verify()
        elif len(self.tokens) - self._anchor >= WINDOW and not self.text.endswith(REPLACEMENT):
            self._move_anchor()
        return self.text

    def extend(self, tokens: Sequence[int]) -> str:
        for token in tokens:
            self.add(token)
        return self.text

    def verify(self) -> bool:
        """Check the text against a whole decoding (once per length); where they differ,
        take the whole decoding and decode whole from now on. Returns whether they
        agreed."""
        if self._verified == len(self.tokens):
            return True
        full = self.decode(self.tokens)
        agreed = full == self.text
        self.text = full
        self.whole = self.whole or not agreed
        self._verified = len(self.tokens)
        if agreed and not self.text.endswith(REPLACEMENT):
            self._move_anchor()
        return agreed

    def _move_anchor(self) -> None:
        """Anchor at the end (where the text is whole), the last anchor as context."""
        if self.text.endswith(REPLACEMENT):
            return
        self._context = self._anchor
        self._anchor = len(self.tokens)
        self._text_at_anchor = self.text
        self._context_text = self.decode(self.tokens[self._context : self._anchor])
