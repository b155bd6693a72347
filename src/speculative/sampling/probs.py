"""Logits to probabilities, sampling, and distribution checks.

The same processing (temperature, top-k, top-p) is applied to target and draft logits,
and the processed distributions are the ones that enter the accept test.
"""

from __future__ import annotations

import bisect
import math
import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from speculative.sampling.params import SamplingParams

PROB_TOLERANCE = 1e-4  # how far a distribution's sum may stray from 1
NUCLEUS_CUTOFF_STEP = 64.0  # the nucleus search lowers its probability cutoff by this
SPARSE_SAMPLE_LIMIT = 4096  # dense rows longer than this draw by the full cumsum
SMALL_DRAW = 64  # entries up to which a draw runs in plain Python (no numpy call)
# Nuclei up to this size are renormalized with libm's exp and an in-order float64 sum, which
# compiled code reproduces bit for bit (numpy's exp is its own SIMD code on AVX-512 CPUs);
# larger ones in numpy. The native kernels' NUCLEUS_MAX.
EXACT_RENORMALIZE_LIMIT = 4096
SMALL_NUCLEI_ROWS = 4  # short rows from which a nucleus takes whole-array steps
TOP_K_DEPTH = 8.0  # the top-k search first looks this far (in tempered logits) below the top
# Rows of up to this many tokens take a top-k cut as the masked softmax over the whole row
# (one vectorized call for all rows); longer ones renormalize over the kept tokens alone.
SMALL_TOP_K_ROW = 1024


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed next-token distribution(s).

    logits: [..., vocab] raw logits.
    returns: [..., vocab] float32 probabilities. Temperature 0 returns the one-hot argmax.
    """
    logits = logits.float()
    if params.greedy:
        return one_hot_argmax(logits)
    if _sparse_top_k(params, logits.shape[-1]):
        return _top_k_probs(logits, params)
    logits = tempered(logits, params)
    if params.top_p < 1:
        return nucleus_probs(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def tempered(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., vocab] float32 logits divided by the temperature, -inf below the top k: the
    steps before the softmax (and the nucleus), shared by the dense and the sparse rows so
    that both see the same bits."""
    logits = logits / params.temperature
    logits = mask_top_k(logits, params.top_k) if params.top_k else logits
    return mask_min_p(logits, params.min_p) if params.min_p else logits


def _top_k_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., vocab] float32 raw logits, a top-k cut (and maybe top-p) -> [..., vocab]
    float32: each row :func:`_top_k_row`'s, scattered into zeros (a row's bits depend on
    that row only, so the sparse row that verification reads is the same)."""
    scaled = logits / params.temperature  # [..., vocab], the bits tempered() divides to
    rows = _as_numpy(scaled).reshape(-1, logits.shape[-1])  # [rows, vocab]
    return _stacked([_top_k_row(row, params) for row in rows], logits.shape)


def _stacked(rows: list[RowProbs], shape: torch.Size) -> torch.Tensor:
    """Rows (sparse or dense) as one [..., vocab] float32 tensor of ``shape``, zeros
    outside each row's support."""
    out = np.zeros((len(rows), shape[-1]), dtype=np.float32)  # [rows, vocab]
    for index, row in enumerate(rows):
        if row.support is None:
            out[index] = row.values
        else:
            out[index, row.support] = row.values
    return torch.from_numpy(out).reshape(shape)


