"""Draft with a causal LM whose vocabulary is not the target's, through text.

The target's context is decoded to text and encoded with the draft model's tokenizer; the
draft model continues it greedily; its new text is encoded with the target's tokenizer,
and those target tokens are the draft. The draft is a point mass (no q over the target's
vocabulary exists), which the verifier accepts with probability p(token) and, on a
rejection, replaces by a draw from p without that token renormalized: the output is the
target's own distribution whatever the bridge proposes (Timor et al., 2025, "Accelerating
LLM Inference with Lossless Speculative Decoding Algorithms for Heterogeneous
Vocabularies": string-level exact match; transformers' universal assisted generation).

What a round costs besides the draft model's steps does not grow with the context: the
context's text is kept as tokens are committed (:class:`IncrementalDecoder`), and its draft
tokens too, re-encoding only the text after a draft token a few tokens before where the
text changed (the character offsets of a fast tokenizer's encoding say where each token
ends; a tokenizer without them is encoded whole every round).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any

import torch

from speculative.detokenize import IncrementalDecoder, added_text
from speculative.drafters.base import Draft
from speculative.drafters.model import draft_session, model_weight_bytes
from speculative.models.base import CausalLM
from speculative.models.session import common_prefix_length
from speculative.sampling import SamplingParams

# target tokens re-encoded with the draft's new text, so the first drafted target token
# is cut where the target's tokenizer would cut it (a SentencePiece tokenizer adds a
# word-start marker to text encoded alone)
_OVERLAP = 4
# draft tokens re-encoded before the first changed character (a token's cut can depend on
# the text after it), and the tokens of context decoded with the draft's new ones
_REENCODED = 4
_DECODE_CONTEXT = 8


class TextBridgeDrafter:
    """A draft model with a tokenizer of its own, bridged to the target's through text."""

    def __init__(
        self,
        model: CausalLM,
        draft_tokenizer: Any,
        target_tokenizer: Any,
        draft_eos: frozenset[int],
        name: str = "text-bridge",
    ) -> None:
        """draft_eos: the draft model's end-of-sequence ids (its drafting stops there)."""
        self.name = name
        self.draft_tokenizer = draft_tokenizer
        self.target_tokenizer = target_tokenizer
        self.draft_eos = draft_eos
        self._text: IncrementalDecoder | None = None  # the target context's text
        self._draft_text = _DraftEncoding(draft_tokenizer)
        self.session = draft_session(self, model)

    @property
    def bridged_model(self) -> CausalLM:
        """The draft model. Not :class:`RunsDraftModel`'s ``draft_model``: what reads that
        feeds the draft model target token ids (timing it, or handing it to transformers
        as an assistant); this drafter's cost is its whole ``propose``, text work
        included."""
        return self.session.model

    @property
    def forward_calls(self) -> int:
        return self.session.forward_calls

    def reset(self) -> None:
        self.session.reset()
        self._text = None
        self._draft_text = _DraftEncoding(self.draft_tokenizer)

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        """Nothing to learn: the next propose() rolls the draft cache back by common
        prefix."""

    def draft_weight_bytes(self) -> int:
        """:class:`ReportsDraftCost`: the draft model's weight bytes (0 when unknown)."""
        return model_weight_bytes(self.session.model)

    def draft_backlog(self, context: Sequence[int]) -> int:
        """:class:`ReportsDraftCost`: unknown before the context is re-encoded: 0."""
        return 0

    @torch.no_grad()
    def propose(
        self,
        context: Sequence[int],
        gamma: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        """Up to ``gamma`` target tokens: the target tokens of the draft model's greedy
        continuation (``gamma`` draft tokens) of the context's text. Point masses, so
        ``params`` and ``generator`` are not needed: the verifier keeps the output exact."""
        if gamma < 1 or not context:
            return Draft([])
        draft_context = self._draft_text.ids_for(self._context_text(context))
        room = getattr(self.session.model, "max_length", None)
        if not draft_context or (room is not None and len(draft_context) + gamma > room):
            return Draft([])  # nothing to continue, or past the draft model's context
        continuation = self._continue(draft_context, gamma)
        new_text = _new_text(self.draft_tokenizer, draft_context, continuation)
        if not new_text:
            return Draft([])
        return Draft(self._target_tokens(context, new_text)[:gamma])

    def _context_text(self, context: Sequence[int]) -> str:
        """The target context's text, decoding only what was committed since the last
        round (whole for a new sequence)."""
        kept = self._text
        if kept is None or common_prefix_length(kept.tokens, context) < len(kept.tokens):
            self._text = IncrementalDecoder.starting_with(_decoder(self.target_tokenizer), context)
            return self._text.text
        return kept.extend(context[len(kept.tokens) :])

    def _continue(self, draft_context: list[int], count: int) -> list[int]:
        """The draft model's greedy continuation: at most ``count`` draft tokens, ending
        before its end-of-sequence token."""
        sequence = list(draft_context)
        drafted: list[int] = []
        for _ in range(count):
            logits = self.session.logits_after(sequence)[0, -1]  # [draft vocab]
            token = int(torch.argmax(logits))
            if token in self.draft_eos:
                break
            drafted.append(token)
            sequence.append(token)
        return drafted

    def _target_tokens(self, context: Sequence[int], new_text: str) -> list[int]:
        """``new_text`` as the target's tokenizer cuts it after the context's last tokens
        (the last _OVERLAP tokens re-encoded with it; where they do not come back as
        they were, the text encoded alone)."""
        tokenizer = self.target_tokenizer
        tail = list(context[-_OVERLAP:])
        tail_text = tokenizer.decode(tail, skip_special_tokens=False)
        joined = tokenizer.encode(tail_text + new_text, add_special_tokens=False)
        if joined[: len(tail)] == tail and len(joined) > len(tail):
            return joined[len(tail) :]
        return tokenizer.encode(new_text, add_special_tokens=False)


def _new_text(tokenizer: Any, context: list[int], continuation: list[int]) -> str:
    """The text ``continuation`` adds after ``context`` (decoded with the context's last
    tokens); empty where that text does not extend theirs."""
    if not continuation:
        return ""
    added = added_text(_decoder(tokenizer), context[-_DECODE_CONTEXT:], continuation)
    return added or ""


def _decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """``tokenizer``'s decoding with its special tokens kept (chat markers are text the
    other side's tokenizer may know)."""
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)


