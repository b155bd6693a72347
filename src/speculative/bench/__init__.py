"""`speculative bench`: compare plain decoding, our drafters × γ schedules × runtimes and
transformers' own generate() on a prompt suite, with measured costs and predictions."""

from speculative.bench.methods import GammaChoice, parse_gamma_choices
from speculative.bench.output import write_outputs
from speculative.bench.prompts import BenchPrompt, load_prompts, parse_prompts
from speculative.bench.report import ResultRow, payload, summarize, terminal_report
from speculative.bench.runner import BenchRun, BenchSettings, run_bench
from speculative.engine.costs import (
    TargetCosts,
    drafter_cost,
    forward_ms,
    interleaved_forward_ms,
    model_draft_cost,
    verify_cost_curve,
)

__all__ = [
    "BenchPrompt",
    "BenchRun",
    "BenchSettings",
    "GammaChoice",
    "ResultRow",
    "TargetCosts",
    "drafter_cost",
    "forward_ms",
    "interleaved_forward_ms",
    "load_prompts",
    "model_draft_cost",
    "parse_gamma_choices",
    "parse_prompts",
    "payload",
    "run_bench",
    "summarize",
    "terminal_report",
    "verify_cost_curve",
    "write_outputs",
]
