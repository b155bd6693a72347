"""Per-round overhead and head draft cost, before and after, side by side in one process.

    PYTHONPATH=src .venv/bin/python scripts/perf_side_by_side.py --baseline ace6b03 --threads 1

"before" is the sampling package of git revision --baseline (loaded from git into a temp
folder) driving the same engine; "after" is this tree's. Three measurements, each with
the two sides interleaved:

1. the loop alone: rounds against an instant target that returns precomputed logits of
   the default model (median µs per round: sampling, verification, bookkeeping, session);
2. rounds of real generations on the default model (engine.costs.round_overheads: the
   median round's time outside the target's forwards and the drafter's calls);
3. the draft cost c of the shipped EAGLE and Medusa heads on PyTorch and on the C kernels.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from revision import source_at  # scripts/revision.py, beside this script

import speculative.engine.loop as loop
from speculative.drafters.eagle import EagleDrafter
from speculative.drafters.medusa import MedusaDrafter
from speculative.drafters.registry import build_drafter, load_trained_head
from speculative.engine import SpeculativeEngine, StopCriteria
from speculative.engine.costs import drafter_cost, forward_ms, round_overheads
from speculative.hardware import cpu_info
from speculative.pipeline import DEFAULT_PROMPT
from speculative.sampling import SamplingParams
from speculative.targets import encode_prompt, load_target

MODULES = ("__init__", "params", "probs", "verify", "tree", "reference")
SETTINGS = (SamplingParams(0.0), SamplingParams(0.8, top_p=0.95))


def baseline_sampling(revision: str):
    """The sampling package of ``revision`` as the module ``baseline_sampling``."""
    folder = Path(tempfile.mkdtemp()) / "baseline_sampling"
    folder.mkdir()
    for name in MODULES:
        source = source_at(revision, f"src/speculative/sampling/{name}.py")
        text = source.replace("speculative.sampling", "baseline_sampling")
        (folder / f"{name}.py").write_text(text)
    sys.path.insert(0, str(folder.parent))
    return importlib.import_module("baseline_sampling")


def baseline_verify_draft(old):
    def verify_draft(draft, logits, params, generator):
        drafted = torch.tensor([draft.tokens], dtype=torch.long).reshape(1, -1)
        if params.greedy:
            return old.verify_greedy(drafted, logits)
        probs = old.logits_to_probs(logits, params)
        return old.verify(drafted, draft.probs, probs, generator, validate=False)

    return verify_draft


class InstantTarget:
    """A CausalLM with features whose forward costs nothing: rows of a logits bank."""

    max_length = 4096

    def __init__(self, bank: torch.Tensor, hidden: int) -> None:
        self.bank, self.hidden_size, self.length, self.next = bank, hidden, 0, 0
        self.vocab_size = bank.shape[1]

    @property
    def cache_length(self) -> int:
        return self.length

    def rollback(self, n: int) -> None:
        self.length -= n

    def reset(self) -> None:
        self.length = 0

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        k = input_ids.shape[1]
        rows = [(self.next + j) % self.bank.shape[0] for j in range(k)]
        self.length, self.next = self.length + k, self.next + k
        return self.bank[rows].unsqueeze(0)

    def forward_with_hidden(self, input_ids, attention_mask=None, position_ids=None):
        return self.forward(input_ids), torch.zeros(1, input_ids.shape[1], self.hidden_size)

    def input_embedding(self):
        return torch.zeros(1, self.hidden_size)

    def output_embedding(self):
        return torch.zeros(1, self.hidden_size)


def loop_alone(target, prompt, sides, repeats):
    """Median µs per round against an instant target, per side, drafter and setting."""
    loaded = target.lm
    loaded.reset()
    ids = list(prompt)
    out = SpeculativeEngine(loaded, None, 3).generate(
        ids, SETTINGS[1], StopCriteria(max_new_tokens=64), torch.Generator().manual_seed(0)
    )
    loaded.reset()
    with torch.inference_mode():
        bank = loaded.forward(torch.tensor([ids + out.token_ids]))[0, len(ids) - 1 :].clone()
    loaded.reset()
    instant = InstantTarget(bank, loaded.hidden_size)
    times: dict[tuple, list[float]] = {}
    for seed in range(repeats):
        for side, verify_draft in sides.items():
            loop.verify_draft = verify_draft
            for params in SETTINGS:
                for name in ("none", "ngram"):
                    drafter = build_drafter(name, target)
                    engine = SpeculativeEngine(instant, drafter, 3)
                    stream = engine.stream(
                        ids,
                        params,
                        StopCriteria(max_new_tokens=200),
                        torch.Generator().manual_seed(seed),
                    )
                    next(stream)
                    key = (side, name, "greedy" if params.greedy else "T=0.8, top-p=0.95")
                    while True:
                        started = time.perf_counter()
                        if next(stream, None) is None:
                            break
                        times.setdefault(key, []).append(time.perf_counter() - started)
    for key, values in times.items():
        print(
            f"  {key[0]:7} {key[1]:6} {key[2]:18} {statistics.median(values) * 1e6:7.1f} µs/round"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="ace6b03", help="git revision of 'before'")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sides = {"before": baseline_verify_draft(baseline_sampling(args.baseline))}
    sides["after"] = loop.verify_draft
    target = load_target("default", "native", "auto", "auto")
    print(f"cpu: {cpu_info().summary()}; {args.threads} threads; target {target.precision}")
    prompt = encode_prompt(target.tokenizer, DEFAULT_PROMPT)
    print("1. the loop alone (instant target, 200 tokens, γ = 3):")
    loop_alone(target, prompt, sides, args.repeats)

    print("2. rounds of real 64-token generations (rest = median round's overhead):")
    drafters = {n: build_drafter(n, target) for n in ("none", "ngram", "eagle", "medusa")}
    rows: dict[tuple, list] = {}
    for _ in range(args.repeats):
        for side, verify_draft in sides.items():
            loop.verify_draft = verify_draft
            for o in round_overheads(target.lm, drafters, prompt, SETTINGS, 64, 3, 1):
                rows.setdefault((side, o.drafter, o.sampling), []).append(o)
    loop.verify_draft = sides["after"]
    vocab = target.lm.vocab_size
    context = [(i * 7919) % vocab for i in range(128)]
    step = forward_ms(target.lm, context, [1], 7)[1]
    print(f"  T(1) = {step:.2f} ms")
    for (side, drafter, sampling), runs in rows.items():
        med = {f: statistics.median(getattr(o, f) for o in runs) for f in vars(runs[0])
               if isinstance(getattr(runs[0], f), float)}  # fmt: skip
        print(
            f"  {side:7} {drafter:7} {sampling:18} tok/round {med['tokens_per_round']:4.2f}"
            f"  round {med['round_ms']:6.2f}  target {med['target_ms']:6.2f}"
            f"  draft {med['draft_ms']:5.2f}  rest {med['overhead_ms']:6.3f} ms"
            f" = {med['overhead_ms'] / step:5.1%} of T(1)"
        )

    print("3. draft cost c (a target step between draft steps), interleaved:")
    heads = {
        "eagle, PyTorch": EagleDrafter(load_trained_head("eagle", "", target), vocab),
        "eagle, C kernels": drafters["eagle"],
        "medusa, PyTorch": MedusaDrafter(load_trained_head("medusa", "", target), vocab),
        "medusa, C kernels": drafters["medusa"],
    }
    costs: dict[str, list[float]] = {name: [] for name in heads}
    for _ in range(args.repeats):
        step = forward_ms(target.lm, context, [1], 5)[1]
        for name, drafter in heads.items():
            costs[name].append(drafter_cost(drafter, None, target.lm, context, step, 5))
    for name, values in costs.items():
        runs = ", ".join(f"{c:.3f}" for c in values)
        print(f"  c[{name}] = {statistics.median(values):.3f} (runs {runs})")


if __name__ == "__main__":
    main()
