"""JSON schemas as token constraints, through llguidance.

llguidance compiles a grammar against the tokenizer's byte strings and answers, for the
output so far, which tokens may come next as a bitmask (a few microseconds a step once its
lexer states are warm; about a millisecond the first time). A :class:`GrammarConstraint`
keeps one matcher per row: :meth:`~GrammarConstraint.extend` consumes the committed tokens,
:meth:`~GrammarConstraint.restrict` consumes a row's drafted tokens, reads the mask and
rolls them back.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from speculative.sampling.constraints import ConstraintError

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # "json_object": any JSON object
# JSON as json.dumps writes it: ", " between items, ": " after keys, no other whitespace.
# Flexible whitespace lets a small model pad its output with newlines and tabs forever.
JSON_FORMAT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
MISSING = (
    "structured outputs need the llguidance package (pip install llguidance), "
    "installed with speculative"
)


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise ValueError(MISSING) from exc
    return llguidance


@dataclass(frozen=True)
class RowMask:
    """The tokens a grammar allows next, as whichever list is shorter: the allowed ones
    (``keep``) or the refused ones. Writing −inf through an index touches only the
    tokens it names, where a vocabulary-wide boolean mask costs tens of microseconds a
    row (free text refuses a few hundred of 49k tokens; a JSON number allows a dozen)."""

    keep: bool  # index: the allowed tokens (True) or the refused ones (False)
    index: torch.Tensor  # [n] int64

    def apply(self, row: torch.Tensor) -> torch.Tensor:
        """``row`` ([vocab] float32, changed in place) −inf where refused."""
        if self.keep:
            kept = row.index_select(0, self.index)
            row.fill_(float("-inf"))
            return row.index_copy_(0, self.index, kept)
        return row.index_fill_(0, self.index, float("-inf"))


class GrammarConstraint:
    """The tokens a grammar allows after one row's output (one instance per row)."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        # the last mask, by (bitmask, vocabulary): a state that repeats (free text, a
        # string's characters) gives the same mask step after step
        self._mask: tuple[tuple[bytes, int], RowMask] | None = None

    def extend(self, tokens: Sequence[int]) -> None:
        """Consume the committed tokens (each one the grammar allowed where it was
        emitted); ConstraintError if the grammar refuses one (the output left it). Once the
        grammar is complete it allowed end-of-sequence alone, which ends the output:
        nothing is left to consume."""
        matcher = self.matcher
        for token in tokens:
            if matcher.is_stopped():
                return
            if not matcher.consume_token(token):
                raise ConstraintError(f"the output left its grammar: {matcher.get_error()}")

    def restrict(
        self,
        logits: torch.Tensor,  # [n, vocab] float32, changed in place
        extras: Sequence[Sequence[int]],  # [n] drafted tokens before row i
    ) -> torch.Tensor:
        """Row i −inf wherever the grammar refuses the next token after output +
        extras[i]; rows after a drafted token it refuses are left as they are."""
        matcher = self.matcher
        for i, extra in enumerate(extras):
            taken = matcher.try_consume_tokens(list(extra)) if extra else 0
            if taken == len(extra):
                self.mask(logits.shape[-1]).apply(logits[i])
            if taken:
                matcher.rollback(taken)
        return logits

    def allows(self, extra: Sequence[int], token: int) -> bool:
        """Whether ``token`` may follow output + ``extra`` (consumed, then rolled back)."""
        tokens = [*extra, token]
        taken = self.matcher.try_consume_tokens(tokens)
        if taken:
            self.matcher.rollback(taken)
        return taken == len(tokens)

    def forced(self, limit: int) -> list[int]:
        """The tokens of the text the grammar forces next (its fast-forward tokens: a
        schema's keys and punctuation), at most ``limit``; [] where it forces none."""
        if limit < 1 or self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens()[:limit])

    def mask(self, vocab: int) -> RowMask:
        """What may come next among the first ``vocab`` tokens (every token past the
        tokenizer's mask refused); ConstraintError where nothing may."""
        bits = bytes(self.matcher.compute_bitmask())
        key = (bits, vocab)
        if self._mask is not None and self._mask[0] == key:
            return self._mask[1]
        allowed = self._allowed(bits)[:vocab]
        keep = 2 * int(np.count_nonzero(allowed)) < vocab  # fewer allowed than refused
        index = np.flatnonzero(allowed if keep else ~allowed)
        if not keep and allowed.size < vocab:
            index = np.concatenate([index, np.arange(allowed.size, vocab)])
        mask = RowMask(keep, torch.from_numpy(index.astype(np.int64)))
        self._mask = (key, mask)
        return mask

    def _allowed(self, bitmask: bytes) -> np.ndarray:
        """The bitmask unpacked (bool per token); ConstraintError where it allows none."""
        bits = np.frombuffer(bitmask, dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little").astype(bool)
        if not allowed.any():
            error = self.matcher.get_error() or "no token can continue the output"
            raise ConstraintError(f"the grammar allows no token: {error}")
        return allowed


@dataclass(frozen=True)
class OutputFormat:
    """What an output must be, one of: JSON valid under a schema, a full match of a regular
    expression, exactly one of some strings, or a sentence of a Lark grammar."""

    json_schema: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    lark: str | None = None

    def __post_init__(self) -> None:
        given = [v for v in (self.json_schema, self.regex, self.choice, self.lark) if v is not None]
        if len(given) != 1:
            raise ValueError(
                "give one output format: a JSON schema, a regex, a choice or a grammar "
                f"(got {len(given)})"
            )

    @classmethod
    def given(
        cls,
        json_schema: dict[str, Any] | str | None = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        lark: str | None = None,
    ) -> OutputFormat | None:
        """The format of whichever option is given (None: none is, free text);
        ValueError for two."""
        if json_schema is None and regex is None and choice is None and lark is None:
            return None
        return cls(json_schema, regex, None if choice is None else tuple(choice), lark)

    def compile(self, outputs: StructuredOutputs) -> Callable[[], GrammarConstraint]:
        """Fresh constraints (one per row) for this format over ``outputs``' tokenizer;
        ValueError saying what cannot be compiled."""
        if self.json_schema is not None:
            return outputs.json_schema(self.json_schema)
        if self.regex is not None:
            return outputs.regex(self.regex)
        if self.choice is not None:
            return outputs.choice(self.choice)
        assert self.lark is not None
        return outputs.lark(self.lark)


class StructuredOutputs:
    """Grammars over one tokenizer: its conversion (about 0.3 s for a 49k vocabulary) is
    made once, each schema compiled when asked, each row's matcher fresh."""

    def __init__(self, tokenizer: Any, eos_token_ids: Collection[int]) -> None:
        """``eos_token_ids``: the tokens that end a generation (allowed once the JSON is
        complete, and only then)."""
        llguidance = _llguidance()
        eos = sorted(eos_token_ids) or None
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=eos)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"structured outputs cannot use this tokenizer: {exc}") from None
        self._matcher = llguidance.LLMatcher

    def json_schema(self, schema: dict[str, Any] | str) -> Callable[[], GrammarConstraint]:
        """Fresh constraints (one per row) whose outputs are JSON valid under ``schema``
        (a dict or its JSON text; :data:`ANY_OBJECT` for any object); ValueError saying
        what is wrong with a schema that cannot be compiled."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
        try:
            grammar = self._matcher.grammar_from_json_schema(schema, overrides=JSON_FORMAT)
        except ValueError as exc:
            raise ValueError(f"the JSON schema cannot be used: {exc}") from None
        return self._compiled(grammar, "the JSON schema")

    def regex(self, pattern: str) -> Callable[[], GrammarConstraint]:
        """Fresh constraints whose outputs match the regular expression ``pattern`` in
        full (Rust regex syntax)."""
        return self._compiled(self._matcher.grammar_from_regex(pattern), "the regex")

    def choice(self, options: Sequence[str]) -> Callable[[], GrammarConstraint]:
        """Fresh constraints whose outputs are exactly one of ``options``."""
        if not options or any(not isinstance(o, str) or not o for o in options):
            raise ValueError("choose among one or more non-empty strings")
        rule = " | ".join(json.dumps(option) for option in options)  # Lark string literals
        return self._compiled(self._matcher.grammar_from_lark(f"start: {rule}"), "the choice")

    def lark(self, grammar: str) -> Callable[[], GrammarConstraint]:
        """Fresh constraints whose outputs the Lark grammar ``grammar`` derives from its
        ``start`` rule (llguidance's Lark dialect)."""
        return self._compiled(self._matcher.grammar_from_lark(grammar), "the grammar")

    def _compiled(self, grammar: str, what: str) -> Callable[[], GrammarConstraint]:
        """Fresh constraints of a compiled ``grammar``; ValueError naming ``what`` with
        the compiler's message where it cannot be used."""
        matcher, tokenizer = self._matcher, self.tokenizer
        error = matcher.validate_grammar(grammar, tokenizer)
        if error:
            raise ValueError(f"{what} cannot be used: {error}")
        return lambda: GrammarConstraint(matcher(tokenizer, grammar, log_level=0))


def constraints_for(loaded: Any, output: OutputFormat) -> Callable[[], GrammarConstraint]:
    """Fresh constraints (one per row) for ``output`` over a loaded model's tokenizer."""
    return output.compile(structured_outputs(loaded))


def structured_outputs(loaded: Any) -> StructuredOutputs:
    """A loaded model's :class:`StructuredOutputs`, built on first use and kept with it
    (:meth:`~speculative.targets.LoadedModel.shared`)."""
    return loaded.shared(
        "structured-outputs",
        lambda: StructuredOutputs(loaded.tokenizer, loaded.eos_token_ids),
    )
