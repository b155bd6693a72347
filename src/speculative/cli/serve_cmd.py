"""`speculative serve`: an OpenAI-compatible server over the batched engine."""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys

from speculative.cli.common import (
    CliError,
    Formatter,
    non_negative_int,
    port_number,
    positive_int,
)
from speculative.cli.generate_cmd import add_kv_cache_argument, add_max_context_argument
from speculative.cli.serve_ray import add_replica_arguments, serve_replicas, uses_ray

DESCRIPTION = """\
Serve a model over HTTP with an OpenAI-compatible API, decoding every request with
lossless speculative decoding in one continuous batch.

Endpoints:
  POST /v1/completions, /v1/chat/completions   (stream or not; SSE ending with [DONE])
  POST /v1/responses                            OpenAI's Responses API (typed events)
       GET/DELETE /v1/responses/{id}, .../input_items, POST .../cancel   kept responses
       /v1/conversations[/{id}[/items[/{item_id}]]]   OpenAI's Conversations API
  POST /v1/messages, /v1/messages/count_tokens  Anthropic's Messages API
  POST /v1/files, /v1/batches (GET, cancel, …)  OpenAI's Files and Batch APIs
  GET  /v1/models, /health
  POST /tokenize, /detokenize                   a prompt's tokens as a request counts them
  POST /reset_prefix_cache                      later requests find nothing cached
  GET  /metrics                                 Prometheus metrics
  GET  /                                        the playground (open it in a browser)

Per request, the extension object {"speculative": {"draft": NAME, "gamma": G}} picks one
of the drafters loaded here (--draft, comma-separated; the first is the default) or
"none" (plain decoding), and fixes γ. Each response has a "speculative" object with the
request's statistics (drafted, accepted, α, τ). Structured outputs (response_format,
vLLM's structured_outputs: a JSON schema, a regex, a choice or a Lark grammar), tools
(calls in the syntax the model's chat template teaches, valid by a grammar and streamed
as they are written: --tool-call-syntax), fill in the middle (completions' suffix, for
models with fill-in-the-middle tokens), logprobs, echo (prompt scoring: max_tokens 0),
penalties, logit_bias, n, best_of and seed are served exactly under speculation.

Security: binds 127.0.0.1 unless --host says otherwise (a warning when binding elsewhere
without --api-key); the key (or $SPECULATIVE_API_KEY) is compared in constant time;
bodies and prompts are size-limited; a request can never name a model or a file to load;
remote code from model repositories is never run. Idle connections close after
--timeout-keep-alive seconds.

Shutdown: SIGTERM or Ctrl-C stops taking connections and lets the requests in flight
finish (streams included) for up to --timeout-graceful-shutdown seconds, then cancels the
rest and exits: a rolling restart loses no reply that fits the grace period.
"""

