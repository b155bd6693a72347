"""What a server holds: the loaded target, the drafters named at startup, the limits.

:class:`ServerState` is built once (:func:`load_state`) and handed to
:func:`~speculative.server.app.create_app`; nothing in a request can make it load a model
or read a path. Drafters keep per-row state, so every row gets its own instance from a
:class:`DrafterPool`: instances are built through the drafter registry on first need and
reused by later requests (a draft model is loaded at most once per concurrent row, never
per request).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

from speculative.capabilities import provides
from speculative.drafters.base import Drafter
from speculative.engine.costs import PassCostCurves
from speculative.engine.gamma import LOAD_AWARE_MAX_GAMMA
from speculative.models.base import ReservesSlots, SupportsBatchRows
from speculative.server.compute import ComputeThread
from speculative.server.reasoning import special_think_tags, template_thinks
from speculative.server.text import decode_keeping
from speculative.server.tools import (
    HERMES,
    SYNTAXES,
    CallSyntax,
    call_syntax,
    template_shows_tools,
)
from speculative.targets import LoadedModel

NONE = "none"


@dataclass(frozen=True)
class ServerConfig:
    """Everything a server needs besides the loaded models."""

    target: str = "default"
    drafts: tuple[str, ...] = ("ngram",)  # the first is the default drafter
    gamma: int | str = "auto"  # per-row γ chosen for the load (LoadAwareGamma), or fixed
    runtime: str = "native"
    precision: str = "auto"
    kv_cache: str = "auto"  # the native runtime's KV cache (see load_target)
    max_context: int | None = None  # the context window (None: the model's own)
    max_batch: int = 8
    # cache slots: rows decode in max_batch of them, and the rest keep finished rows'
    # prompts and replies for a conversation's next request (None: 4 × max_batch, at most
    # 32, at least max_batch)
    cache_slots: int | None = None
    served_model_name: str | None = None  # default: the target's name
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # default: the context window - 1
    default_max_tokens: int = 256
    max_waiting: int = 256  # requests queued beyond the batch before 503s
    scheduling_policy: str = "fcfs"  # "priority": waiting requests by their priority field
    tool_call_syntax: str = "auto"  # how the model writes calls (auto: from its template)
    reasoning_parser: str = "auto"  # "think": split <think>…</think>; auto: if the template has it
    responses_stored: int = 1000  # Responses API answers kept (previous_response_id, GET); 0: none
    replicas: int = 1  # copies of this server behind one endpoint
    files_store_bytes: int = 256 << 20  # uploaded and batch output files kept, in all

    def slots(self) -> int:
        """The target's cache slots: ``cache_slots``, or its default."""
        if self.cache_slots is not None:
            return self.cache_slots
        return max(self.max_batch, min(4 * self.max_batch, 32))

    def check(self) -> None:
        if self.gamma != "auto" and (not isinstance(self.gamma, int) or self.gamma < 1):
            raise ValueError(f"gamma must be an integer >= 1 or 'auto', got {self.gamma!r}")
        if self.responses_stored < 0:
            raise ValueError(f"responses kept must be >= 0, got {self.responses_stored}")
        if self.max_batch < 1:
            raise ValueError(f"max batch must be >= 1, got {self.max_batch}")
        if self.cache_slots is not None and self.cache_slots < self.max_batch:
            raise ValueError(
                f"cache slots ({self.cache_slots}) must be at least max batch ({self.max_batch})"
            )
        if not self.drafts:
            raise ValueError("give at least one drafter (or 'none')")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"unknown scheduling policy {self.scheduling_policy!r} (fcfs, priority)"
            )
        if self.reasoning_parser not in ("auto", "think", "none"):
            raise ValueError(
                f"unknown reasoning parser {self.reasoning_parser!r} (auto, think, none)"
            )
        if self.tool_call_syntax != "auto" and self.tool_call_syntax not in SYNTAXES:
            known = ", ".join(["auto", *SYNTAXES])
            raise ValueError(f"unknown tool call syntax {self.tool_call_syntax!r} ({known})")


def servable(name: str, drafter: Drafter | None, lm: object) -> None:
    """Refuse, with the reason, a drafter the server cannot run per row: one that reads
    the target's features, on a target whose batched pass gives none."""
    from speculative.drafters.base import ReadsTargetFeatures
    from speculative.models.base import SupportsBatchRowFeatures

    if isinstance(drafter, ReadsTargetFeatures) and not isinstance(lm, SupportsBatchRowFeatures):
        raise ValueError(
            f"the '{name}' drafter reads the target's hidden features, which this target's "
            "batched pass does not give; serve with ngram, self-int4 (or another "
            "self-<precision>) or a draft model path"
        )


class DrafterPool:
    """Instances of one drafter, each used by one row at a time."""

    def __init__(self, name: str, build: Callable[[], Drafter | None]) -> None:
        self.name = name
        self._build = build
        self._free: list[Drafter] = []
        self._lock = threading.Lock()
        self.built = 0

    def acquire(self) -> Drafter | None:
        with self._lock:
            if self._free:
                return self._free.pop()
        drafter = self._build()
        with self._lock:
            self.built += 1
        return drafter

    def release(self, drafter: Drafter | None) -> None:
        if drafter is not None:
            with self._lock:
                self._free.append(drafter)


