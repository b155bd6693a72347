"""The exact law of the target's own sampling, by enumeration: the reference of a check
whose target has a small vocabulary (the tiny fixture).

Plain sampling draws token j from the processed distribution (temperature, top-k, top-p:
:func:`~speculative.sampling.logits_to_probs`) that follows the prompt and the tokens
before it, and stops after an end-of-sequence token. So the probability of a continuation
x1..xL is the product of those L processed probabilities, and the law of the first L
tokens is found by walking the tree of prefixes depth first, one target forward per
internal node (Σ_{d<L} |support|^d forwards; ``ModelSession`` rolls the cache back to each
node's parent, so every forward feeds one token). A continuation that ended (EOS) before
position j has :data:`END` there, as drawn continuations do.

With the exact law, a check compares ONE sample (the speculative continuations) with the
law itself: a goodness-of-fit test instead of a two-sample test, and a TV bound whose
margin is that of one sample (:func:`~.stats.fit_tv_margin`), which needs about a quarter
of the continuations that two samples of the same size do for the same bound.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from speculative.models.base import CausalLM
from speculative.models.session import ModelSession
from speculative.sampling import SamplingParams, logits_to_probs

END = "<end>"  # a continuation stopped (EOS) before this position
MAX_FORWARDS = 20_000  # enumeration budget: beyond it the check draws a reference sample

Law = dict[tuple[int | str, ...], float]  # continuation (END-padded to L) -> probability


def forwards_needed(vocab_size: int, length: int, params: SamplingParams) -> int:
    """Upper bound on the target forwards of :func:`target_law` (top-k narrows the
    support; EOS and top-p only prune further)."""
    support = min(vocab_size, params.top_k) if params.top_k else vocab_size
    return sum(support**depth for depth in range(length))


def enumerable(vocab_size: int, length: int, params: SamplingParams) -> bool:
    """Whether the exact law of ``length`` tokens is within the enumeration budget."""
    return not params.greedy and forwards_needed(vocab_size, length, params) <= MAX_FORWARDS


def target_law(
    model: CausalLM,
    prompt: Sequence[int],
    params: SamplingParams,
    length: int,
    eos_token_ids: Collection[int] = (),
) -> Law:
    """The exact distribution of the first ``length`` tokens that plain sampling from
    ``model`` at ``params`` continues ``prompt`` with (probabilities in float64; they sum
    to 1 up to float32 rounding of the processed distributions)."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    session = ModelSession(model)
    session.keep_features(False)
    law: Law = {}
    stack: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    while stack:
        prefix, mass = stack.pop()
        logits = session.logits_after([*prompt, *prefix])[0, -1]  # [vocab]
        probs = logits_to_probs(logits.unsqueeze(0), params)[0].double()  # [vocab]
        for token in torch.nonzero(probs).flatten().tolist():
            seq, p = (*prefix, token), mass * float(probs[token])
            if len(seq) == length or token in eos_token_ids:
                law[seq + (END,) * (length - len(seq))] = p
            else:
                stack.append((seq, p))
    session.reset()
    return law


def marginal(law: Law, key) -> dict:
    """The law of ``key(continuation)``: probabilities summed over each key's continuations."""
    out: dict = {}
    for seq, p in law.items():
        k = key(seq)
        out[k] = out.get(k, 0.0) + p
    return out
