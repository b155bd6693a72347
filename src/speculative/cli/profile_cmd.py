"""`speculative profile`: what verification and drafting cost on this machine."""

from __future__ import annotations

import argparse
import itertools
import sys

from speculative.cli.common import Formatter, add_json_flag, emit_json, positive_int
from speculative.cli.generate_cmd import add_kv_cache_argument, add_max_context_argument

DESCRIPTION = """\
Measure the costs that decide whether speculative decoding pays on this machine:

  decode ms/token   T(1): one target forward over one new token (after --context tokens)
  verify cost       T(k)/T(1): a forward over k new tokens relative to one decode step;
                    a round with γ drafted tokens scores k = γ + 1 tokens
  bandwidth floor   weight bytes read per step ÷ --bandwidth GB/s: no decode step can be
                    faster than reading the weights once
  draft cost c      one drafting step ÷ one target decode step, per drafter
  round overhead    per round of real generations (plain and each drafter, greedy and
                    T=0.8 top-p=0.95): the time outside the target's forwards and the
                    drafter's calls (sampling, verification, bookkeeping, cache sync), in
                    ms and as a share of one decode step
  ops (--ops)       where each T(k) goes on the C kernels: ms of every op of the forward
                    (norms, q/k/v, RoPE and cache store, attention, o, gate/up, SiLU,
                    down, each summed over the layers; the output head), and "outside":
                    the rest of the forward call (Python, the embedding, the call into C)

Timings of all k (and of all runtimes, when several are given) are interleaved and the
median of --repeats rounds is kept, so machine drift hits every configuration alike.
`speculative generate --gamma auto` uses the same quantities with the generalized speedup
(1 − α^(γ+1)) / ((1 − α)(γc + T(γ+1)/T(1))).

Example:  speculative profile --runtime native hf --drafters ngram self-int4 --json
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="measure the verify-cost curve, decode speed, bandwidth floor and draft costs",
        description=DESCRIPTION,
        formatter_class=Formatter,
    )
    parser.add_argument("--target", default="default", help="target model (as for generate)")
    parser.add_argument(
        "--runtime",
        nargs="+",
        default=["auto"],
        choices=["auto", "native", "hf"],
        help="runtime(s) to measure side by side",
    )
    parser.add_argument(
        "--backend",
        nargs="+",
        default=["auto"],
        choices=["auto", "kernels", "torch"],
        help="native runtime decoder(s): kernels (C), torch, or auto (kernels when they "
        "build); several are measured side by side",
    )
    parser.add_argument(
        "--precision",
        default="auto",
        help="target weight precision (auto: the model's own, e.g. int4 for a Q4 GGUF)",
    )
    add_kv_cache_argument(parser, several=True)
    add_max_context_argument(parser)
    parser.add_argument(
        "--drafters", nargs="*", default=["ngram"], help="drafters whose cost c to measure"
    )
    parser.add_argument("--max-k", type=positive_int, default=16, help="largest block size k")
    parser.add_argument("--context", type=positive_int, default=128, help="cached tokens")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed rounds per k")
    parser.add_argument("--bandwidth", type=float, default=22.0, help="memory read GB/s")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    parser.add_argument(
        "--prefill",
        type=int,
        default=0,
        metavar="N",
        help="also time a prefill of N prompt tokens from an empty cache (0: skip)",
    )
    parser.add_argument(
        "--overhead-tokens",
        type=int,
        default=64,
        metavar="N",
        help="tokens per generation when measuring the round overhead (0: skip)",
    )
    parser.add_argument(
        "--gamma", type=positive_int, default=3, help="drafted tokens per round (overhead)"
    )
    parser.add_argument(
        "--ops",
        action="store_true",
        help="also time every op of the C forward for each k (native kernels only)",
    )
    parser.add_argument(
        "--no-roofline",
        dest="roofline",
        action="store_false",
        help="skip the roofline (machine peaks measured by the C kernels' microbenchmarks)",
    )
    add_json_flag(parser)
    parser.set_defaults(run=run)


def weight_bytes_of(lm: object) -> int | None:
    from speculative.models.base import SupportsWeightBytes

    return lm.weight_bytes() if isinstance(lm, SupportsWeightBytes) else None


def run(args: argparse.Namespace) -> int:
    import torch

    from speculative.drafters.base import draft_model_of
    from speculative.drafters.registry import build_drafter
    from speculative.engine.costs import (
        drafter_cost,
        interleaved_forward_ms,
        interleaved_prefill_ms,
        probe_context,
    )
    from speculative.hardware import cpu_info
    from speculative.targets import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    targets = []
    for runtime in dict.fromkeys(args.runtime):
        native = runtime != "hf"
        backends = dict.fromkeys(args.backend) if native else ["auto"]
        caches = dict.fromkeys(args.kv_cache) if native else ["auto"]
        for backend, kv_cache in itertools.product(backends, caches):
            label = runtime if not native else f"{runtime}, {backend}, KV cache {kv_cache}"
            print(f"loading {args.target} ({label}, {args.precision}) ...", file=sys.stderr)
            targets.append(
                load_target(
                    args.target, runtime, args.precision, backend, kv_cache, args.max_context
                )
            )
    context = probe_context(targets[0].lm.vocab_size, args.context)
    ks = list(range(1, args.max_k + 1))
    print(f"timing k = 1..{args.max_k} ({args.repeats} interleaved rounds) ...", file=sys.stderr)
    times = interleaved_forward_ms([t.lm for t in targets], context, ks, args.repeats)
    prefills: list[float | None] = [None] * len(targets)
    if args.prefill > 0:
        print(f"timing a {args.prefill}-token prefill ...", file=sys.stderr)
        prefills = list(interleaved_prefill_ms([t.lm for t in targets], args.prefill, 3))
    peaks: dict[str, object] = {}
    reports = []
    for target, ms, prefill in zip(targets, times, prefills, strict=True):
        step = ms[1]
        nbytes = weight_bytes_of(target.lm)
        floor = None if nbytes is None else nbytes / (args.bandwidth * 1e9) * 1e3
        costs = {}
        drafters: dict[str, object] = {"none": None}
        for name in args.drafters:
            try:
                drafter = build_drafter(name, target)
            except ValueError as exc:  # e.g. no int4 on the hf runtime
                print(f"  ({target.runtime}: skipping drafter {name}: {exc})", file=sys.stderr)
                costs[name] = None
                continue
            if drafter is None:  # "none": plain decoding, always measured
                continue
            model = draft_model_of(drafter)
            costs[name] = drafter_cost(drafter, model, target.lm, context, step, args.repeats)
            drafters[name] = drafter
        overheads = measure_overheads(target, drafters, args)
        reports.append(
            {
                "runtime": target.runtime,
                "backend": target.backend if target.runtime == "native" else None,
                "kernels": kernels_of(target.lm),
                "precision": target.precision,
                "model": target.name,
                "decode_ms_per_token": step,
                "bandwidth_floor_ms": floor,
                "weight_bytes": nbytes,
                "verify_ms": {str(k): v for k, v in ms.items()},
                "verify_cost": {str(k): v / step for k, v in ms.items()},
                "draft_cost": costs,
                "round_overhead": [o.to_dict(step) for o in overheads],
            }
        )
        reports[-1].update(kernel_roofline(target.lm, ms, args, peaks))
        if args.ops:
            reports[-1].update(op_breakdown(target.lm, context, ks, args.repeats))
        if prefill is not None:
            reports[-1].update({"prefill_tokens": args.prefill, "prefill_ms": prefill})
    cpu = cpu_info()
    print(f"\ncpu: {cpu.summary()}")
    print_reports(reports)
    if args.json:
        payload = dict(reports[0])
        payload["runtimes"] = reports
        payload["cpu"] = cpu.as_dict()
        emit_json(payload)
    return 0


OVERHEAD_SETTINGS = ((0.0, 1.0), (0.8, 0.95))  # (temperature, top_p): greedy and top-p


def measure_overheads(target: object, drafters: dict, args: argparse.Namespace) -> list:
    """Round overheads of plain decoding and each drafter, greedy and top-p, on the
    default prompt (empty with --overhead-tokens 0)."""
    from speculative.engine.costs import round_overheads
    from speculative.pipeline import DEFAULT_PROMPT
    from speculative.sampling import SamplingParams
    from speculative.targets import encode_prompt

    if args.overhead_tokens <= 0:
        return []
    print(f"timing rounds of {args.overhead_tokens}-token generations ...", file=sys.stderr)
    prompt = encode_prompt(target.tokenizer, DEFAULT_PROMPT)
    settings = [SamplingParams(temperature=t, top_p=p) for t, p in OVERHEAD_SETTINGS]
    return round_overheads(
        target.lm, drafters, prompt, settings, args.overhead_tokens, args.gamma, args.repeats
    )


def kernels_of(lm: object) -> dict[str, str]:
    """Which kernels run a native model's layers, (C kernels) on which pages their
    weights live, and its KV cache's element type (empty for other runtimes)."""
    decoder = getattr(lm, "decoder", None)
    kernels = dict(getattr(decoder, "kernels", {}))
    pages = getattr(decoder, "weight_pages", None)
    if pages is not None:
        kernels["weights"] = pages()
    kv_cache = getattr(lm, "kv_cache", None)  # the native runtime's cache element type
    if kv_cache is not None:
        kernels["kv_cache"] = f"KV cache {kv_cache}"
    return kernels


