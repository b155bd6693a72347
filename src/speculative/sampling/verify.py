"""Exact verification of drafted tokens (modified rejection sampling).

For each drafted token x at position j: accept with probability min(1, p(x)/q(x)).
At the first rejection emit a *recovered* token from normalize(max(0, p - q)) and stop;
if all γ are accepted emit a *bonus* token from the target's distribution after them.
The emitted tokens are then distributed exactly as the target's own samples.

Point-mass drafters (n-gram lookup) pass ``draft_probs=None``: q is one-hot at the
drafted token, so acceptance is p(x) and the residual is p with x removed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from speculative.sampling.params import SamplingParams
from speculative.sampling.probs import (
    NucleusSearch,
    RowProbs,
    check_probs,
    float32,
    row_probs,
    sample_from,
)


class VerifyResult:
    """Outcome of verifying one block for each batch row.

    num_accepted: [batch] number of drafted tokens accepted (0..γ).
    tokens:       [batch, γ+1] emitted tokens, the accepted ones followed by the recovered
                  or bonus token; entries past num_accepted + 1 are -1.

    A one-row result of the engine's fast paths (:meth:`of_row`) keeps its emitted tokens
    as a list and makes the tensors only when asked: the engine reads the list, and right
    after a forward each torch call costs tens of µs.
    """

    def __init__(self, num_accepted: torch.Tensor, tokens: torch.Tensor) -> None:
        self._num_accepted: torch.Tensor | None = num_accepted  # [batch]
        self._tokens: torch.Tensor | None = tokens  # [batch, gamma + 1]
        self._row: list[int] | None = None  # row 0's emitted tokens (one-row results)
        self._gamma = tokens.shape[-1] - 1

    @classmethod
    def of_row(cls, emitted: list[int], gamma: int) -> VerifyResult:
        """One row's result: ``emitted`` = its accepted drafts, then the extra token."""
        if not 1 <= len(emitted) <= gamma + 1:
            raise ValueError(f"a row of γ = {gamma} emits 1..{gamma + 1} tokens, not {emitted}")
        result = cls.__new__(cls)
        result._num_accepted = result._tokens = None
        result._row, result._gamma = list(emitted), gamma
        return result

    @property
    def num_accepted(self) -> torch.Tensor:  # [batch]
        if self._num_accepted is None:
            assert self._row is not None
            self._num_accepted = torch.tensor([len(self._row) - 1])
        return self._num_accepted

    @property
    def tokens(self) -> torch.Tensor:  # [batch, gamma + 1]
        if self._tokens is None:
            assert self._row is not None
            self._tokens = torch.tensor([self._row + [-1] * (self._gamma + 1 - len(self._row))])
        return self._tokens

    def emitted(self, row: int = 0) -> list[int]:
        """The tokens emitted for one batch row (accepted + recovered/bonus)."""
        if self._row is not None and row == 0:
            return list(self._row)
        n = int(self.num_accepted[row])
        return self.tokens[row, : n + 1].tolist()

    def accepted_count(self, row: int = 0) -> int:
        """How many of one row's drafted tokens were accepted."""
        if self._row is not None and row == 0:
            return len(self._row) - 1
        return int(self.num_accepted[row])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Unnormalized residual max(0, p - q).   p, q: [..., vocab] -> [..., vocab]."""
    return torch.clamp(p - q, min=0.0)


def one_hot_draft_probs(draft_tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Point-mass q for drafted tokens.   draft_tokens: [batch, γ] -> [batch, γ, vocab]."""
    q = torch.zeros(*draft_tokens.shape, vocab, dtype=torch.float32)
    return q.scatter_(-1, draft_tokens.unsqueeze(-1), 1.0)


def check_block_shapes(
    draft_tokens: torch.Tensor,  # [batch, gamma]
    draft_probs: torch.Tensor | None,  # [batch, gamma, vocab]
    target_probs: torch.Tensor,  # [batch, gamma + 1, vocab]
) -> None:
    """Raise ValueError when the block's tensors do not fit together."""
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [batch, gamma], got {tuple(draft_tokens.shape)}")
    batch, gamma = draft_tokens.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (batch, gamma + 1):
        raise ValueError(
            f"target_probs must be [batch={batch}, gamma+1={gamma + 1}, vocab], "
            f"got {tuple(target_probs.shape)}"
        )
    vocab = target_probs.shape[-1]
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, gamma, vocab):
        raise ValueError(
            f"draft_probs must be [batch={batch}, gamma={gamma}, vocab={vocab}] to match "
            f"target_probs, got {tuple(draft_probs.shape)}"
        )
    if draft_tokens.numel() and (draft_tokens.min() < 0 or draft_tokens.max() >= vocab):
        raise ValueError(f"draft_tokens must be token ids in [0, {vocab})")


