"""Keep a model's cache in step with a growing token sequence.

The engine and the model-based drafters never manage cache positions by hand. A
:class:`ModelSession` remembers which token ids its model's cache holds; asked for the
logits after a sequence, it rolls the cache back to the longest common prefix, feeds
whatever is missing (the *catch-up* after a recovered or bonus token), and returns the
logits of the positions asked for. Rollback after a rejection is therefore implicit.

Invariant used by the engine: to score a sequence ``seq`` the cache is made to hold
``seq[:-1]`` and the last token is fed together with any new (drafted) tokens, so one
call returns ``1 + len(new)`` next-token distributions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speculative.models.base import CausalLM, SupportsCacheImport, SupportsHiddenStates


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[lo:mid]) == list(b[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo


class ModelSession:
    """A model plus the token ids its cache currently holds (batch of one)."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.cached: list[int] = []
        self.forward_calls = 0
        self._features = torch.empty(0)  # [capacity, hidden] features of the cached slots
        self._feature_length = 0  # slots [0, _feature_length) hold valid features
        self._hidden_model = model if isinstance(model, SupportsHiddenStates) else None
        model.reset()

    @property
    def features(self) -> torch.Tensor | None:
        """[n, hidden] the model's features of the first n cached positions (n <=
        len(cached); all of them unless the cache was adopted), or None when the model
        has no :class:`SupportsHiddenStates`."""
        if self._hidden_model is None:
            return None
        return self._features[: min(self._feature_length, len(self.cached))]

    def reset(self) -> None:
        self.model.reset()
        self.cached = []
        self._feature_length = 0

    def sync(self, prefix: Sequence[int]) -> None:
        """Make the cache hold exactly ``prefix`` (rolling back and feeding as needed)."""
        keep = common_prefix_length(self.cached, prefix)
        self._truncate(keep)
        missing = list(prefix[keep:])
        if missing:
            self._feed(missing)

    def adopt(self, other: ModelSession) -> bool:
        """Take over ``other``'s cached tokens by copying its cache (no forward pass), if
        this model can import that model's cache; returns whether it did."""
        model = self.model
        if not other.cached or not isinstance(model, SupportsCacheImport):
            return False
        if not model.import_cache(other.model, len(other.cached)):
            return False
        self.cached = list(other.cached)
        self._feature_length = 0
        return True

    def logits_after(self, context: Sequence[int], new: Sequence[int] = ()) -> torch.Tensor:
        """Next-token logits after ``context[-1]`` and after each token of ``new``.

        returns: [1, 1 + len(new), vocab]; row 0 is the distribution following ``context``,
        row j the one following ``context + new[:j]``.
        """
        if len(context) == 0:
            raise ValueError("context must hold at least one token")
        keep = common_prefix_length(self.cached, context[:-1])
        self._truncate(keep)
        fed = list(context[keep:]) + list(new)
        logits = self._feed(fed)  # [1, len(fed), vocab]
        return logits[:, len(fed) - 1 - len(new) :]

    def _truncate(self, keep: int) -> None:
        drop = len(self.cached) - keep
        if drop:
            self.model.rollback(drop)
            del self.cached[keep:]
            self._feature_length = min(self._feature_length, keep)

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        input_ids = torch.tensor([tokens], dtype=torch.long)  # [1, k]
        if self._hidden_model is not None:
            logits, features = self._hidden_model.forward_with_hidden(input_ids)
            self._store_features(features[0])  # features: [1, k, hidden]
        else:
            logits = self.model.forward(input_ids)  # [1, k, vocab]
        self.cached.extend(tokens)
        self.forward_calls += 1
        return logits

    def _store_features(self, features: torch.Tensor) -> None:
        """features: [k, hidden] of the positions being appended after ``cached``."""
        start, k = len(self.cached), features.shape[0]
        if self._feature_length < start:  # a gap (adopted cache): nothing before is valid
            self._feature_length = 0
            return
        if start + k > self._features.shape[0]:
            capacity = max(2 * self._features.shape[0], start + k, 256)
            grown = torch.empty(capacity, features.shape[1])
            if start:
                grown[:start] = self._features[:start]
            self._features = grown
        self._features[start : start + k] = features
        self._feature_length = start + k
