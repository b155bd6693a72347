"""The generation loop (propose → verify → accept → commit), γ policies, stats, stopping."""

from speculative.engine.batch import BatchEngine, BatchRequest
from speculative.engine.gamma import (
    AdaptiveGamma,
    FixedGamma,
    GammaPolicy,
    HeuristicGamma,
    LoadAwareGamma,
)
from speculative.engine.loop import GenerationResult, Round, SpeculativeEngine
from speculative.engine.stats import GenerationStats
from speculative.engine.stopping import StopCriteria
from speculative.engine.tree import DEFAULT_TREE_BUDGET, TreeRound, budget_from_verify_cost

__all__ = [
    "DEFAULT_TREE_BUDGET",
    "AdaptiveGamma",
    "BatchEngine",
    "BatchRequest",
    "FixedGamma",
    "GammaPolicy",
    "GenerationResult",
    "GenerationStats",
    "HeuristicGamma",
    "LoadAwareGamma",
    "Round",
    "SpeculativeEngine",
    "StopCriteria",
    "TreeRound",
    "budget_from_verify_cost",
]
