"""What the head drafters share: a base class (a trained head bound to a target's
session), processed draft distributions over a reduced vocabulary, draws without
replacement, and reading the target's features from its session."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from speculative.heads.store import TrainedHead
from speculative.models.base import SupportsKernels, SupportsNucleusSearch
from speculative.models.session import FeatureSource, RowSession, common_prefix_length
from speculative.sampling import SamplingParams, logits_to_probs, sample
from speculative.sampling.probs import NucleusSearch, RowProbs, row_probs


class HeadDrafter:
    """A drafter reading the target's features through a trained head: the constructor,
    priming and bookkeeping EAGLE and Medusa share."""

    method = ""  # the head method this drafter runs ("eagle", "medusa")

    def __init__(
        self,
        head: TrainedHead,
        vocab_size: int,
        name: str,
        search: NucleusSearch | None = None,
    ) -> None:
        if head.config.method != self.method:
            raise ValueError(f"{name} needs {self.method} heads, got {head.config.method}")
        self.name = name
        self.head = head
        self.vocab_size = vocab_size
        self.search = search  # the target's top-p search, for the head's rows too
        self.target: FeatureSource | None = None
        self._calls = 0
        self._target_ids = head.draft_to_target.numpy().astype(np.int64)  # [N] draft -> target
        self._target_list: list[int] = self._target_ids.tolist()  # the same, as Python ints
        self._arange = torch.arange(0)  # see positions

    @property
    def forward_calls(self) -> int:
        return self._calls

    def reset(self) -> None:
        """Nothing per sequence by default."""

    def prime(self, target: RowSession) -> None:
        """Read the target's features from its session from now on."""
        self.read_features(target)

    def read_features(self, source: FeatureSource) -> None:
        """Read the target's features from ``source`` (a row's session) from now on."""
        self.target = source

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        """Nothing: the next proposal reads the target's session."""

    def full_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., N] draft-vocabulary probabilities -> [..., vocab] (q of the accept test)."""
        return to_full_vocab(probs, self.head.draft_to_target, self.vocab_size)

    def target_row(self, row: RowProbs) -> RowProbs:
        """A processed row over the N draft-vocabulary indices -> the same q over target
        token ids (sparse: the tokens outside the draft vocabulary have q 0), as
        :meth:`full_vocab` gives it densely."""
        return row.on_ids(self._target_ids, self._target_list)

    def target_token(self, index: int) -> int:
        return self._target_list[index]

    def positions(self, start: int, count: int) -> torch.Tensor:
        """[count] int64 positions start .. start + count - 1: a view of a kept range
        (one torch call where arange is two; each costs tens of µs right after a pass)."""
        if self._arange.numel() < start + count:
            self._arange = torch.arange(max(2 * self._arange.numel(), start + count))
        return self._arange[start : start + count]


def target_kernels(lm: object) -> object | None:
    """The C kernel library running ``lm``'s layers, when it runs on them (heads then run
    their steps on the same kernels), else None."""
    return lm.kernel_library() if isinstance(lm, SupportsKernels) else None


def nucleus_search(lm: object) -> NucleusSearch | None:
    """The target's top-p search where it has one (``SupportsNucleusSearch``: a pure
    function of a logits row, so it serves the head's draft-vocabulary rows too)."""
    return lm.nucleus if isinstance(lm, SupportsNucleusSearch) else None


def embedding_rows(embedding: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
    """[len(tokens), H] rows of ``embedding`` [vocab, H]: a view for one token (a draft
    step's), a gathered copy for several."""
    if len(tokens) == 1:
        token = tokens[0]
        return embedding[token : token + 1]
    return embedding[torch.tensor(list(tokens), dtype=torch.long)]


def draft_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., N] draft logits over the draft vocabulary -> [..., N] processed probabilities
    (temperature / top-k / top-p as the target's; tokens outside the vocabulary have q 0)."""
    return logits_to_probs(logits, params)


def to_full_vocab(probs: torch.Tensor, draft_to_target: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..., N] -> [..., vocab] with zeros outside the draft vocabulary."""
    full = probs.new_zeros(*probs.shape[:-1], vocab)
    index = draft_to_target.expand(*probs.shape[:-1], -1)
    return full.scatter_(-1, index, probs)


def draw_from_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    search: NucleusSearch | None = None,
) -> tuple[int, RowProbs | None]:
    """One draft-vocabulary index from [N] draft logits and the processed row it was
    drawn from (over the N draft-vocabulary indices; None when greedy: the first argmax,
    taken straight from the logits in numpy, is what the one-hot distribution's argmax
    would give). Sampling goes through the sparse row (``row_probs``, found by ``search``
    where it answers): the same probs and the same draw as
    ``draw(draft_distribution(...))``, bit for bit, with the same uniform from
    ``generator``."""
    if params.greedy:
        return int(logits.detach().numpy().argmax()), None
    row = row_probs(logits, params, search)  # [N], sparse where top-p cuts
    uniform = torch.rand(1, generator=generator, dtype=torch.float64).item()  # sample()'s
    return row.draw(uniform), row


def draw(probs: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One draft-vocabulary index from [N] processed probs (argmax when greedy)."""
    if params.greedy:
        return int(probs.argmax())
    return int(sample(probs.unsqueeze(0), generator)[0])


def draw_without_replacement(
    probs: torch.Tensor, count: int, params: SamplingParams, generator: torch.Generator
) -> torch.Tensor:
    """Up to ``count`` distinct indices of [N] probs in draw order: the top ``count`` by
    greedy probability, or by Gumbel-top-k (the same law as sequential draws without
    replacement) using ``generator``. Never returns a zero-probability index."""
    values = probs.detach().numpy()  # [N]
    support = np.flatnonzero(values > 0)  # [m] increasing indices
    count = min(count, support.size)
    if count <= 0:
        return torch.empty(0, dtype=torch.long)
    if params.greedy:
        return torch.topk(probs, count).indices
    # one uniform per entry, as many as the row has (the generator advances the same
    # whatever the support); keys log p + Gumbel on the support alone, in numpy
    uniform = torch.rand(probs.shape, generator=generator, dtype=torch.float64).numpy()
    gumbel = -np.log(-np.log(np.maximum(uniform[support], 1e-300)))  # [m]
    keys = np.log(values[support].astype(np.float64)) + gumbel  # [m]
    order = np.argsort(-keys, kind="stable")[:count]  # largest key first
    return torch.from_numpy(support[order])


def true_feature_count(target: FeatureSource | None, context: Sequence[int]) -> int:
    """How many leading positions of ``context`` have the target's features at hand."""
    if target is None:
        return 0
    count = target.feature_count
    return common_prefix_length(target.cached[:count], context) if count else 0
