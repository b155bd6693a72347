"""Corpus lookup: draft by copying what followed the context's end in a corpus of the
target's own earlier answers (retrieval drafting, as REST and SuffixDecoding do).

n-gram lookup (:mod:`~speculative.drafters.ngram`) copies from the sequence itself, so it
drafts right only where the sequence repeats itself. A small model also repeats itself
*across* answers: the same openings ("Here's a step-by-step guide"), the same code idioms,
the same arithmetic phrasing. A corpus of the target's answers to many prompts holds those
phrases; the longest suffix of the context found in it, and the continuation most of its
occurrences agree on, make a draft that costs tens of microseconds and no model pass.

No model and no distribution: drafts are point masses (q one-hot), which the verifier
handles exactly, so the output is the target's whatever the corpus holds. A corpus only
changes how fast.

:class:`SuffixIndex` finds the longest match with a suffix array over the reversed corpus:
the context's last token, the one before, ... is then a prefix of the suffixes sought, so
each extra matched token narrows the previous range by two binary searches.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from speculative.corpora.store import SEPARATOR  # no match runs across it, no draft copies it
from speculative.drafters.base import Draft
from speculative.drafters.ngram import trie
from speculative.drafters.tree import DraftTree
from speculative.sampling import SamplingParams

SORT_DEPTH = 32  # suffixes are ordered by their first SORT_DEPTH tokens (the longest match)
VOTERS = 64  # occurrences that vote on the continuation, at most
MIN_MATCH = 2  # a one-token match predicts little (0.0 of 4 drafts kept on the bench)
MATCH_CLASSES = (2, 3, 4, 8)  # match lengths 2, 3, 4–7 and 8 or more


@dataclass(frozen=True)
class CorpusMatch:
    """The occurrences of the context's last ``length`` tokens in the corpus: suffix-array
    rows ``lo`` .. ``hi`` − 1."""

    length: int
    lo: int
    hi: int

    @property
    def occurrences(self) -> int:
        return self.hi - self.lo


def suffix_order(reversed_tokens: np.ndarray, depth: int = SORT_DEPTH) -> np.ndarray:
    """Start positions of ``reversed_tokens``' suffixes ordered by their first ``depth``
    tokens (prefix doubling: sort by rank pairs at offsets 0 and k, k = 1, 2, 4, ...,
    until every rank differs; ties beyond ``depth`` tokens in any order). [n] int64."""
    n = len(reversed_tokens)
    rank = reversed_tokens.astype(np.int64) - SEPARATOR  # separator -> 0, token t -> t + 1
    order = np.argsort(rank)
    k = 1
    while k < depth and n > 1:
        after = np.zeros(n, dtype=np.int64)  # rank k tokens on (0: past the end)
        after[: n - k] = rank[k:] + 1
        key = rank * (int(after.max()) + 1) + after
        order = np.argsort(key)
        sorted_keys = key[order]
        new_rank = np.empty(n, dtype=np.int64)
        new_rank[order] = np.concatenate(([0], np.cumsum(sorted_keys[1:] != sorted_keys[:-1])))
        rank = new_rank
        if int(rank[order[-1]]) == n - 1:  # all distinct: the order is final
            break
        k *= 2
    return order


def int_array(values: np.ndarray) -> array:
    """``values`` as a compact array of C ints (fast single-element reads in Python)."""
    out = array("i")
    out.frombytes(np.ascontiguousarray(values, dtype=np.int32).tobytes())
    return out


class SuffixIndex:
    """Longest-suffix lookup in a fixed corpus of token ids (documents separated by
    SEPARATOR)."""

    def __init__(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens, dtype=np.int64)  # [n]
        self.size = len(tokens)
        self.tokens = int_array(tokens)
        reversed_tokens = tokens[::-1].copy()
        order = suffix_order(reversed_tokens)
        self.reversed = int_array(reversed_tokens)
        self.order = int_array(order)
        firsts = reversed_tokens[order]  # sorted: each token's rows are one range
        top = int(tokens.max(initial=0)) + 2
        self.first = np.searchsorted(firsts, np.arange(top)).tolist()  # token t: rows from

    def match(self, context: Sequence[int], max_length: int) -> CorpusMatch | None:
        """The occurrences of the longest suffix of ``context`` (at most ``max_length``
        tokens) found in the corpus, or None when not even its last token is."""
        if not context or max_length < 1:
            return None
        last = int(context[-1])
        if not 0 <= last < len(self.first) - 1:
            return None
        lo, hi = self.first[last], self.first[last + 1]
        if lo >= hi:
            return None
        length = 1
        limit = min(max_length, len(context))
        while length < limit:
            narrower = self._narrow(lo, hi, length, int(context[-1 - length]))
            if narrower[0] >= narrower[1]:
                break
            (lo, hi), length = narrower, length + 1
        return CorpusMatch(length, lo, hi)

    def _narrow(self, lo: int, hi: int, depth: int, token: int) -> tuple[int, int]:
        """The rows of ``lo`` .. ``hi`` − 1 (which agree on their first ``depth`` tokens)
        whose token at ``depth`` is ``token``."""
        reversed_tokens, order, size = self.reversed, self.order, self.size
        a, b = lo, hi
        while a < b:  # first row whose token at depth is >= token
            mid = (a + b) // 2
            at = order[mid] + depth
            if (reversed_tokens[at] if at < size else SEPARATOR - 1) < token:
                a = mid + 1
            else:
                b = mid
        start, b = a, hi
        while a < b:  # first row whose token at depth is > token
            mid = (a + b) // 2
            at = order[mid] + depth
            if (reversed_tokens[at] if at < size else SEPARATOR - 1) <= token:
                a = mid + 1
            else:
                b = mid
        return start, a

    def starts(self, match: CorpusMatch, voters: int = VOTERS) -> list[int]:
        """Where the continuations of (at most ``voters``, evenly spread) occurrences
        begin in the corpus."""
        rows = range(match.lo, match.hi)
        if len(rows) > voters:
            step = len(rows) / voters
            rows = [match.lo + int(i * step) for i in range(voters)]
        return [self.size - self.order[row] for row in rows]

    def continuations(self, match: CorpusMatch, count: int, limit: int) -> list[list[int]]:
        """Up to ``limit`` distinct continuations of ``count`` tokens (shorter where a
        document ends), the ones most occurrences follow first."""
        tokens, size = self.tokens, self.size
        found: Counter[tuple[int, ...]] = Counter()
        for start in self.starts(match):
            follow = []
            for at in range(start, min(start + count, size)):
                if tokens[at] == SEPARATOR:
                    break
                follow.append(tokens[at])
            if follow:
                found[tuple(follow)] += 1
        return [list(f) for f, _ in found.most_common(limit)]

    def vote(self, match: CorpusMatch, count: int) -> list[int]:
        """The continuation most occurrences agree on, token by token: at each step the
        token most of the occurrences still on the path follow with (ties: the smaller
        id), until ``count`` tokens or every occurrence's document ends."""
        tokens, size = self.tokens, self.size
        at = self.starts(match)
        drafted: list[int] = []
        while at and len(drafted) < count:
            votes = Counter(tokens[i] for i in at if i < size and tokens[i] != SEPARATOR)
            if not votes:
                break
            best = max(votes.items(), key=lambda kv: (kv[1], -kv[0]))[0]
            drafted.append(best)
            at = [i + 1 for i in at if i < size and tokens[i] == best]
        return drafted


