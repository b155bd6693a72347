"""Model adapters behind the :class:`CausalLM` protocol (toy Markov, transformers, native)."""

from speculative.models.base import CausalLM
from speculative.models.markov import MarkovLM, seed_matrices
from speculative.models.session import ModelSession

__all__ = ["CausalLM", "MarkovLM", "ModelSession", "seed_matrices"]