def _top_k_row(row: np.ndarray, params: SamplingParams) -> RowProbs:
    """One row's distribution under a top-k cut: the tokens :func:`mask_top_k` keeps (every
    one at or above the k-th largest tempered logit), then, with top_p < 1, their top-p
    nucleus (cut on the float64 softmax over them), renormalized as :func:`_renormalized`
    does: the softmax of the masked row, summed over the tens of kept entries instead of a
    49k-entry softmax. row: [vocab] float32 tempered logits. A row with a NaN or +inf
    takes the masked softmax itself (whose NaNs the checks downstream report)."""
    kept = top_k_ids(row, params.top_k)  # [n] increasing token ids
    if kept is None:
        masked = mask_top_k(torch.from_numpy(row), params.top_k)
        return _processed_row(mask_min_p(masked, params.min_p) if params.min_p else masked, params)
    if params.min_p:  # the top-k keeps the largest: the same threshold as the whole row's
        kept = kept[row[kept] >= min_p_threshold(row[kept].max(), params.min_p)]
    if params.top_p < 1:
        masses = _as_numpy(cut_probs(torch.from_numpy(row[kept])))  # [n] float64
        kept = kept[_row_nucleus(masses, params.top_p).kept]
    return _renormalized(row[kept], kept)


def top_k_ids(row: np.ndarray, k: int) -> np.ndarray | None:
    """[vocab] tempered logits -> the increasing ids of the tokens :func:`mask_top_k`
    keeps: every one at or above the k-th largest value, ties included (all of them when
    fewer than k are above -inf). Found among the tokens near the top (TOP_K_DEPTH below
    it, twice as far each time that holds fewer than k) by a partition of those alone,
    instead of a top-k over the whole row. None for a row with a NaN or +inf."""
    if k >= row.size:
        return np.arange(row.size)
    top = float(row.max())
    if not math.isfinite(top):
        return None
    depth = TOP_K_DEPTH
    while True:
        ids = np.flatnonzero(row >= top - depth)  # [m] increasing
        if ids.size >= k:
            values = row[ids]
            kth = np.partition(values, values.size - k)[values.size - k]
            return ids[values >= kth]
        if depth == TOP_K_DEPTH and np.count_nonzero(row > -np.inf) < k:
            return np.arange(row.size)  # the k-th largest is -inf: nothing is masked
        depth *= 2


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits: [..., vocab] -> [..., vocab] one-hot at the (first) argmax."""
    out = torch.zeros_like(logits, dtype=torch.float32)
    return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def mask_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits: [..., vocab]; tokens below the k-th largest logit get -inf."""
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def min_p_threshold(top: float | np.floating, min_p: float) -> np.float32:
    """The smallest tempered logit min_p keeps in a row whose largest is ``top``: top +
    ln(min_p), in float32 (both the dense and the sparse rows compare against these bits)."""
    return np.float32(top) + np.float32(math.log(min_p))


def mask_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """logits: [..., vocab] tempered; tokens below the largest + ln(min_p) (less than min_p
    times as likely as the likeliest) get -inf. A row with a NaN keeps its NaNs for the
    checks downstream."""
    top = logits.max(dim=-1, keepdim=True).values  # [..., 1]
    threshold = top + torch.tensor(math.log(min_p), dtype=torch.float32)  # float32 + float32
    return logits.masked_fill(logits < threshold, float("-inf"))


def mask_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits: [..., vocab]; tokens outside the top-p nucleus get -inf.

    The nucleus is the smallest set of most probable tokens whose mass reaches ``top_p``,
    widened to every token as probable as its least probable member (ties at the cut are
    all kept, so the set depends on the values only, never on a sort order). The masses
    are float64: a float32 softmax over 49k entries strays up to 3e-5 from the true mass,
    which would move the cut wherever top_p falls that close to it.
    """
    probs = cut_probs(logits)  # [..., vocab] float64
    threshold = nucleus_threshold(probs, top_p)  # [..., 1]
    # the bits of masked_fill(probs < threshold, -inf), built in numpy from the (usually
    # few) kept entries: a few times faster
    values = _as_numpy(logits).reshape(-1, logits.shape[-1])  # [rows, vocab]
    probs_rows = _as_numpy(probs).reshape(values.shape)
    masked = np.full(values.shape, -np.inf, dtype=values.dtype)
    for row, (p, cut) in enumerate(zip(probs_rows, threshold.numpy().reshape(-1), strict=True)):
        kept = np.flatnonzero(p >= cut)
        masked[row, kept] = values[row, kept]
    return torch.from_numpy(masked).reshape(logits.shape)


def nucleus_probs(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The softmax of ``logits`` restricted to its top-p nucleus and renormalized: the
    distribution that ``softmax(mask_top_p(logits, top_p))`` defines, with less work.

    logits: [..., vocab] (already divided by the temperature; -inf where masked).
    returns: [..., vocab] float32, zero outside the nucleus.

    Each row is :func:`nucleus_row`'s, scattered into zeros, so a row's values depend on
    that row only: a row gives the same bits in a block of rows as alone, and as the
    sparse row that verification reads.
    """
    probs = cut_probs(logits)  # [..., vocab] float64: the nucleus is cut on these
    values = _as_numpy(logits).reshape(-1, logits.shape[-1])  # [rows, vocab]
    probs_rows = _as_numpy(probs).reshape(values.shape)
    if _whole_array_rows(values) and np.isfinite(probs_rows).all():
        return torch.from_numpy(_small_nuclei(values, probs_rows, top_p)).reshape(logits.shape)
    nuclei = [_renormalized_nucleus(v, p, top_p) for v, p in zip(values, probs_rows, strict=True)]
    return _stacked(nuclei, logits.shape)