def verify_from_uniforms(
    draft_tokens: torch.Tensor,  # [batch, gamma]
    draft_probs: torch.Tensor | None,  # [batch, gamma, vocab] or None (point mass)
    target_probs: torch.Tensor,  # [batch, gamma + 1, vocab]
    accept_uniforms: torch.Tensor,  # [batch, gamma] in [0, 1)
    sample_uniforms: torch.Tensor,  # [batch] in [0, 1)
) -> VerifyResult:
    """Block verification driven by explicit uniforms (deterministic given them)."""
    batch, gamma = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if draft_probs is None:
        draft_probs = one_hot_draft_probs(draft_tokens, vocab)
    index = draft_tokens.unsqueeze(-1)  # [batch, gamma, 1]
    p_drafted = target_probs[:, :gamma].gather(-1, index).squeeze(-1)  # [batch, gamma]
    q_drafted = draft_probs.gather(-1, index).squeeze(-1)  # [batch, gamma]
    # u < min(1, p/q)  <=>  u * q < p  (no division; q = 0 with p > 0 always accepts)
    accepted = accept_uniforms * q_drafted < p_drafted  # [batch, gamma]
    num_accepted = accepted.int().cumprod(dim=-1).sum(dim=-1)  # [batch]

    # The extra token's distribution: residual at the first rejection, or the target's
    # distribution after the block (a zero q row makes the bonus the same formula).
    q_padded = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, vocab)], dim=1)
    rows = torch.arange(batch)
    p_next = target_probs[rows, num_accepted]  # [batch, vocab]
    weights = residual(p_next, q_padded[rows, num_accepted])  # [batch, vocab]
    # p == q up to rounding leaves no residual mass; a rejection there has probability ~0,
    # and sampling from p is the continuous limit of the residual rule.
    empty = weights.sum(dim=-1, keepdim=True) <= 1e-12  # [batch, 1]
    weights = torch.where(empty, p_next, weights)
    extra = sample_from(weights, sample_uniforms)  # [batch]

    tokens = torch.full((batch, gamma + 1), -1, dtype=torch.long)
    positions = torch.arange(gamma + 1).unsqueeze(0)  # [1, gamma + 1]
    keep = positions < num_accepted.unsqueeze(-1)  # [batch, gamma + 1]
    padded_draft = torch.cat([draft_tokens, tokens[:, :1]], dim=1)  # [batch, gamma + 1]
    tokens = torch.where(keep, padded_draft, tokens)
    tokens[rows, num_accepted] = extra
    return VerifyResult(num_accepted=num_accepted, tokens=tokens)


def verify(
    draft_tokens: torch.Tensor,  # [batch, gamma]
    draft_probs: torch.Tensor | None,  # [batch, gamma, vocab] or None (point mass)
    target_probs: torch.Tensor,  # [batch, gamma + 1, vocab]
    generator: torch.Generator,
    validate: bool = True,
) -> VerifyResult:
    """Verify a drafted block against the target; randomness only from ``generator``."""
    check_block_shapes(draft_tokens, draft_probs, target_probs)
    if validate:
        check_probs(target_probs, "target_probs")
        if draft_probs is not None:
            check_probs(draft_probs, "draft_probs")
    batch, gamma = draft_tokens.shape
    accept_uniforms = torch.rand(batch, gamma, generator=generator, dtype=torch.float32)
    sample_uniforms = torch.rand(batch, generator=generator, dtype=torch.float64)
    return verify_from_uniforms(
        draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms
    )


