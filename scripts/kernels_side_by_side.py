"""The C kernels of this tree against those of another git revision, side by side.

    PYTHONPATH=src .venv/bin/python scripts/kernels_side_by_side.py --baseline c6436c7 \
        --context 128 512 1024 --k 1 3 5 8 --precision int4
    ... --batch 8 --k 1 4   # batched passes: 8 sequences (cache slots), k new tokens each

Loads the default model twice on the native runtime (this tree's ``kernels.c`` and the
baseline's, each compiled as the runtime compiles it), fills both caches with the same
random context, then times forwards of k new tokens with the two models interleaved
(alternating which goes first) and checks that their logits are bitwise equal (``--allow-
different`` for a change that is meant to round differently). Prints the median ms of each
and the ratio, per context and k.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from revision import source_at  # scripts/revision.py, beside this script

from speculative.hardware import cpu_info
from speculative.models.base import RowInput
from speculative.models.native import ckernels
from speculative.targets import load_target


def baseline_source(revision: str) -> Path:
    """kernels.c of ``revision`` in a temporary file."""
    text = source_at(revision, "src/speculative/models/native/kernels.c")
    path = Path(tempfile.mkdtemp()) / "kernels.c"
    path.write_text(text)
    return path


def load_both(baseline: Path, precision: str):
    """(this tree's model, the baseline's model), each on its own kernel library."""
    current = load_target("default", precision=precision).lm
    here = ckernels.SOURCE
    ckernels.SOURCE = baseline
    try:
        before = load_target("default", precision=precision).lm
    finally:
        ckernels.SOURCE = here
    for name, model in (("this tree", current), (f"the baseline {baseline}", before)):
        if getattr(model.decoder, "_library", None) is None:
            raise SystemExit(
                f"{name}'s kernels did not load (see the warning above): the two revisions "
                "must share kernels.c's interface (ckernels.ABI_VERSION)"
            )
    if current.decoder._library is before.decoder._library:
        raise SystemExit("both models run the same kernel library: the sources are identical")
    return current, before


def _alternate(
    names: list[str],
    ks: list[int],
    repeats: int,
    bitwise: bool,
    forward: Callable[[str, int], torch.Tensor],
    rollback: Callable[[str, int], None],
    where: str,
) -> dict[tuple[str, int], float]:
    """Median ms of ``forward(name, k)`` per (model, k), the models alternated (which goes
    first flips every round; the first round warms up), each forward undone by
    ``rollback(name, k)``; stops when two models' logits differ under ``bitwise``."""
    times: dict[tuple[str, int], list[float]] = {(n, k): [] for n in names for k in ks}
    with torch.inference_mode():
        for repeat in range(repeats + 1):
            for k in ks:
                logits = {}
                for name in names if repeat % 2 else reversed(names):
                    started = time.perf_counter()
                    logits[name] = forward(name, k)
                    elapsed = (time.perf_counter() - started) * 1e3
                    rollback(name, k)
                    if repeat:
                        times[(name, k)].append(elapsed)
                if bitwise and not torch.equal(*logits.values()):
                    raise SystemExit(f"{where}, k = {k}: the logits differ")
    return {key: statistics.median(t) for key, t in times.items()}


def _rows(ms: dict[tuple[str, int], float], ks: list[int], **fields: int) -> list[dict]:
    """One result row per k: before/after ms ("after" is this tree) and their ratio."""
    rows = []
    for k in ks:
        after, before = ms[("after", k)], ms[("before", k)]
        rows.append({**fields, "k": k, "before_ms": before, "after_ms": after,
                     "ratio": after / before})  # fmt: skip
    return rows


def compare(models: dict, context: int, ks: list[int], repeats: int, bitwise: bool) -> list[dict]:
    g = torch.Generator().manual_seed(context)
    ids = torch.randint(0, 49000, (1, context + max(ks)), generator=g)  # [1, context + k]
    for model in models.values():
        model.reset()
        model.forward(ids[:, :context])
    ms = _alternate(
        list(models), ks, repeats, bitwise,
        lambda name, k: models[name].forward(ids[:, context : context + k]),
        lambda name, k: models[name].rollback(k),
        f"context {context}",
    )  # fmt: skip
    return _rows(ms, ks, context=context)


def compare_batch(
    models: dict, context: int, ks: list[int], repeats: int, bitwise: bool, batch: int
) -> list[dict]:
    """As :func:`compare` for ``batch`` sequences in cache slots, each after its own random
    ``context`` tokens, timing one ``forward_rows`` pass of k new tokens per sequence."""
    g = torch.Generator().manual_seed(context)
    ids = torch.randint(0, 49000, (batch, context + max(ks)), generator=g)  # [B, context + k]
    slots = {name: [model.acquire_slot() for _ in range(batch)] for name, model in models.items()}
    for name, model in models.items():
        model.forward_rows([RowInput(s, ids[i, :context]) for i, s in enumerate(slots[name])])

    def forward(name: str, k: int) -> torch.Tensor:
        rows = [RowInput(s, ids[i, context : context + k]) for i, s in enumerate(slots[name])]
        return torch.cat(models[name].forward_rows(rows))

    def rollback(name: str, k: int) -> None:
        for s in slots[name]:
            models[name].rollback_slot(s, k)

    ms = _alternate(list(models), ks, repeats, bitwise, forward, rollback,
                    f"batch {batch}, context {context}")  # fmt: skip
    for name, model in models.items():
        for s in slots[name]:
            model.release_slot(s)
    return _rows(ms, ks, context=context, batch=batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="git revision to compare against")
    parser.add_argument("--context", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 3, 5, 8])
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--batch",
        type=int,
        default=0,
        help="time batched passes of this many sequences (cache slots), each "
        "with k new tokens, instead of one sequence",
    )
    parser.add_argument("--allow-different", action="store_true", help="skip the bitwise check")
    parser.add_argument("--json", action="store_true", help="one JSON object as the last line")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    after, before = load_both(baseline_source(args.baseline), args.precision)
    models = {"after": after, "before": before}
    rows = []
    print(f"cpu: {cpu_info().summary()} · precision {args.precision} · {args.threads} threads")
    for context in args.context:
        if args.batch:
            found = compare_batch(models, context, args.k, args.repeats,
                                  not args.allow_different, args.batch)  # fmt: skip
        else:
            found = compare(models, context, args.k, args.repeats, not args.allow_different)
        for row in found:
            rows.append(row)
            print(f"context {context:5d}  k {row['k']:2d}  before {row['before_ms']:7.2f} ms  "
                  f"after {row['after_ms']:7.2f} ms  after/before {row['ratio']:.3f}")  # fmt: skip
    if not args.allow_different:
        print("logits bitwise equal in every forward: yes")
    if args.json:
        print(json.dumps({"baseline": args.baseline, "cpu": cpu_info().as_dict(), "rows": rows}))


if __name__ == "__main__":
    main()