def _whole_array_rows(values: np.ndarray) -> bool:
    """Whether [rows, vocab] rows take :func:`_small_nuclei`: short rows, enough of them
    to pay for its dozen whole-array calls (about 3 rows' worth of per-row calls)."""
    return values.shape[-1] <= SMALL_DRAW and values.shape[0] >= SMALL_NUCLEI_ROWS


def _small_nuclei(values: np.ndarray, probs: np.ndarray, top_p: float) -> np.ndarray:
    """Every short row's :func:`_renormalized_nucleus`, bit for bit, in whole-array numpy
    steps (a small vocabulary, where per-row calls cost more than the arithmetic).

    values: [rows, vocab] float32 tempered logits; probs: [rows, vocab] float64 their
    softmax, all finite. returns: [rows, vocab] float32, zero outside each nucleus.

    The same numbers in the same order: the descending values' in-order float64 running
    sum (``np.cumsum`` along a row adds one after another, as the scalar loop does), the
    same count of members before the mass reaches top_p, libm's exp of each member's
    logit minus the members' largest, and their sum in id order (a running float64 sum is
    unchanged by the zeros between them), each weight divided by it and rounded to float32.
    """
    rows = np.arange(values.shape[0])
    ordered = np.sort(probs, axis=1)[:, ::-1]  # [rows, vocab] descending
    mass = np.cumsum(ordered[:, :-1], axis=1)  # [rows, vocab - 1] mass up to each
    kept = 1 + np.count_nonzero(mass < top_p, axis=1)  # [rows] members
    threshold = ordered[rows, kept - 1]  # [rows] the least probable member's probability
    member = probs >= threshold[:, None]  # [rows, vocab]
    top = np.where(member, values, -np.inf).max(axis=1)  # [rows] float32
    at_row, at_id = np.nonzero(member)  # row by row, ids increasing
    shifted = values[at_row, at_id].astype(np.float64) - top[at_row].astype(np.float64)
    weights = np.zeros(values.shape, dtype=np.float64)  # [rows, vocab]
    weights[at_row, at_id] = [math.exp(x) for x in shifted.tolist()]
    total = np.cumsum(weights, axis=1)[:, -1]  # [rows] in id order
    return (weights / total[:, None]).astype(np.float32)


_FLOAT32 = struct.Struct("f")


def float32(x: float) -> float:
    """``x`` rounded to the nearest float32 (ties to even), as a Python float. A sum,
    difference or product of two float32 values taken in float64 and rounded once is
    numpy's float32 result (53 >= 2 * 24 + 2 bits: the double rounding is innocuous)."""
    return _FLOAT32.unpack(_FLOAT32.pack(x))[0]