def verify_greedy(
    draft_tokens: torch.Tensor,  # [batch, gamma]
    target_logits: torch.Tensor,  # [batch, gamma + 1, vocab] (logits or probabilities)
    best: np.ndarray | None = None,  # [batch, gamma + 1] their argmax, if already taken
) -> VerifyResult:
    """Temperature-0 verification: keep drafted tokens while they equal the argmax.

    The argmax runs in numpy (the first maximal index, as torch's; several times faster
    over a 49k vocabulary), unless ``best`` gives it (the target's forward took it while
    computing the rows), and the prefix logic on the few resulting ids."""
    if draft_tokens.dim() != 2 or target_logits.shape[:2] != (
        draft_tokens.shape[0],
        draft_tokens.shape[1] + 1,
    ):
        raise ValueError(
            f"target_logits must be [batch, gamma+1, vocab] for draft_tokens "
            f"{tuple(draft_tokens.shape)}, got {tuple(target_logits.shape)}"
        )
    gamma = draft_tokens.shape[1]
    if best is None:
        best_ids = target_logits.detach().cpu().numpy().argmax(axis=-1)  # [batch, gamma + 1]
    else:
        best_ids = best
        if best_ids.shape != tuple(target_logits.shape[:2]):
            raise ValueError(
                f"best must be [batch, gamma+1] = {tuple(target_logits.shape[:2])}, "
                f"got {best_ids.shape}"
            )
    matches = draft_tokens.numpy() == best_ids[:, :gamma]  # [batch, gamma]
    num_accepted = np.cumprod(matches, axis=-1).sum(axis=-1)  # [batch]
    positions = np.arange(gamma + 1)[None, :]
    tokens = np.where(positions <= num_accepted[:, None], best_ids, -1)
    return VerifyResult(
        num_accepted=torch.from_numpy(num_accepted.astype(np.int64)),
        tokens=torch.from_numpy(tokens.astype(np.int64)),
    )


def verify_greedy_row(drafted: list[int], best: list[int]) -> VerifyResult:
    """:func:`verify_greedy` for one row whose argmax ids ``best`` ([γ + 1]) are at hand,
    in plain Python: the drafts kept while they equal the argmax, then the argmax."""
    if len(best) != len(drafted) + 1:
        raise ValueError(f"best must hold γ + 1 = {len(drafted) + 1} ids, got {len(best)}")
    n = 0
    while n < len(drafted) and drafted[n] == best[n]:
        n += 1
    return VerifyResult.of_row(best[: n + 1], len(drafted))


@dataclass(frozen=True)
class VerifyUniforms:
    """The uniforms :func:`verify_logits` draws for one row, in its order: γ float32 accept
    uniforms (as Python floats), then one float64 for the recovered or bonus draw. A
    caller may draw them ahead (:meth:`draw`) right after its drafter's own draws from the
    same generator, where the generator's code is still warm: the same values, since
    nothing draws in between."""

    accepts: list[float]  # [γ]
    sample: float

    @classmethod
    def draw(cls, gamma: int, generator: torch.Generator) -> VerifyUniforms:
        accepts = _accept_uniforms(gamma, generator)
        return cls(accepts, torch.rand(1, generator=generator, dtype=torch.float64).item())


def verify_logits(
    draft_tokens: list[int],
    # [1, gamma, vocab], or gamma sparse rows of the same q, or None (point mass)
    draft_probs: torch.Tensor | Sequence[RowProbs] | None,
    logits: torch.Tensor,  # [1, gamma + 1, vocab] target logits
    params: SamplingParams,
    generator: torch.Generator,
    search: NucleusSearch | None = None,
    uniforms: VerifyUniforms | None = None,
) -> VerifyResult:
    """``verify(tokens, draft_probs, logits_to_probs(logits, params), generator)`` for one
    sequence, bit for bit, doing less: it draws the same uniforms, processes the target's
    rows only up to the first rejection (the rows after it are never read), one row at a
    time and sparse where top-p cuts a nucleus (:class:`RowProbs`: p(x), the residual and
    the recovered or bonus draw read the nucleus's entries only; ``search``, where the
    runtime offers one, finds the nucleus: see :func:`row_probs`). ``draft_probs`` may
    also be the γ rows of q kept sparse (a head's top-p rows, ``Draft.rows``).
    ``uniforms``: the ones it would draw from ``generator``, drawn ahead."""
    gamma = len(draft_tokens)
    if logits.dim() != 3 or logits.shape[:2] != (1, gamma + 1):
        raise ValueError(f"logits must be [1, {gamma + 1}, vocab], got {tuple(logits.shape)}")
    q_rows = _q_rows(draft_probs, gamma, logits.shape[-1])
    drawn = VerifyUniforms.draw(gamma, generator) if uniforms is None else uniforms
    if len(drawn.accepts) != gamma:
        raise ValueError(f"{len(drawn.accepts)} accept uniforms for {gamma} drafted tokens")
    accepts, sample_uniform = drawn.accepts, drawn.sample  # [gamma] float32 values, float64
    rows = logits[0]  # [gamma + 1, vocab]
    for j, token in enumerate(draft_tokens):
        p = row_probs(rows[j], params, search)  # row j's processed distribution
        q = None if q_rows is None else q_rows[j]  # [vocab] or its sparse row
        q_token = 1.0 if q is None else _q_of(q, token)
        if float32(accepts[j] * q_token) < p.prob(token):  # float32, as the batched test
            continue
        weights = p.residual(token, q)
        # p == q up to rounding leaves no residual mass: sample from p, as verify does
        recovered = p if weights.mass() <= 1e-12 else weights
        return _emit(draft_tokens[:j], recovered, sample_uniform, gamma)
    p = row_probs(rows[gamma], params, search)  # the bonus token's distribution
    return _emit(list(draft_tokens), p, sample_uniform, gamma)


