"""Exactness checks: is speculative sampling with this target and drafter distributed as
the target's own sampling? Statistics (:mod:`.stats`), drawing and comparing
(:mod:`.runner`), the target's exact law on small vocabularies (:mod:`.exact`), the
negative controls (:mod:`.controls`), the tiny test target
(:mod:`.tiny`) and the drafter × mode × sampling grid (:mod:`.matrix`)."""

from speculative.exactness.runner import (
    MODES,
    CheckConfig,
    CheckReport,
    ControlTooWeak,
    SharedDraws,
    run_check,
    total_draws,
    uses_exact_law,
)

__all__ = [
    "MODES",
    "CheckConfig",
    "CheckReport",
    "ControlTooWeak",
    "SharedDraws",
    "run_check",
    "total_draws",
    "uses_exact_law",
]