class RowProbs:
    """One processed next-token distribution, kept as the entries that may be nonzero:
    token ``support[i]`` has probability ``values[i]`` (ids increasing), every other
    token zero; ``support`` None means every token (a dense row). A top-p nucleus is tens
    of entries where the dense row has 49k, so whatever reads it reads tens: the accept
    test's p(x), the residual max(0, p - q) (zero wherever p is) and the inverse-CDF draw,
    each giving the bits it gives on the dense row.

    A small row (at most ``SMALL_DRAW`` entries) is also held as Python lists, and read,
    drawn from and subtracted in plain Python with numpy's float32 bits: right after a
    forward each first numpy call costs tens of µs on cold caches, more than the
    arithmetic. Rows built from lists (:meth:`of_lists`, as the kernels' top-p search
    returns them) make their numpy arrays only when something asks for them."""

    __slots__ = ("_support", "_support_list", "_value_list", "_values")

    def __init__(self, values: np.ndarray, support: np.ndarray | None = None) -> None:
        self._values: np.ndarray | None = values  # [n] float32 (float64: a tree verifier's
        # residual rows)
        self._support = support  # [n] int64 increasing token ids; None: all
        self._value_list: list[float] | None = None
        self._support_list: list[int] | None = None

    @classmethod
    def of_lists(cls, values: list[float], support: list[int]) -> RowProbs:
        """A sparse float32 row from Python lists: ``values`` exactly float32 values,
        ``support`` increasing token ids."""
        row = cls.__new__(cls)
        row._values = row._support = None
        row._value_list, row._support_list = values, support
        return row

    @property
    def values(self) -> np.ndarray:
        """[n] the probabilities (float32; float64 for a tree verifier's residual rows)."""
        if self._values is None:
            self._values = np.array(self._value_list, dtype=np.float32)
        return self._values

    @property
    def support(self) -> np.ndarray | None:
        """[n] int64 increasing token ids; None: every token."""
        if self._support is None and self._support_list is not None:
            self._support = np.array(self._support_list, dtype=np.int64)
        return self._support

    def __len__(self) -> int:
        return len(self._value_list) if self._value_list is not None else self.values.size

    def __repr__(self) -> str:
        return f"RowProbs(values={self.values!r}, support={self.support!r})"

    def _lists(self) -> tuple[list[float], list[int] | None] | None:
        """(values, support ids or None) as Python lists for a small row or one built from
        lists, else None."""
        if self._value_list is None:
            if self.values.size > SMALL_DRAW:
                return None
            self._value_list = self.values.tolist()
            if self._support is not None:
                self._support_list = self._support.tolist()
        return self._value_list, self._support_list

    def _float32(self) -> bool:
        return self._values is None or self._values.dtype == np.float32

    @staticmethod
    def _float32_operand(q: np.ndarray | RowProbs | None) -> bool:
        """Whether a residual's q is float32 (None, a point mass, counts as such)."""
        if q is None:
            return True
        return q._float32() if isinstance(q, RowProbs) else q.dtype == np.float32

    def prob(self, token: int) -> float:
        """p(token), exactly the row's value (a float32 one for a float32 row)."""
        index = self._index(token)
        if index is None:
            return 0.0
        small = self._lists()
        return small[0][index] if small is not None else float(self.values[index])

    def residual(self, token: int, q: np.ndarray | RowProbs | None) -> RowProbs:
        """The unnormalized residual max(0, p - q); q: [vocab] float32 or a sparse row of
        the same q (the same values at every token), or None for a point mass at
        ``token`` (p with that token removed)."""
        small = self._lists() if self._float32() and self._float32_operand(q) else None
        if small is not None and small[1] is not None:
            return self._small_residual(small[0], small[1], token, q)
        if q is None:
            values = self.values.copy()
            index = self._index(token)
            if index is not None:
                values[index] = 0.0
            return RowProbs(values, self.support)
        if isinstance(q, RowProbs):  # [n]
            dense = self.support is None
            q_here = q.dense(self.values.size).numpy() if dense else q.at(self.support)
        else:
            q_here = q if self.support is None else q[self.support]  # [n]
        return RowProbs(np.maximum(self.values - q_here, np.float32(0.0)), self.support)

    def _small_residual(
        self, values: list[float], ids: list[int], token: int, q: np.ndarray | RowProbs | None
    ) -> RowProbs:
        """:meth:`residual` of a small sparse float32 row and a float32 q in plain Python:
        each p - q rounded to float32 once, then the maximum with 0, as numpy takes them."""
        if q is None:
            out = list(values)
            index = self._index(token)
            if index is not None:
                out[index] = 0.0
            return RowProbs.of_lists(out, ids)
        if isinstance(q, RowProbs):
            q_here = q._list_at(ids)
            if q_here is None:  # a large q: one numpy lookup
                q_here = q.at(np.array(ids, dtype=np.int64)).tolist()
        else:
            q_here = q[np.array(ids, dtype=np.int64)].tolist()
        out = []
        for p_value, q_value in zip(values, q_here, strict=True):
            left = float32(p_value - q_value)
            out.append(left if left > 0.0 else 0.0)
        return RowProbs.of_lists(out, ids)

    def at(self, ids: np.ndarray) -> np.ndarray:
        """The probabilities of tokens ``ids`` ([n] int64), 0 outside the support, in this
        row's dtype."""
        if self.support is None:
            return self.values[ids]
        if ids.size <= SMALL_DRAW:  # plain Python where this row is small too
            found = self._list_at(ids.tolist())
            if found is not None:
                return np.array(found, dtype=self.values.dtype)
        index = np.searchsorted(self.support, ids)  # [n]
        index = np.minimum(index, self.support.size - 1)
        found = self.support[index] == ids
        return np.where(found, self.values[index], self.values.dtype.type(0))

    def _list_at(self, ids: list[int]) -> list[float] | None:
        """The values at tokens ``ids`` (0 outside the support) as Python floats, read
        from a small row's lists; None for a large row."""
        small = self._lists()
        if small is None:
            return None
        values, support = small
        if support is None:
            return [values[i] for i in ids]
        here = dict(zip(support, values, strict=True))
        return [here.get(i, 0.0) for i in ids]

    def on_ids(self, ids: np.ndarray, id_list: Sequence[int] | None = None) -> RowProbs:
        """This row over another vocabulary: entry i (token i here; every token when
        dense) becomes token ``ids[i]`` there ([n] distinct int64), sorted by id.
        ``id_list``: the same ids as a Python list, for a small row's plain-Python path."""
        small = self._lists() if id_list is not None and self._float32() else None
        if small is not None:
            here = range(len(small[0])) if small[1] is None else small[1]
            moved = sorted(zip((id_list[i] for i in here), small[0], strict=True))
            return RowProbs.of_lists([v for _, v in moved], [t for t, _ in moved])
        tokens = ids if self.support is None else ids[self.support]  # [n]
        order = np.argsort(tokens, kind="stable")
        return RowProbs(self.values[order], tokens[order])

    def mass(self) -> float:
        """The total weight, float64 (a small row's by ``math.fsum``, exactly rounded; it
        only decides whether a residual has any mass left)."""
        small = self._lists()
        if small is not None:
            return math.fsum(small[0])
        return float(self.values.sum(dtype=np.float64))

    def dense(self, size: int) -> torch.Tensor:
        """The [size] float32 row this stands for (zeros outside the support)."""
        if self.support is None:
            return torch.from_numpy(self.values)
        out = torch.zeros(size, dtype=torch.float32)
        out[torch.from_numpy(self.support)] = torch.from_numpy(self.values)
        return out

    def draw(self, uniform: float) -> int:
        """:func:`sample_from`'s token for these weights and ``uniform``, bit for bit: a
        running float64 sum is unchanged by adding 0.0, so the partial sums over the
        positive entries are the full cumsum's at those indices, and the first index whose
        partial sum exceeds u * total is a positive entry either way. A small row (a
        typical nucleus) runs in plain Python: the same float64 additions, no numpy call."""
        small = self._lists()
        if small is not None:
            return self._small_draw(uniform, *small)
        if self.support is None and self.values.size > SPARSE_SAMPLE_LIMIT:
            # a dense row (temperature alone): the full cumsum, without first listing its
            # positive entries (a pass over 49k entries, 20 µs, that found nearly all)
            uniforms = torch.tensor([uniform], dtype=torch.float64)
            dense = torch.from_numpy(self.values).reshape(1, -1)
            return int(sample_from(dense, uniforms)[0])
        positive = np.flatnonzero(self.values > 0)  # [m] increasing indices
        cdf = np.cumsum(self.values[positive].astype(np.float64))  # [m]
        target = float(np.float64(uniform) * cdf[-1])
        index = int(positive[min(int(np.searchsorted(cdf, target, side="right")), cdf.size - 1)])
        return index if self.support is None else int(self.support[index])

    @staticmethod
    def _small_draw(uniform: float, values: list[float], ids: list[int] | None) -> int:
        """:meth:`draw` in plain Python floats (float64, as numpy's cumsum adds them)."""
        positive, cdf, running = [], [], 0.0
        for index, value in enumerate(values):
            if value > 0:
                running += value
                positive.append(index)
                cdf.append(running)
        found = bisect.bisect_right(cdf, uniform * running)  # searchsorted(side="right")
        index = positive[min(found, len(cdf) - 1)]
        return index if ids is None else ids[index]

    def _index(self, token: int) -> int | None:
        """Where ``token`` sits in ``values`` (None: outside the support)."""
        small = self._lists()
        ids = self.support if small is None else small[1]
        if ids is None:
            return token
        if small is not None:  # plain Python: no numpy call
            index = bisect.bisect_left(ids, token)
            return index if index < len(ids) and ids[index] == token else None
        index = int(np.searchsorted(ids, token))
        found = index < ids.size and int(ids[index]) == token
        return index if found else None


