"""Log-probabilities in OpenAI's response shapes.

The engine gives, for each emitted token, its log-probability under the target's raw
distribution and the likeliest alternatives (:class:`~speculative.engine.round.
TokenLogprobs`); speculation does not change them (a row's logits are those of plain
decoding). Here they become chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}``
or completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``, for the tokens of
the text actually sent (see :class:`~speculative.server.text.TextAssembler`). An echoed
prompt's tokens come first in completions (:func:`echoed_prompt`): the first with null
log-probabilities (nothing precedes it), the others scored by the target's prefill.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from speculative.detokenize import added_text
from speculative.engine.round import TokenLogprobs
from speculative.server.text import TextAssembler

WINDOW = 4  # tokens before a token that its text is decoded after (see _text)


class LogprobsFormatter:
    """Formats a response's token log-probabilities, a chunk's worth at a time.

    A token's text is what it adds to the decoded text: the chosen token's is its slice of
    the response's text (so the tokens add up to it); an alternative's is what decoding it
    after the WINDOW tokens before adds to decoding them alone (a token's leading space,
    say, exists only after another token)."""

    def __init__(
        self, decode: Callable[[Sequence[int]], str], chat: bool, text_offset: int = 0
    ) -> None:
        """``text_offset``: where the formatted text starts in the response's text (after
        an echoed prompt)."""
        self.decode = decode
        self.chat = chat
        self.text_offset = text_offset
        # every token's so far; None: a token without one (an echoed prompt's first)
        self.entries: list[TokenLogprobs | None] = []
        self.sent = 0  # entries already formatted

    def add(self, entries: Sequence[TokenLogprobs | None] | None) -> None:
        self.entries.extend(entries or ())

    def take(self, text: TextAssembler, final: bool = False) -> dict[str, Any] | None:
        """In the response's shape, the entries not taken yet of the tokens whose text
        ``text`` has released (``final``: of the whole final text); None when there are
        none (without entries, as when none were asked for, the text is not read)."""
        if len(self.entries) <= self.sent:
            return None
        upto = min(text.final_tokens() if final else text.settled_tokens(), len(self.entries))
        if upto <= self.sent:
            return None
        chosen = range(self.sent, upto)
        self.sent = upto
        if self.chat:
            return {"content": [self._chat_entry(i, text) for i in chosen]}
        entries = [self.entries[i] for i in chosen]
        return {
            "tokens": [self._chosen_text(i, text) for i in chosen],
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [
                None if e is None else dict(self._alternatives(i, text))
                for i, e in zip(chosen, entries, strict=True)
            ],
            "text_offset": [self.text_offset + text.offset(i) for i in chosen],
        }

    def _chosen_text(self, i: int, text: TextAssembler) -> str:
        return text.text[text.offset(i) : text.ends[i]]

    def _alternatives(self, i: int, text: TextAssembler) -> list[tuple[str, float]]:
        """(text, log-probability) of entry i's alternatives: what each adds to the text
        in token i's place (the chosen token's own slice where it is among them)."""
        entry = self.entries[i]
        assert entry is not None
        window = text.tokens[max(0, i - WINDOW) : i]
        before = self.decode(window)
        out = []
        for token, logprob in entry.top:
            if token == entry.token:
                out.append((self._chosen_text(i, text), logprob))
                continue
            added = added_text(self.decode, window, [token], before)
            out.append((self.decode([token]) if added is None else added, logprob))
        return out

    def _chat_entry(self, i: int, text: TextAssembler) -> dict[str, Any]:
        chosen = self._chosen_text(i, text)
        entry = self.entries[i]
        assert entry is not None  # chat has no echoed prompt
        return {
            "token": chosen,
            "logprob": entry.logprob,
            "bytes": list(chosen.encode()),
            "top_logprobs": [
                {"token": added, "logprob": logprob, "bytes": list(added.encode())}
                for added, logprob in self._alternatives(i, text)
            ],
        }


def echoed_prompt(
    decode: Callable[[Sequence[int]], str],
    prompt_ids: Sequence[int],
    entries: Sequence[TokenLogprobs] | None,
) -> dict[str, Any] | None:
    """Completions' log-probabilities of an echoed prompt's tokens (``entries``: one per
    token after the first; None: none were asked for, and None is returned): each token's
    text is its slice of the decoded prompt, its offset where that slice starts."""
    if entries is None:
        return None
    text = TextAssembler(decode)
    text.push(prompt_ids, ["prompt"] * len(prompt_ids))
    text.finish()
    formatter = LogprobsFormatter(decode, chat=False)
    formatter.add([None, *entries])
    return formatter.take(text, final=True)


def joined(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two parts of a completion's log-probabilities (an echoed prompt's and the
    completion's) as one: every list of the first, then the second's."""
    if first is None or second is None:
        return first if second is None else second
    return {key: first[key] + second[key] for key in first}
