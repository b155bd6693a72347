"""Pure sampling mathematics: logits → probabilities, accept / recover / bonus.

Imports only torch and numpy. Batch-first: tensors are [batch, ...]; one sequence is a
batch of one. Randomness only from an explicit generator argument.
"""

from speculative.sampling.params import SamplingParams
from speculative.sampling.probs import (
    check_probs,
    logits_to_probs,
    mask_top_k,
    mask_top_p,
    one_hot_argmax,
    sample,
    sample_from,
    sample_row,
)
from speculative.sampling.tree import (
    TreeVerifyResult,
    verify_tree,
    verify_tree_from_uniforms,
    verify_tree_greedy,
)
from speculative.sampling.verify import (
    VerifyResult,
    VerifyUniforms,
    residual,
    speculative_step,
    verify,
    verify_from_uniforms,
    verify_greedy,
    verify_greedy_row,
    verify_logits,
)

__all__ = [
    "SamplingParams",
    "TreeVerifyResult",
    "VerifyResult",
    "VerifyUniforms",
    "check_probs",
    "logits_to_probs",
    "mask_top_k",
    "mask_top_p",
    "one_hot_argmax",
    "residual",
    "sample",
    "sample_from",
    "sample_row",
    "speculative_step",
    "verify",
    "verify_from_uniforms",
    "verify_greedy",
    "verify_greedy_row",
    "verify_logits",
    "verify_tree",
    "verify_tree_from_uniforms",
    "verify_tree_greedy",
]