# (row [vocab] float32 raw logits, temperature, top_p) -> the row's top-p distribution as
# :func:`row_probs` gives it (the same ids and bits), or None where the caller must find
# it itself: a faster search a runtime may offer (the native kernels).
NucleusSearch = Callable[[torch.Tensor, float, float], "RowProbs | None"]


def row_probs(
    logits: torch.Tensor, params: SamplingParams, search: NucleusSearch | None = None
) -> RowProbs:
    """One row's processed distribution, as :func:`logits_to_probs` gives it (the same
    bits at every token), sparse where top-p cuts a nucleus. logits: [vocab] raw logits.
    ``search`` may find the row (top-p without a top-k cut); where it answers, it gives
    the same tokens and values and no softmax over the vocabulary is taken."""
    logits = logits.float()
    if params.greedy:
        best = np.array([int(_as_numpy(logits).argmax())], dtype=np.int64)
        return RowProbs(np.ones(1, dtype=np.float32), best)
    if _sparse_top_k(params, logits.shape[-1]):
        return _top_k_row(_as_numpy(logits / params.temperature), params)
    searchable = not _cuts_top_k(params, logits.shape[-1]) and not params.min_p
    if params.top_p < 1 and search is not None and searchable:
        found = search(logits, params.temperature, params.top_p)
        if found is not None:
            return found
    return _processed_row(tempered(logits, params), params)