# speculative.server.tools.SYNTAXES and "auto" (named here: importing the server is slow)
TOOL_CALL_SYNTAXES = ("auto", "hermes", "llama3_json", "mistral")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server with metrics and a playground",
        description=DESCRIPTION,
        formatter_class=Formatter,
    )
    parser.add_argument(
        "--target",
        default="default",
        help="target model: 'default' (SmolLM2-135M-Instruct), a folder or a .gguf",
    )
    parser.add_argument(
        "--draft",
        default="ngram",
        help="drafters to load, comma-separated (the first is the default): none, ngram, "
        "eagle, medusa, auto (n-gram or the EAGLE head per round), default, "
        "self-int4 / self-int8 / self-bf16, a draft model path",
    )
    parser.add_argument(
        "--gamma",
        type=gamma_setting,
        default="auto",
        help="'auto' (default): each round, every row's γ (up to 8, or the request's) is "
        "chosen for the load from the verify-cost curve measured at start, down to 0 when "
        "a draft no longer pays for its share; or a fixed γ per round (a request's default; "
        "a fixed γ keeps drafting under load, where it loses to plain decoding)",
    )
    parser.add_argument(
        "--precision", default="auto", help="target precision (auto, fp32, bf16, int8, int4)"
    )
    add_kv_cache_argument(parser)
    add_max_context_argument(parser)
    parser.add_argument(
        "--runtime",
        choices=["native", "hf"],
        default="native",
        help="native: one weight pass for every row's tokens (Llama family); hf: "
        "transformers, rows padded to the longest (any causal LM it loads)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument(
        "--port", type=port_number, default=8000, help="port to bind (0: any free port)"
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (default: $SPECULATIVE_API_KEY, else none)",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="model id (default: the target's)"
    )
    parser.add_argument("--max-batch", type=positive_int, default=8, help="rows decoded together")
    parser.add_argument(
        "--cache-slots",
        type=positive_int,
        default=None,
        metavar="N",
        help="KV cache slots (at least --max-batch): the rows decode in --max-batch of them "
        "and the rest keep finished requests' prompts and replies, the least recently used "
        "given up first, so a conversation's next request starts from them (native "
        "runtime; default 4 x --max-batch, at most 32; each slot holds up to the context "
        "window, its memory used as it fills)",
    )
    parser.add_argument(
        "--max-waiting", type=positive_int, default=256, help="queued requests before 503s"
    )
    parser.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help="which waiting request a free batch row takes: fcfs, the first to arrive; "
        "priority, the lowest value of the requests' priority field (vLLM's), ties by "
        "arrival (rows already decoding are not preempted)",
    )
    parser.add_argument(
        "--tool-call-syntax",
        choices=TOOL_CALL_SYNTAXES,
        default="auto",
        help="how the model writes function calls: hermes (<tool_call>{...}</tool_call> "
        "after its text: Qwen, Hermes), llama3_json (a reply of JSON calls joined by '; ': "
        "Llama 3.1-3.3), mistral ([TOOL_CALLS] and a JSON list of calls: Mistral 7B v0.3, "
        "Nemo, Small); auto: what the chat template teaches (hermes for templates without "
        "tools, which get them described)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=["auto", "think", "none"],
        default="auto",
        help="think: a chat reply's <think>...</think> block goes out as reasoning_content "
        "and the rest as content (Qwen3, DeepSeek-R1); auto: when the chat template "
        "speaks of </think>; none: all of it as content",
    )
    parser.add_argument(
        "--responses-store",
        type=non_negative_int,
        default=1000,
        metavar="N",
        help="Responses API answers kept in memory for previous_response_id, GET "
        "/v1/responses/{id} and background requests (the N most recently used; 0: none; "
        "with --replicas, shared by the replicas)",
    )
    parser.add_argument(
        "--files-store-bytes",
        type=positive_int,
        default=256 << 20,
        metavar="N",
        help="bytes of files kept in memory for the Batch API (uploads and batches' output)",
    )
    parser.add_argument(
        "--max-body-bytes", type=positive_int, default=1 << 20, help="largest request body"
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        default=None,
        help="longest prompt in tokens (default: the context window - 1)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=positive_int,
        default=256,
        help="max_tokens when a request gives none",
    )
    parser.add_argument(
        "--timeout-keep-alive", type=positive_int, default=5, help="idle connection timeout (s)"
    )
    parser.add_argument(
        "--timeout-graceful-shutdown",
        type=positive_int,
        default=30,
        help="on SIGTERM or Ctrl-C: seconds the requests in flight may take to finish",
    )
    parser.add_argument("--log-level", default="info", help="uvicorn log level")
    add_replica_arguments(parser)
    parser.set_defaults(run=run)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, taken before the model loads: a port in use or an
    address this machine does not have fails at once, with the reason, not after a
    minute of loading; port 0 gets a free port whose number can then be printed."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise CliError(f"cannot resolve --host {host!r}: {exc.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        hint = " (another server is on it; pick another --port, or 0 for any)"
        why = f"{exc.strerror}{hint if exc.errno == errno.EADDRINUSE else ''}"
        raise CliError(f"cannot listen on {host}:{port}: {why}") from None
    return sock


def gamma_setting(text: str) -> int | str:
    """The project's one γ parser; serving takes an integer or "auto" (load-aware per row)."""
    from speculative.engine.gamma import parse_gamma

    try:
        gamma = parse_gamma(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if gamma == "heuristic":
        raise argparse.ArgumentTypeError(
            "serve takes an integer γ or 'auto' (chosen per row for the load); 'heuristic' "
            "is a single-stream schedule"
        )
    return gamma


def build_config(args: argparse.Namespace):
    from speculative.server.state import ServerConfig

    drafts = tuple(d.strip() for d in args.draft.split(",") if d.strip())
    return ServerConfig(
        target=args.target,
        drafts=drafts,
        gamma=args.gamma,
        precision=args.precision,
        kv_cache=args.kv_cache,
        max_context=args.max_context,
        runtime=args.runtime,
        max_batch=args.max_batch,
        cache_slots=args.cache_slots,
        served_model_name=args.served_model_name,
        api_key=args.api_key or os.environ.get("SPECULATIVE_API_KEY") or None,
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        default_max_tokens=args.default_max_tokens,
        max_waiting=args.max_waiting,
        scheduling_policy=args.scheduling_policy,
        tool_call_syntax=args.tool_call_syntax,
        reasoning_parser=args.reasoning_parser,
        responses_stored=args.responses_store,
        files_store_bytes=args.files_store_bytes,
        replicas=args.replicas,
    )


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from speculative.server import create_app, load_state

    config = build_config(args)
    try:
        config.check()
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if not is_loopback(args.host) and not config.api_key:
        print(
            f"speculative: warning: binding {args.host} without an API key: anyone who can "
            "reach this port can use the model (give --api-key)",
            file=sys.stderr,
        )
    if uses_ray(args):
        return serve_replicas(args, config)
    sock = listening_socket(args.host, args.port)
    print(
        f"speculative: loading {config.target} with drafters {', '.join(config.drafts)}",
        file=sys.stderr,
    )
    with sock:
        state = load_state(config)
        app = create_app(state)
        sock.listen(2048)  # connections queue from the banner on, until the server takes them
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        window = state.context_window
        print(
            f"speculative: serving '{state.model_id}' on http://{shown}:{port} "
            f"(playground at /, metrics at /metrics; {config.max_batch} rows at once, "
            f"{config.slots()} cache slots"
            + (f" of {window} positions" if window else "")
            + ": finished conversations stay in the free ones)",
            file=sys.stderr,
        )
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level=args.log_level,
                timeout_keep_alive=args.timeout_keep_alive,
                timeout_graceful_shutdown=args.timeout_graceful_shutdown,
                access_log=False,
            )
        )
        server.run(sockets=[sock])
    return 0