def _q_rows(
    draft_probs: torch.Tensor | Sequence[RowProbs] | None, gamma: int, vocab: int
) -> np.ndarray | Sequence[RowProbs] | None:
    """verify_logits's q rows: [gamma, vocab] numpy from a dense tensor, the sparse rows
    as they are, None for a point mass."""
    if draft_probs is None:
        return None
    if isinstance(draft_probs, torch.Tensor):
        if tuple(draft_probs.shape) != (1, gamma, vocab):
            raise ValueError(
                f"draft_probs must be [1, {gamma}, vocab], got {tuple(draft_probs.shape)}"
            )
        return draft_probs.detach().numpy()[0]  # [gamma, vocab]
    if len(draft_probs) != gamma:
        raise ValueError(f"{len(draft_probs)} sparse q rows for {gamma} drafted tokens")
    return draft_probs


def _q_of(q: np.ndarray | RowProbs, token: int) -> float:
    """q(token) from a dense row or a sparse one (the same float32 value)."""
    return q.prob(token) if isinstance(q, RowProbs) else float(q[token])


def _accept_uniforms(gamma: int, generator: torch.Generator) -> list[float]:
    """verify's [1, gamma] float32 accept uniforms for one row (the same values as a flat
    draw of γ), as Python floats; none drawn for γ = 0 (an empty draw leaves the generator
    as it was)."""
    if gamma == 0:
        return []
    return torch.rand(gamma, generator=generator, dtype=torch.float32).tolist()


def _emit(accepted: list[int], weights: RowProbs, uniform: float, gamma: int) -> VerifyResult:
    """The accepted tokens plus one drawn from ``weights``, as a VerifyResult."""
    return VerifyResult.of_row([*accepted, weights.draw(uniform)], gamma)


def check_distribution(p: np.ndarray, name: str) -> np.ndarray:
    """Validate a 1-D numpy distribution and return it as float64."""
    arr = np.asarray(p, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D distribution, got shape {arr.shape}")
    check_probs(torch.from_numpy(arr), name)
    return arr


def speculative_step(p: np.ndarray, q: np.ndarray, rng: np.random.Generator) -> tuple[int, bool]:
    """One token from target ``p`` using draft ``q``: the specification's primitive.

    p, q: [vocab] distributions. Returns (token, accepted): the drafted token if accepted,
    else a recovered token from normalize(max(0, p - q)).
    """
    p = check_distribution(p, "p")
    q = check_distribution(q, "q")
    if p.shape != q.shape:
        raise ValueError(f"p and q have different vocabulary sizes ({p.size} vs {q.size})")
    x = int(rng.choice(q.size, p=q / q.sum()))
    if rng.random() * q[x] < p[x]:
        return x, True
    leftover = np.maximum(p - q, 0.0)
    if leftover.sum() <= 1e-12:  # p == q up to rounding: rejection had probability ~0
        leftover = p
    return int(rng.choice(p.size, p=leftover / leftover.sum())), False