def _processed_row(logits: torch.Tensor, params: SamplingParams) -> RowProbs:
    """[vocab] float32 tempered logits, -inf below any top-k cut -> the row: its top-p
    nucleus renormalized, or the softmax over the whole row."""
    if params.top_p < 1:
        return _renormalized_nucleus(_as_numpy(logits), _as_numpy(cut_probs(logits)), params.top_p)
    return RowProbs(_as_numpy(torch.softmax(logits, dim=-1)))


def cut_probs(logits: torch.Tensor) -> torch.Tensor:
    """[..., vocab] float32 tempered logits -> [..., vocab] float64 softmax: what the
    top-p nucleus is cut on."""
    return torch.softmax(logits, dim=-1, dtype=torch.float64)


def _cuts_top_k(params: SamplingParams, vocab: int) -> bool:
    return 0 < params.top_k < vocab


def _sparse_top_k(params: SamplingParams, vocab: int) -> bool:
    """Whether a row's top-k cut keeps its tokens alone (:func:`_top_k_row`): rows of more
    than SMALL_TOP_K_ROW tokens, where a softmax over all of them costs more."""
    return vocab > SMALL_TOP_K_ROW and _cuts_top_k(params, vocab)


def _renormalized_nucleus(logits: np.ndarray, probs: np.ndarray, top_p: float) -> RowProbs:
    """A row's top-p nucleus (the tokens :func:`nucleus_threshold` keeps, ties at the cut
    included) renormalized over the kept logits alone (float64, in vocabulary order)
    instead of by a second softmax over the whole vocabulary with -inf outside it: the
    same distribution, summed over the tens of kept entries instead of 49k.

    logits: [vocab] (divided by the temperature), probs: [vocab] float64 their softmax."""
    kept = _row_nucleus(probs, top_p).kept  # [n] increasing token ids
    return _renormalized(logits[kept], kept)


