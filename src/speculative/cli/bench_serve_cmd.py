"""`speculative bench-serve`: load-test a running server (or one it starts), speculative
against plain, at several concurrencies."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from speculative.cli.common import CliError, Formatter, add_json_flag, emit_json, positive_int
from speculative.cli.serve_cmd import gamma_setting

DESCRIPTION = """\
Load-test an OpenAI-compatible server with streamed chat requests: at each concurrency C,
C client threads keep one request in flight until --requests have been sent. Reports
p50/p99 time to first token, tokens/s per stream and aggregate throughput. With
--compare-plain (default) every level runs twice, interleaved: with the server's drafter
(or --draft) and with drafting off ("speculative": {"draft": "none"}), same requests.
Each run starts from a cold prefix cache (POST /reset_prefix_cache, where the server has
it), so that no run finds the prompts of the one before.

Without --url, starts `speculative serve` itself on a free loopback port with --target,
--serve-draft and --max-batch, and stops it afterwards.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench-serve",
        help="load-test the server: TTFT, tokens/s, speculative vs plain",
        description=DESCRIPTION,
        formatter_class=Formatter,
    )
    parser.add_argument("--url", default=None, help="server base URL (default: start one)")
    parser.add_argument("--target", default="default", help="without --url: the model to serve")
    parser.add_argument("--serve-draft", default="ngram", help="without --url: --draft of serve")
    parser.add_argument("--max-batch", type=positive_int, default=32, help="without --url")
    parser.add_argument(
        "--serve-gamma",
        type=gamma_setting,
        default=None,
        help="without --url: --gamma of serve (an integer, or 'auto': every row's γ chosen "
        "for the load); the speculative runs then use it unless --gamma is given "
        "(default: serve's own default)",
    )
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    parser.add_argument("--requests", type=positive_int, default=64, help="requests per level")
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="tokens per request")
    parser.add_argument("--draft", default=None, help="drafter of the speculative runs")
    parser.add_argument(
        "--gamma", type=positive_int, default=None, help="γ of the speculative runs"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    parser.add_argument(
        "--turns",
        type=positive_int,
        default=1,
        help="requests per conversation: each later one sends the conversation so far "
        "(with the server's replies) and a follow-up message; the report adds the later "
        "turns' TTFT and the share of their prompt the server found in its cache",
    )
    parser.add_argument(
        "--compare-plain",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run every level with drafting off",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="interleaved speculative/plain pairs per level (the speedup is their median)",
    )
    parser.add_argument("--prompts", type=Path, default=None, help="JSONL prompts (bench format)")
    parser.add_argument("--api-key", default=os.environ.get("SPECULATIVE_API_KEY"), help="key")
    add_json_flag(parser)
    parser.set_defaults(run=run)


def levels(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CliError(f"--concurrency wants integers like 1,8,32, got {text!r}") from None
    if not values or min(values) < 1:
        raise CliError(f"--concurrency levels must be >= 1, got {text!r}")
    return values


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(args: argparse.Namespace, port: int) -> list[str]:
    """The `speculative serve` command line bench-serve starts without --url."""
    command = [
        sys.executable, "-m", "speculative.cli.main", "serve", "--target", args.target,
        "--draft", args.serve_draft, "--max-batch", str(args.max_batch), "--port", str(port),
        "--log-level", "warning",
    ]  # fmt: skip
    if args.serve_gamma is not None:
        command += ["--gamma", str(args.serve_gamma)]
    return command


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(serve_command(args, port))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise CliError(f"the server exited with code {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return process, url
        except OSError:
            time.sleep(0.5)
    process.terminate()
    raise CliError("the server did not start within 600 s")


def row_line(summary: dict) -> str:
    return (
        f"c={summary['concurrency']:>3} draft={summary['draft'] or 'default':<8} "
        f"requests={summary['requests']} errors={summary['errors']} "
        f"TTFT p50 {summary['ttft_p50_s'] * 1000:.0f} ms "
        f"p99 {summary['ttft_p99_s'] * 1000:.0f} ms · "
        f"{summary['stream_tokens_per_s_mean']:.1f} tok/s per stream · "
        f"{summary['aggregate_tokens_per_s']:.1f} tok/s aggregate · "
        f"α {summary['alpha_mean'] or 0:.2f} τ {summary['tau_mean'] or 0:.2f}"
        + _turns_part(summary)
    )


def _turns_part(summary: dict) -> str:
    if "turns" not in summary:
        return ""
    return (
        f" · later turns: TTFT p50 {summary['ttft_p50_s_later_turns'] * 1000:.0f} ms "
        f"(first {summary['ttft_p50_s_first_turns'] * 1000:.0f} ms), "
        f"{summary['cached_share_later_turns']:.0%} of their prompt cached"
    )


def run(args: argparse.Namespace) -> int:
    from speculative.bench.prompts import load_prompts
    from speculative.bench.serve_load import LoadSpec, model_id, reset_prefix_cache, run_load

    concurrency = levels(args.concurrency)
    try:
        prompts = [p.to_dict() for p in load_prompts(args.prompts)]
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.url and args.serve_gamma is not None:
        raise CliError(
            "--serve-gamma sets γ on the server bench-serve starts; with --url, start that "
            "server with `speculative serve --gamma ...` (or send --gamma per request)"
        )
    process, url = (None, args.url) if args.url else start_server(args)
    results, speedups = [], []
    try:
        model = model_id(url, args.api_key)
        drafts = [args.draft, "none"] if args.compare_plain else [args.draft]
        for level in concurrency:
            for draft in drafts:  # first-use costs (cache growth, lazy set-up) out of the figures
                warm = LoadSpec(model, level, level, 4, draft=draft, api_key=args.api_key)
                run_load(url, warm, prompts)
            pairs = []
            for repeat in range(args.repeats):  # speculative and plain interleaved
                rates = []
                for draft in drafts:
                    spec = LoadSpec(
                        model, level, args.requests, args.max_tokens, args.temperature, draft,
                        args.gamma if draft != "none" else None, api_key=args.api_key,
                        turns=args.turns,
                    )  # fmt: skip
                    cold = reset_prefix_cache(url, args.api_key)  # no run finds the last one's
                    summary = run_load(url, spec, prompts).summary()
                    summary |= {"repeat": repeat, "cold_cache": cold}
                    results.append(summary)
                    rates.append(summary["aggregate_tokens_per_s"])
                    print(row_line(summary), file=sys.stderr, flush=True)
                if len(rates) == 2 and rates[1] > 0:
                    pairs.append(rates[0] / rates[1])
            if pairs:
                ratio = statistics.median(pairs)
                speedups.append({"concurrency": level, "median": ratio, "pairs": pairs})
                print(
                    f"c={level:>3} speculative ÷ plain aggregate throughput: {ratio:.2f}x "
                    f"(median of {len(pairs)} interleaved pairs: "
                    f"{', '.join(f'{p:.2f}' for p in pairs)})",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=30)
    if args.json:
        emit_json({"url": url, "results": results, "speedups": speedups})
    return 0