@dataclass
class ServerState:
    """The loaded target, its drafter pools, and the server's settings."""

    config: ServerConfig
    loaded: LoadedModel
    pools: dict[str, DrafterPool] = field(default_factory=dict)
    pass_costs: PassCostCurves | None = None  # measured for γ "auto": its policy's input
    # the thread that loaded the target and runs its rounds (None: the scheduler's own)
    compute: ComputeThread | None = None
    shows_tools: bool | None = None  # whether the chat template shows tools (None: ask)
    call_syntax: CallSyntax = HERMES  # how the model writes function calls
    reasons: bool = False  # a reply's <think> block goes out as its reasoning_content
    # a reply's text from its tokens (the model's decode; with reasons, its thinking
    # tags kept where they are special tokens); None: loaded.decode
    reply_decode: Callable[[Sequence[int]], str] | None = None

    def decode_reply(self, token_ids: Sequence[int]) -> str:
        return (self.reply_decode or self.loaded.decode)(token_ids)

    @property
    def row_gamma(self) -> int:
        """A request's γ when it gives none (with "auto": the cap the policy works under)."""
        gamma = self.config.gamma
        return LOAD_AWARE_MAX_GAMMA if gamma == "auto" else int(gamma)

    @property
    def model_id(self) -> str:
        return self.config.served_model_name or self.loaded.name

    @property
    def default_draft(self) -> str:
        return self.config.drafts[0]

    @property
    def context_window(self) -> int | None:
        return self.loaded.lm.max_length

    @property
    def max_prompt_tokens(self) -> int:
        window = self.context_window
        limit = self.config.max_prompt_tokens
        if window is not None:
            limit = window - 1 if limit is None else min(limit, window - 1)
        return limit if limit is not None else 1 << 30

    def drafter_names(self) -> list[str]:
        names = list(self.config.drafts)
        return names if NONE in names else [*names, NONE]


def reserve_slots(lm: SupportsBatchRows, count: int) -> None:
    """Grow the target's cache to ``count`` rows now (once, at startup: not while serving,
    where each new slot would reallocate the cache), and fail early if it cannot."""
    slots = []
    try:
        if provides(lm, ReservesSlots):  # in one allocation
            cast(ReservesSlots, lm).reserve_slots(count)
        for _ in range(count):
            slots.append(lm.acquire_slot())
    except ValueError as exc:
        raise ValueError(f"{count} cache slots do not fit the target's cache: {exc}") from None
    finally:
        for slot in slots:
            lm.release_slot(slot)


def build_state(config: ServerConfig, loaded: LoadedModel) -> ServerState:
    """A state over an already loaded target: checks it can batch, warms one instance of
    each drafter (so a bad drafter name fails at startup, not in a request)."""
    from speculative.drafters.registry import build_drafter

    config.check()
    if not isinstance(loaded.lm, SupportsBatchRows):
        raise ValueError(
            f"serving needs a target that holds several sequences (native or hf runtime); "
            f"'{loaded.name}' on the {loaded.runtime} runtime cannot"
        )
    reserve_slots(loaded.lm, config.slots())
    tokenizer = loaded.tokenizer
    state = ServerState(
        config,
        loaded,
        shows_tools=template_shows_tools(tokenizer),
        call_syntax=call_syntax(config.tool_call_syntax, tokenizer),
        reasons=config.reasoning_parser == "think"
        or (config.reasoning_parser == "auto" and template_thinks(tokenizer)),
    )
    tags = special_think_tags(tokenizer) if state.reasons else frozenset()
    tags |= state.call_syntax.special_ids
    if tags:  # decoding would leave them out
        state.reply_decode = decode_keeping(tokenizer, tags)
    if config.gamma == "auto":  # the pass-cost curves the load-aware policy needs
        from speculative.engine.costs import pass_cost_curves, probe_context

        context = probe_context(loaded.lm.vocab_size)
        max_tokens = config.max_batch * (LOAD_AWARE_MAX_GAMMA + 1)
        state.pass_costs = pass_cost_curves(loaded.lm, context, config.max_batch, max_tokens, 2)
    for name in config.drafts:
        if name == NONE:
            continue
        pool = DrafterPool(name, lambda name=name: build_drafter(name, loaded))
        drafter = pool.acquire()
        servable(name, drafter, loaded.lm)
        pool.release(drafter)
        state.pools[name] = pool
    return state


def load_state(config: ServerConfig, compute: ComputeThread | None = None) -> ServerState:
    """Load the target named in ``config`` and build the state, on ``compute`` (a new
    :class:`ComputeThread` when None), the thread that will also run its rounds."""
    from speculative.targets import load_target_of

    config.check()  # before loading anything
    compute = compute or ComputeThread()

    def load() -> ServerState:
        loaded = load_target_of(config)
        return build_state(config, loaded)

    state = compute.call(load)
    state.compute = compute
    return state