def _renormalized(kept_logits: np.ndarray, kept: np.ndarray) -> RowProbs:
    """The nucleus ``kept`` ([n] increasing ids) with weights softmax(kept_logits) ([n]
    float32 tempered logits), taken in float64 and stored as float32. Up to
    EXACT_RENORMALIZE_LIMIT entries: exp(x - max) by libm (``math.exp``), summed in id
    order, each divided by the sum and rounded to float32: the native kernels'
    ``spec_nucleus`` computes the same bits."""
    if kept_logits.size <= EXACT_RENORMALIZE_LIMIT:
        values = kept_logits.tolist()  # float32 values as Python floats (exact)
        top = max(values)
        weights = [math.exp(value - top) for value in values]
        total = 0.0
        for weight in weights:  # in order (builtin sum() compensates: other bits)
            total += weight
        # each float64 quotient rounded to float32 (what astype(float32) of them gives)
        return RowProbs(np.array([weight / total for weight in weights], dtype=np.float32), kept)
    weights = np.exp(kept_logits.astype(np.float64) - float(kept_logits.max()))
    return RowProbs((weights / weights.sum()).astype(np.float32), kept)


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a numpy array (shared memory, no copy)."""
    return t.detach().cpu().numpy()


def nucleus_threshold(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The probability of the least probable nucleus member: [..., vocab] -> [..., 1].

    Sorting 49k probabilities costs milliseconds, and the nucleus is usually tens or
    hundreds of tokens. So each row sorts only the tokens at or above a cutoff (a prefix
    of the full descending order, ties included), lowering the cutoff until that prefix
    holds the top_p mass. Prefix masses are sums of the same descending values, in the
    same order, as after a full sort, so the result is the full sort's
    (``reference.nucleus_threshold_reference``). Rows run in numpy, whose compares and
    small sorts cost microseconds where torch's cost tens.
    """
    rows = _as_numpy(probs).reshape(-1, probs.shape[-1])  # [rows, vocab]
    threshold = np.array([_row_nucleus(row, top_p).threshold for row in rows], dtype=rows.dtype)
    return torch.from_numpy(threshold).reshape(*probs.shape[:-1], 1)


class RowNucleus(NamedTuple):
    threshold: np.floating  # the least probable member's probability
    kept: np.ndarray  # [n] increasing token ids of the members (probability >= threshold)