class _DraftEncoding:
    """The draft tokenizer's ids for a text that grows round by round, re-encoding only
    its end: the text after the draft token _REENCODED tokens before the first character
    that changed since the last round."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self.ids: list[int] = []
        self.ends: list[int] = []  # the character where each token's text ends
        self.offsets = True  # the tokenizer gives offsets (fast tokenizers)

    def ids_for(self, text: str) -> list[int]:
        same = common_prefix_length(self.text, text)
        keep = _tokens_before(self.ends, same) - _REENCODED
        keep = max(0, keep) if self.offsets else 0
        start = self.ends[keep - 1] if keep else 0
        ids, ends = self._encode(text[start:])
        self.ids = self.ids[:keep] + ids
        self.ends = self.ends[:keep] + [start + end for end in ends]
        self.text = text
        return self.ids

    def _encode(self, text: str) -> tuple[list[int], list[int]]:
        """``text``'s ids and each one's end character (offsets past the text's end where
        the tokenizer gives none)."""
        if self.offsets:
            try:
                encoded = self.tokenizer(
                    text, add_special_tokens=False, return_offsets_mapping=True
                )
                return list(encoded["input_ids"]), [end for _, end in encoded["offset_mapping"]]
            except (NotImplementedError, KeyError, TypeError):
                self.offsets = False
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids, [len(text)] * len(ids)


def _tokens_before(ends: list[int], limit: int) -> int:
    """How many leading tokens end at or before character ``limit``."""
    return bisect_right(ends, limit)
