"""Chain vs static vs dynamic trees, side by side in one process (greedy, default model).

    PYTHONPATH=src python scripts/tree_bench.py [--precision fp32] [--prompts 4] [--tokens 96]
        [--threads 1 --clock cpu]   # CPU time: robust when other jobs share the cores

Every configuration runs each prompt once per repeat, interleaved (so machine drift hits
all alike); reports τ (tokens per target call, deterministic), drafted nodes per round,
and tok/s relative to plain decoding (median over repeats of total time), and checks that
every output equals plain greedy decoding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from speculative.bench.prompts import load_prompts
from speculative.drafters.registry import build_drafter
from speculative.engine import SpeculativeEngine, StopCriteria
from speculative.engine.tree import make_tree_round
from speculative.sampling import SamplingParams
from speculative.targets import encode_prompt, load_target

CONFIGS = [  # (label, drafter, gamma, tree)
    ("plain", "none", 1, "off"),
    ("self-int4 chain γ=3", "self-int4", 3, "off"),
    ("self-int4 chain γ=5", "self-int4", 5, "off"),
    ("self-int4 static", "self-int4", 3, "static"),
    ("self-int4 dynamic", "self-int4", 3, "dynamic"),
    ("ngram chain γ=4", "ngram", 4, "off"),
    ("ngram tree", "ngram", 4, "static"),
    ("eagle chain γ=2", "eagle", 2, "off"),
    ("eagle static", "eagle", 2, "static"),
    ("eagle dynamic", "eagle", 2, "dynamic"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--categories", nargs=2, default=["multi_turn_chat", "question_answering"])
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch/OpenMP threads (0: leave as is)"
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: process CPU time (robust on a shared machine; use with --threads 1)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    target = load_target("default", "native", args.precision)
    suite = load_prompts()
    first = [p for p in suite if p.category == args.categories[0]]
    second = [p for p in suite if p.category == args.categories[1]]
    prompts = [p for pair in zip(first, second, strict=False) for p in pair][: args.prompts]
    ids = [
        encode_prompt(target.tokenizer, p.prompt, p.messages and list(p.messages)) for p in prompts
    ]
    configs = [c for c in CONFIGS if args.only is None or c[0] in args.only or c[0] == "plain"]
    engines = {}  # label -> a fresh engine per generation (sessions share target.lm)
    for label, draft, gamma, tree in configs:
        drafter = build_drafter(draft, target)
        engines[label] = lambda d=drafter, g=gamma, t=tree: SpeculativeEngine(
            target.lm, d, g, make_tree_round(t, d, args.budget)
        )
    params, stop = (
        SamplingParams(temperature=args.temperature, top_p=args.top_p),
        StopCriteria(max_new_tokens=args.tokens, eos_token_ids=target.eos_token_ids),
    )
    seconds = {label: [] for label in engines}
    stats = {}
    outputs = {}
    warm = StopCriteria(max_new_tokens=4)
    engines["plain"]().generate(ids[0][:8], params, warm, torch.Generator())
    for _ in range(args.repeats):
        for label, engine in engines.items():
            total, calls, new, drafted, accepted = 0.0, 0, 0, 0, 0
            outs = []
            for prompt in ids:
                started = clock()
                generator = torch.Generator().manual_seed(len(outs))
                result = engine().generate(prompt, params, stop, generator)
                total += clock() - started
                s = result.stats
                calls, new = calls + s.target_calls, new + s.new_tokens
                drafted, accepted = drafted + s.drafted_tokens, accepted + s.accepted_tokens
                outs.append(result.token_ids)
            seconds[label].append(total)
            stats[label] = (new / calls, drafted / calls, accepted / max(drafted, 1), new)
            outputs[label] = outs
    base = statistics.median(seconds["plain"])
    rows = []
    for label in engines:
        tau, nodes, alpha, new = stats[label]
        t = statistics.median(seconds[label])
        rows.append(
            {
                "config": label,
                "tau": round(tau, 2),
                "drafted_per_round": round(nodes, 1),
                "accepted_per_drafted": round(alpha, 2),
                "tok_s": round(new / t, 1),
                "speedup": round(base / t, 2),
                "identical": outputs[label] == outputs["plain"],
                "seconds": [round(x, 2) for x in seconds[label]],
            }
        )
        print(
            f"{label:22s} τ {tau:5.2f}  nodes/round {nodes:4.1f}  tok/s {new / t:6.1f}  "
            f"speedup {base / t:4.2f}x  identical {outputs[label] == outputs['plain']}"
        )
    meta = {"precision": args.precision, "tokens": args.tokens, "clock": args.clock}
    meta["temperature"] = args.temperature
    meta["threads"] = torch.get_num_threads()
    print(json.dumps({**meta, "rows": rows}))


if __name__ == "__main__":
    main()