def _row_nucleus(row: np.ndarray, top_p: float) -> RowNucleus:
    """row: [vocab] probabilities (float64 in the sampling paths) -> its top-p nucleus.

    A member's mass before it is the float64 sum of the larger probabilities added one
    after another (``np.cumsum`` accumulates in order): member i of the descending order is
    kept while the mass before it, entry i - 1 of the running sum (0 for the first), is
    below top_p."""
    if row.size <= SMALL_DRAW and row.dtype == np.float64:
        return _small_row_nucleus(row, top_p)
    cutoff = float(row.max())
    while True:
        cutoff /= NUCLEUS_CUTOFF_STEP
        candidates = np.flatnonzero(row >= cutoff)  # [n] token ids, increasing
        candidate_probs = row[candidates]
        ordered = np.sort(candidate_probs)[::-1]  # a sorted prefix, descending
        mass = np.cumsum(ordered, dtype=np.float64)  # [n] mass up to and including each
        if ordered.size == row.size or cutoff == 0.0 or mass[-1] >= top_p:
            # the tokens below the cutoff all come after this prefix's mass: outside
            kept = 1 + int(np.count_nonzero(mass[:-1] < top_p))  # the first is always kept
            threshold = ordered[kept - 1]  # >= cutoff: every member is a candidate
            return RowNucleus(threshold, candidates[candidate_probs >= threshold])


def _small_row_nucleus(row: np.ndarray, top_p: float) -> RowNucleus:
    """:func:`_row_nucleus` of a short float64 row (a small vocabulary, a top-k cut) in
    plain Python floats, bit for bit: the same descending order, the same in-order float64
    running sum (Python's float addition is the IEEE double addition ``np.cumsum``
    makes), stopped at the first member whose mass reaches top_p."""
    values = row.tolist()
    ordered = sorted(values, reverse=True)
    mass, kept = 0.0, len(ordered)
    for index, value in enumerate(ordered[:-1]):
        mass += value
        if mass >= top_p:  # the next member's mass before it is not below top_p
            kept = index + 1
            break
    threshold = ordered[kept - 1]
    members = [i for i, value in enumerate(values) if value >= threshold]
    return RowNucleus(np.float64(threshold), np.array(members, dtype=np.int64))


def sample_from(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling from unnormalized non-negative weights.

    probs:   [batch, vocab] non-negative weights with positive sum per row.
    uniform: [batch] values in [0, 1).
    returns: [batch] token ids; a zero-weight token is never returned.
    """
    cdf = torch.cumsum(probs.double(), dim=-1)  # [batch, vocab]
    total = cdf[:, -1:]  # [batch, 1]
    target = uniform.double().unsqueeze(-1) * total  # [batch, 1]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [batch]
    vocab = probs.shape[-1]
    if not bool((tokens >= vocab).any()):
        return tokens
    # u * total can round up to total: fall back to the last token with positive weight.
    last_positive = vocab - 1 - torch.argmax((probs.flip(-1) > 0).int(), dim=-1)  # [batch]
    return torch.minimum(tokens, last_positive)


def sample_row(weights: torch.Tensor, uniform: float) -> int:
    """:func:`sample_from` for one row, summing only its positive weights when they are
    few (a top-p nucleus). weights: [vocab] float32 >= 0 with a positive sum."""
    return RowProbs(_as_numpy(weights)).draw(uniform)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """probs: [batch, vocab] -> [batch] token ids drawn with the given generator."""
    uniform = torch.rand(probs.shape[0], generator=generator, dtype=torch.float64)
    return sample_from(probs, uniform)


def check_probs(probs: torch.Tensor, name: str) -> None:
    """Raise ValueError unless ``probs`` ([..., vocab]) holds valid distributions."""
    if not torch.is_floating_point(probs):
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {probs.dtype}")
    if probs.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(probs.shape)})")
    if torch.isnan(probs).any():
        raise ValueError(f"{name} contains NaN")
    if torch.isinf(probs).any():
        raise ValueError(f"{name} contains inf")
    minimum = probs.min().item()
    if minimum < 0:
        raise ValueError(f"{name} has a negative entry ({minimum:g})")
    sums = probs.sum(dim=-1, dtype=torch.float64)
    worst = (sums - 1).abs().max().item()
    if worst > PROB_TOLERANCE:
        bad = sums.flatten()[(sums - 1).abs().flatten().argmax()].item()
        raise ValueError(
            f"{name} does not sum to 1 (a row sums to {bad:.6g}; tolerance {PROB_TOLERANCE:g})"
        )