def match_class(match: CorpusMatch | None) -> int:
    """A match's length class (0: none or shorter than MIN_MATCH)."""
    if match is None or match.length < MIN_MATCH:
        return 0
    return max(c for c in MATCH_CLASSES if c <= match.length)


class CorpusDrafter:
    """Corpus lookup (point-mass drafts): the continuation that most occurrences of the
    context's longest suffix found in ``index`` agree on (at least ``min_match`` tokens
    matched, at most ``max_match`` compared)."""

    def __init__(
        self,
        index: SuffixIndex,
        name: str = "corpus",
        max_match: int = SORT_DEPTH,
        min_match: int = MIN_MATCH,
    ) -> None:
        if not 1 <= min_match <= max_match <= SORT_DEPTH:
            raise ValueError(
                f"need 1 <= min_match <= max_match <= {SORT_DEPTH}, got {min_match}, {max_match}"
            )
        self.name = name
        self.index = index
        self.max_match = max_match
        self.min_match = min_match
        self._last: tuple[tuple[int, ...], CorpusMatch | None] | None = None  # (key, match)

    @property
    def forward_calls(self) -> int:
        return 0

    def reset(self) -> None:
        self._last = None

    def lookup(self, context: Sequence[int]) -> CorpusMatch | None:
        """The longest match of the context's end (None below ``min_match`` tokens); the
        last answer is kept for the same last ``max_match`` tokens (all it depends on)."""
        key = tuple(int(t) for t in context[-self.max_match :])
        if self._last is None or self._last[0] != key:
            match = self.index.match(key, self.max_match)
            if match is not None and match.length < self.min_match:
                match = None
            self._last = (key, match)
        return self._last[1]

    def propose(
        self,
        context: Sequence[int],
        gamma: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        return Draft(tokens=self.continuation(context, gamma))

    def continuation(self, context: Sequence[int], count: int) -> list[int]:
        """The (at most ``count``) tokens most occurrences of the context's longest match
        continue with; none without a match."""
        match = self.lookup(context)
        return [] if match is None or count < 1 else self.index.vote(match, count)

    def draft_situation(self, context: Sequence[int]) -> int:
        """The length class of the match :meth:`propose` would copy from (0: none)."""
        return match_class(self.lookup(context))

    def propose_tree(
        self,
        context: Sequence[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftTree:
        """A trie of the continuations most occurrences follow (point masses)."""
        match = self.lookup(context)
        if match is None or budget < 1:
            return trie([], budget)
        return trie(self.index.continuations(match, budget, limit=4), budget)

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        pass