def kernel_roofline(
    lm: object, ms: dict[int, float], args: argparse.Namespace, peaks: dict
) -> dict:
    """The kernel library's ISA and, unless --no-roofline, the machine's peaks (measured
    once per ISA, cached in ``peaks``) and the roofline of each T(k). Empty for models
    not running on the C kernels (asked through :class:`SupportsKernels`)."""
    from speculative.models.base import SupportsKernels

    if not isinstance(lm, SupportsKernels):
        return {}
    library, work = lm.kernel_library(), lm.kernel_work()
    if library is None or work is None:
        return {}
    from speculative.models.native.ckernels import library_isa

    isa = library_isa(library)
    out: dict[str, object] = {"kernel_isa": isa}
    if not args.roofline:
        return out
    import torch

    from speculative.models.native.profile import measure_peaks, roofline

    if isa not in peaks:
        print(f"measuring machine peaks ({isa}) ...", file=sys.stderr)
        peaks[isa] = measure_peaks(library, torch.get_num_threads())
    machine = peaks[isa]
    out["machine_peaks"] = machine.to_dict()
    out["roofline"] = roofline(work, machine, args.context, ms, args.bandwidth)
    return out


def op_breakdown(lm: object, context: list[int], ks: list[int], repeats: int) -> dict:
    """``op_ms``: per k, the ms of every op of the C forward (empty where the model does
    not run on the C kernels)."""
    from speculative.engine.costs import kernel_op_ms

    print(f"timing the ops of k = 1..{max(ks)} ...", file=sys.stderr)
    ops = kernel_op_ms(lm, context, ks, repeats)  # type: ignore[arg-type]
    return {} if ops is None else {"op_ms": {str(k): v for k, v in ops.items()}}


def print_ops(by_k: dict[str, dict[str, float]]) -> None:
    print("  where T(k) goes, ms (ops summed over the layers; outside: Python, the call into C)")
    names = list(next(iter(by_k.values())))
    for name in names:
        print(f"  {name:<9} " + " ".join(f"{ops[name]:5.2f}" for ops in by_k.values()))


def print_roofline(r: dict) -> None:
    peaks, line = r["machine_peaks"], r["roofline"]
    print(
        f"  roofline ({r['kernel_isa']}, {peaks['threads']} threads): read "
        f"{peaks['read_gbps']:.1f} GB/s, fp32 FMA {peaks['fma_gmacs']:.0f} GMAC/s, "
        f"int8 dot {peaks['int8_gmacs']:.0f} GMAC/s"
    )
    print("  MB read   " + " ".join(f"{v['bytes'] / 1e6:5.0f}" for v in line.values()))
    print("  GMAC      " + " ".join(f"{v['multiply_adds'] / 1e9:5.2f}" for v in line.values()))
    print("  mem ms    " + " ".join(f"{v['memory_floor_measured_ms']:5.1f}" for v in line.values()))
    print("  cmp ms    " + " ".join(f"{v['compute_floor_ms']:5.1f}" for v in line.values()))
    print("  binds     " + " ".join(f"{v['binds'][:3]:>5}" for v in line.values()))
    print("  T/floor   " + " ".join(f"{v['over_floor']:5.2f}" for v in line.values()))


def print_reports(reports: list[dict]) -> None:
    for r in reports:
        floor = r["bandwidth_floor_ms"]
        floor_text = "n/a" if floor is None else f"{floor:.1f} ms"
        ratio = "" if floor is None else f" ({r['decode_ms_per_token'] / floor:.2f}× the floor)"
        backend = f" ({r['backend']})" if r.get("backend") else ""
        if r.get("kernel_isa"):
            backend = f" ({r['backend']}, {r['kernel_isa']})"
        print(f"\n{r['model']} · runtime {r['runtime']}{backend} · {r['precision']}")
        if r.get("kernels"):
            kernels = sorted(set(r["kernels"].values()))
            print(f"  kernels: {', '.join(kernels)}")
        print(f"  decode: {r['decode_ms_per_token']:.1f} ms/token{ratio}; floor {floor_text}")
        curve = r["verify_cost"]
        print("  k         " + " ".join(f"{k:>5}" for k in curve))
        print("  T(k)/T(1) " + " ".join(f"{v:5.2f}" for v in curve.values()))
        if "roofline" in r:
            print_roofline(r)
        if r.get("op_ms"):
            print_ops(r["op_ms"])
        if r.get("prefill_ms") is not None:
            print(f"  prefill of {r['prefill_tokens']} tokens: {r['prefill_ms']:.0f} ms")
        for name, c in r["draft_cost"].items():
            print(f"  draft cost c[{name}] = " + ("n/a" if c is None else f"{c:.3f}"))
        if r.get("round_overhead"):
            print_overheads(r["round_overhead"])


def print_overheads(rows: list[dict]) -> None:
    print("  per round, ms (rest: outside the target's forwards and the drafter's calls;")
    print("  the median round's, robust to scheduler pauses; round/target/draft: means)")
    print(f"    {'drafter':<18} {'sampling':<18} tok/round  round  target  draft  rest  rest/T1")
    for o in rows:
        print(
            f"    {o['drafter']:<18} {o['sampling']:<18} {o['tokens_per_round']:9.2f} "
            f"{o['round_ms']:6.2f} {o['target_ms']:7.2f} {o['draft_ms']:6.2f} "
            f"{o['overhead_ms']:5.2f} {o.get('overhead_share_of_step', float('nan')):9.1%}"
        )
