"""The FastAPI app: OpenAI-compatible endpoints, metrics, the playground.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as SSE in
OpenAI's chunk format, ending with ``data: [DONE]``), ``POST /v1/messages`` (Anthropic's
Messages API, :mod:`speculative.server.anthropic`), ``POST /v1/responses`` and its
stored responses and conversations (their routes in :mod:`speculative.server.kept_routes`),
``GET /v1/models``, ``GET /health``, ``POST /tokenize``, ``/detokenize``,
``/reset_prefix_cache``, ``GET /metrics`` (Prometheus), ``GET /`` (the playground page).
HTTP plumbing (errors, the API key, bodies, SSE) is :mod:`speculative.server.http`.

Every response carries a ``speculative`` object with that request's statistics (drafted,
accepted, α, τ, ...); streamed chunks carry ``speculative.pieces``: the chunk's text as
``[text, kind]`` per token, kind one of accepted / recovered / bonus / target.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol

import torch
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import ValidationError

from speculative.drafters.prediction import PredictionDrafter
from speculative.engine.batch import BatchEngine, BatchRequest
from speculative.engine.gamma import LoadAwareGamma
from speculative.engine.loop import GenerationResult, Round
from speculative.engine.stats import GenerationStats
from speculative.engine.stopping import find_stop, openai_finish_reason
from speculative.sampling import SamplingParams
from speculative.sampling.constraints import TokenConstraint
from speculative.server.anthropic import MessagesAnswer, MessagesRequest
from speculative.server.batches import Batches, FileStore
from speculative.server.http import (
    SSE_HEADERS,
    CancellingStream,
    authorize,
    install_error_handlers,
    parsed,
    read_json,
    sse,
    sse_events,
    validated,
)
from speculative.server.kept_routes import (
    install_conversations,
    install_files_and_batches,
    install_stored_responses,
)
from speculative.server.logprobs import LogprobsFormatter, echoed_prompt, joined
from speculative.server.metrics import CONTENT_TYPE, ServerMetrics
from speculative.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    validation_error,
)
from speculative.server.reasoning import ReasoningStream, opens_thinking, split_reasoning
from speculative.server.responses import (
    InputItem,
    ResponsesAnswer,
    ResponsesRequest,
    chat_error_param,
    new_id,
    response_object,
    truncations,
)
from speculative.server.scheduler import (
    DoneEvent,
    ErrorEvent,
    Event,
    Job,
    RoundEvent,
    Scheduler,
)
from speculative.server.state import NONE, ServerState
from speculative.server.stored import (
    EventLog,
    ResponseRecords,
    ResponseStore,
    StoredResponse,
)
from speculative.server.text import TextAssembler, token_kinds
from speculative.server.tools import (
    HERMES,
    CallStream,
    CallSyntax,
    Reply,
    Tool,
    chat_prompt,
    split_calls,
)

if TYPE_CHECKING:
    from speculative.targets import TemplateOptions

SEED_RANGE = 2**63  # seeds drawn for requests without one lie below it
DISCONNECT_POLL_SECONDS = 0.25


class Answer(Protocol):
    """How a request that came in another API than chat's is answered from chat's answer
    (:class:`~speculative.server.responses.ResponsesAnswer`,
    :class:`~speculative.server.anthropic.MessagesAnswer`)."""

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        """A whole chat completion as that API's answer."""
        ...

    def events(self) -> Any:
        """A translator of chat stream chunks into that API's events (``start()``,
        ``feed(chunk)``, ``end()``, each a list of events)."""
        ...


@dataclass
class Prepared:
    """A validated request, ready for the scheduler: its prompts (completions may give
    several) and, per prompt, the engine request of its first choice."""

    # "completions", "chat", or "responses" / "messages" (a chat request, answered in
    # the Responses API / Anthropic's Messages API)
    endpoint: str
    body: CompletionRequest | ChatCompletionRequest
    prompts: list[list[int]]  # token ids of each prompt
    batch_requests: list[BatchRequest]  # per prompt; its choice j samples with seed + j
    draft: str
    gamma: int
    acquire: Callable[[], Any] | None  # the row's drafter instance, taken at admission
    release: Callable[[Any], None] | None
    seed: int = 0
    # a fresh constraint for each choice's row (response_format), or None
    constraints: Callable[[], TokenConstraint] | None = None
    echoes: list[str] = field(default_factory=list)  # per prompt: its echoed text, or ""
    call_syntax: CallSyntax = HERMES  # how the model writes function calls
    prediction: list[int] | None = None  # the predicted output's tokens (drafted from)
    # (accepted, rejected) prediction tokens of each row, as its drafter is given back
    predicted: list[tuple[int, int]] = field(default_factory=list)
    responses: ResponsesRequest | None = None  # the Responses API request it came as
    # how the answer is given where the request came in another API than chat's (the
    # Responses API, Anthropic's Messages): whole, or as that API's stream events
    answer: Answer | None = None
    response_id: str | None = None  # a Responses request's answer's id
    # a Responses request's input items (earlier turns' first), kept with its answer
    input_items: list[dict[str, Any]] = field(default_factory=list)
    keep: Callable[[StoredResponse], Awaitable[None]] | None = None  # keeps the answer, if asked
    join: Callable[[dict[str, Any]], Awaitable[None]] | None = None  # adds it to its conversation
    # where the reply's thinking is split from its answer: whether the prompt opened the
    # thinking block (None: no split)
    thinking: bool | None = None

    async def settle(self, body: dict[str, Any]) -> None:
        """What a Responses request's whole answer leaves: the response kept (where
        asked) and its turn added to its conversation (where it continued one)."""
        if self.keep is not None:
            await self.keep(StoredResponse(body, self.input_items))
        if self.join is not None:
            await self.join(body)

    def drafter_hooks(
        self, request: BatchRequest
    ) -> tuple[Callable[[], Any] | None, Callable[[Any], None] | None]:
        """How a row takes its drafter and gives it back: from the pool of the drafter
        the request names, or, with a prediction, one that drafts from it (its counts
        kept for ``usage``)."""
        if self.prediction is None:
            return self.acquire, self.release
        prediction, prompt_length = self.prediction, len(request.prompt_ids)

        def acquire() -> PredictionDrafter:
            return PredictionDrafter(prediction, prompt_length)

        def release(drafter: PredictionDrafter) -> None:
            self.predicted.append((drafter.accepted, drafter.rejected))

        return acquire, release

    def prompt_of(self, choice: int) -> int:
        """Which prompt choice ``choice`` answers (choices: prompt by prompt, n each)."""
        return choice // self.body.n

    def ranks_candidates(self) -> bool:
        """Whether more rows are sampled than returned (``best_of`` above ``n``)."""
        return self.body.candidates() > self.body.n

    def echo(self, choice: int) -> str:
        """The text choice ``choice`` starts with: its prompt, echoed (completions'
        ``echo``), or ""."""
        return self.echoes[self.prompt_of(choice)] if self.echoes else ""

    def echoed_logprobs(
        self, choice: int, decode: Callable, result: Round | GenerationResult
    ) -> Any:
        """The echoed prompt's log-probabilities (completions' shape), where asked for:
        from a choice's result or its first round."""
        if not self.echoes or self.endpoint != "completions":
            return None
        ids = self.prompts[self.prompt_of(choice)]
        return echoed_prompt(decode, ids, result.prompt_logprobs)

    def choice_requests(self) -> list[BatchRequest]:
        """One engine request per row (``n`` per prompt, or ``best_of``), each with its
        own generator: a prompt's row j is the sample a request with that prompt and
        seed + j gets alone. Rows that are ranked report their tokens' log-probabilities
        (the ranking reads them; the response shows them only where asked)."""
        make = self.constraints
        ranked = self.ranks_candidates() and self.body.wanted_logprobs() is None
        return [
            replace(
                request,
                generator=torch.Generator().manual_seed((self.seed + j) % SEED_RANGE),
                constraint=None if make is None else make(),
                logprobs=0 if ranked else request.logprobs,
            )
            for request in self.batch_requests
            for j in range(self.body.candidates())
        ]

    def best(self, results: list[GenerationResult]) -> list[GenerationResult]:
        """Per prompt, the ``n`` of its ``best_of`` results with the highest mean
        log-probability per token (OpenAI's ``best_of``; ties keep the seed order), in
        that order; all of them where nothing is ranked."""
        if not self.ranks_candidates():
            return results
        each, n = self.body.candidates(), self.body.n
        chosen = []
        for start in range(0, len(results), each):
            group = results[start : start + each]
            chosen += sorted(group, key=_mean_logprob, reverse=True)[:n]
        return chosen


def create_app(state: ServerState, records: ResponseRecords | None = None) -> FastAPI:
    """The app over an already loaded :class:`ServerState` (one batched engine, one
    scheduler thread, one metrics registry per app); ``records``: where its Responses
    answers are kept (None: in its own memory; replicas share one Ray actor's)."""
    metrics = ServerMetrics()
    costs = state.pass_costs
    load = None if costs is None else LoadAwareGamma(costs.tokens, rows_cost=costs.rows)
    engine = BatchEngine(state.loaded.lm, max_batch=state.config.max_batch, load=load)
    scheduler = Scheduler(
        engine, metrics, state.config.max_waiting, compute=state.compute,
        by_priority=state.config.scheduling_policy == "priority",
    )  # fmt: skip
    metrics.attach(scheduler)
    store = ResponseStore(state.config.responses_stored, state.config.replicas, records)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="speculative", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.server = state
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.state.responses = store
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/", response_class=HTMLResponse)
    async def playground() -> HTMLResponse:
        page = resources.files("speculative.server").joinpath("static/playground.html")
        return HTMLResponse(page.read_text(encoding="utf-8"))

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        authorize(request, state)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request, state)
        return {"object": "list", "data": [_model_card(state)]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        authorize(request, state)
        body = await parsed(request, TokenizeRequest, state)
        return _tokenized(body, state)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> dict[str, bool]:
        """vLLM's: later requests find no finished request's prompt or reply in the cache
        (a cold cache for benchmarks); requests in flight keep theirs."""
        authorize(request, state)
        scheduler.start()
        done = scheduler.reset_prefix_cache()
        if not await asyncio.to_thread(done.wait, 60):
            raise ApiError(503, "the scheduler did not answer in 60 s", "server_error")
        return {"reset": True}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        authorize(request, state)
        body = await parsed(request, DetokenizeRequest, state)
        _check_vocabulary(body.tokens, state, "tokens")
        return {"prompt": state.loaded.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(request, "completions", state, scheduler, metrics, store)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(request, "chat", state, scheduler, metrics, store)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await _serve(request, "responses", state, scheduler, metrics, store)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API (:mod:`speculative.server.anthropic`)."""
        return await _serve(request, "messages", state, scheduler, metrics, store)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        """Anthropic's: the prompt's tokens as a Messages request would count them."""
        authorize(request, state)
        asked = await parsed(request, MessagesRequest, state)
        return {"input_tokens": len(_prompt_ids(_chat_of(asked.chat_request()), state)[0])}

    install_stored_responses(app, state, store)
    install_conversations(app, state, store.conversations)
    files = FileStore(state.config.files_store_bytes, state.config.replicas)

    async def answer(endpoint: str, payload: dict[str, Any]) -> dict[str, Any]:
        return await _whole_answer(endpoint, payload, state, scheduler, metrics, store)

    batches = Batches(files, answer, concurrency=max(1, state.config.max_batch // 2))
    install_files_and_batches(app, state, files, batches)
    return app


# ---- requests -----------------------------------------------------------------------
async def _serve(
    request: Request,
    endpoint: str,
    state: ServerState,
    scheduler: Scheduler,
    metrics: ServerMetrics,
    store: ResponseStore,
) -> Response:
    try:
        authorize(request, state)
        prepared = await _prepare(request, endpoint, state, store)
    except ApiError as exc:
        metrics.count_request(endpoint, str(exc.status))
        if endpoint == "responses":  # the field as the Responses request named it
            exc.param = chat_error_param(exc.param)
        raise
    jobs = _submit(prepared, scheduler, metrics)
    if prepared.responses is not None and prepared.responses.background:
        return await _start_background(prepared, jobs, state, scheduler, metrics, store)
    if prepared.body.stream:
        return CancellingStream(
            _stream(prepared, jobs, state, metrics),
            on_close=lambda: _cancel_unfinished(jobs, prepared.endpoint, scheduler, metrics),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    return await _complete(request, prepared, jobs, state, scheduler, metrics)


def _submit(prepared: Prepared, scheduler: Scheduler, metrics: ServerMetrics) -> list[Job]:
    """Queue a prepared request's rows (one per choice); 503 when the queue is full."""
    loop = asyncio.get_running_loop()
    jobs = []
    for choice in prepared.choice_requests():
        acquire, release = prepared.drafter_hooks(choice)
        jobs.append(Job(choice, loop, on_release=release, acquire=acquire,
                        priority=prepared.body.priority))  # fmt: skip
    try:
        scheduler.start()
        for job in jobs:
            scheduler.submit(job)
    except ValueError as exc:  # no drafter was taken yet: the scheduler takes it on admission
        for job in jobs:
            scheduler.cancel(job)
        metrics.count_request(prepared.endpoint, "503")
        raise ApiError(503, str(exc), "server_error", code="overloaded") from None
    return jobs


async def _whole_answer(
    endpoint: str,
    payload: dict[str, Any],
    state: ServerState,
    scheduler: Scheduler,
    metrics: ServerMetrics,
    store: ResponseStore,
) -> dict[str, Any]:
    """A request's whole answer, decoded as the same request sent alone would be (a batch
    line's; streams and background responses are refused)."""
    if payload.get("stream") or payload.get("background"):
        raise ApiError(400, "a batch request is answered whole (no stream or background)",
                       param="stream")  # fmt: skip
    prepared = await prepare_payload(payload, endpoint, state, store)
    jobs = _submit(prepared, scheduler, metrics)
    try:
        body = await _whole_body(prepared, jobs, state, scheduler, metrics, None)
    except asyncio.CancelledError:  # the batch was cancelled: its rows leave the batch
        _cancel_unfinished(jobs, prepared.endpoint, scheduler, metrics)
        raise
    assert body is not None
    await prepared.settle(body)
    return body


def _tokenized(body: TokenizeRequest, state: ServerState) -> dict[str, Any]:
    """``/tokenize``'s answer: the prompt's tokens as a request would count them."""
    from speculative.targets import encode_prompt

    tokenizer = state.loaded.tokenizer
    try:
        if body.messages is not None:
            messages = [message.for_template() for message in body.messages]
            tokens = _chat_ids(state, messages, body.tools, body.template_options())
        else:
            assert body.prompt is not None
            tokens = encode_prompt(tokenizer, body.prompt, None, chat=False)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="messages" if body.messages else "prompt") from None
    return {"count": len(tokens), "max_model_len": state.context_window, "tokens": tokens}


def _chat_ids(
    state: ServerState,
    messages: list[dict[str, Any]],
    tools: list[Tool] | None,
    template: TemplateOptions,
) -> list[int]:
    """A chat's prompt tokens as this server renders them (its template's way with tools,
    its call syntax): what a request and ``/tokenize`` both count."""
    return chat_prompt(
        state.loaded.tokenizer, messages, tools, state.shows_tools, state.call_syntax, template
    )


def _check_vocabulary(ids: Sequence[int], state: ServerState, param: str) -> None:
    """400 (naming ``param``) for a token id outside the model's vocabulary."""
    vocab = state.loaded.lm.vocab_size
    beyond = [token for token in ids if token >= vocab]
    if beyond:
        raise ApiError(
            400, f"{param} holds token {beyond[0]}; this model's vocabulary has {vocab}",
            param=param,
        )  # fmt: skip


async def _prepare(
    request: Request, endpoint: str, state: ServerState, store: ResponseStore
) -> Prepared:
    payload = await read_json(request, state.config.max_body_bytes)
    return await prepare_payload(payload, endpoint, state, store)


async def prepare_payload(
    payload: Any, endpoint: str, state: ServerState, store: ResponseStore
) -> Prepared:
    """A request's JSON body, validated and ready for the scheduler (400s for what it
    cannot be)."""
    responses, answer, conversation = None, None, []
    if endpoint == "messages":  # Anthropic's
        asked = validated(payload, MessagesRequest)
        if asked.max_tokens is None:
            raise ApiError(400, "max_tokens is required", param="max_tokens")
        answer = MessagesAnswer(asked)
        body: CompletionRequest | ChatCompletionRequest = _chat_of(asked.chat_request())
    elif endpoint == "responses":
        responses = validated(payload, ResponsesRequest)
        if not store.enabled:  # what is reported: nothing is kept
            if responses.background:
                raise ApiError(
                    400, "a background response is kept until polled, and this server "
                    "keeps no responses (serve --responses-store 0)", param="background",
                )  # fmt: skip
            responses.store = False
        conversation_id = responses.conversation_id()
        if conversation_id is not None and responses.previous_response_id is not None:
            raise ApiError(
                400, "previous_response_id cannot be used with conversation (the "
                "conversation holds the earlier turns)", param="previous_response_id",
            )  # fmt: skip
        if conversation_id is not None:
            conversation = await store.conversations.items(conversation_id, "conversation")
        if responses.previous_response_id is not None:
            earlier = await store.get(responses.previous_response_id, "previous_response_id")
            if earlier.running:
                raise ApiError(
                    400, f"response '{responses.previous_response_id}' is still decoding",
                    param="previous_response_id",
                )  # fmt: skip
            conversation = earlier.conversation()
        history = [InputItem.model_validate(item) for item in conversation]
        body = _chat_of(responses.chat_request(history))
    else:
        model = CompletionRequest if endpoint == "completions" else ChatCompletionRequest
        body = validated(payload, model)
    if body.priority and state.config.scheduling_policy != "priority":
        raise ApiError(
            400, "priority orders requests only under serve --scheduling-policy priority",
            param="priority",
        )  # fmt: skip
    if body.model != state.model_id:
        raise ApiError(
            404,
            f"the model '{body.model}' does not exist; this server serves '{state.model_id}'",
            param="model",
            code="model_not_found",
        )
    if responses is not None and responses.truncation == "auto":
        body, prompts, max_tokens, kept = _fitting(responses, history, state)
        kept_ids = {id(item) for item in kept}  # what is kept is what the model saw
        conversation = [raw for raw, item in zip(conversation, history, strict=True)
                        if id(item) in kept_ids]  # fmt: skip
    else:
        prompts = _prompt_ids(body, state)
        max_tokens = _max_tokens(body, max(len(ids) for ids in prompts), state)
    vocab = state.loaded.lm.vocab_size
    for param, tokens in (("logit_bias", body.logit_bias), ("stop_token_ids", body.stop_token_ids)):
        beyond = [t for t in tokens or () if int(t) >= vocab]
        if beyond:
            raise ApiError(
                400, f"{param} names token {beyond[0]}; this model's vocabulary has {vocab}",
                param=param,
            )  # fmt: skip
    draft, gamma = _speculation(body, state)
    constraints = _constraints(body, state)
    params = SamplingParams(
        temperature=body.temperature, top_p=body.top_p, top_k=max(0, body.top_k),
        min_p=body.min_p,
    )  # fmt: skip
    criteria = state.loaded.stop_criteria(
        max_tokens, body.stop_strings(), body.ignore_eos, body.stop_tokens(), body.min_tokens
    )
    seed = body.seed if body.seed is not None else secrets.randbits(63)  # < SEED_RANGE
    generator = torch.Generator().manual_seed(seed)
    pool = state.pools.get(draft)
    extras = {
        "logprobs": body.wanted_logprobs(),
        "penalties": body.penalties(criteria.eos_token_ids),
        "prompt_logprobs": body.wanted_prompt_logprobs(),
    }
    requests = [
        BatchRequest(ids, params, criteria, generator, None, gamma, **extras) for ids in prompts
    ]
    # the scheduler takes the row's drafter when it admits the row, on its own thread
    # (building one may start OpenMP work: see speculative.server.compute)
    acquire = pool.acquire if pool is not None else None
    release = pool.release if pool is not None else None
    echoes = _echoes(body, prompts, state) if body.echoes_prompt() else []
    if isinstance(body, ChatCompletionRequest) and body.echoed_message():
        echoes = [body.echoed_message()]  # vLLM's chat echo: the begun assistant message
    prediction = None
    if body.prediction is not None:  # its rows draft from it, whatever the request named
        text = body.prediction.text()
        prediction = state.loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
        draft = "prediction"
    thinking = None
    if state.reasons and isinstance(body, ChatCompletionRequest):
        thinking = opens_thinking(state.decode_reply(prompts[0]))
    prepared = Prepared(
        endpoint, body, prompts, requests, draft, gamma, acquire, release, seed,
        constraints, echoes, state.call_syntax, prediction, responses=responses,
        thinking=thinking,
    )  # fmt: skip
    prepared.answer = answer
    if responses is not None:
        prepared.response_id = new_id("resp")
        prepared.answer = ResponsesAnswer(responses, prepared.response_id)
        own = [item.stored() for item in responses.input_items()]
        prepared.input_items = [*conversation, *own]
        if responses.store:
            prepared.keep = store.put
        if responses.conversation_id() is not None:
            prepared.join = _joiner(responses.conversation_id(), own, store)
    return prepared


def _joiner(
    conversation_id: str, own: list[dict[str, Any]], store: ResponseStore
) -> Callable[[dict[str, Any]], Awaitable[None]]:
    """What adds a response's turn (its own input items, then its output items) to the
    conversation it continued, once it has an answer (nothing if it failed or was
    cancelled, or the conversation was deleted meanwhile)."""

    async def join(body: dict[str, Any]) -> None:
        if body["status"] in ("completed", "incomplete"):
            await store.conversations.append(conversation_id, [*own, *body["output"]])

    return join


def _fitting(
    responses: ResponsesRequest, history: list[InputItem], state: ServerState
) -> tuple[ChatCompletionRequest, list[list[int]], int, list[InputItem]]:
    """``truncation: "auto"``: the chat request (its prompt and token budget) after the
    fewest earlier turns dropped that fits the context window, and the history kept; the
    request's own input is never dropped (a 400 where it alone does not fit)."""
    for kept in truncations(history):
        body = _chat_of(responses.chat_request(kept))
        try:
            prompts = _prompt_ids(body, state)
            return body, prompts, _max_tokens(body, len(prompts[0]), state), kept
        except ApiError as exc:
            if exc.code != "context_length_exceeded" or not kept:
                raise
    raise AssertionError("unreachable: the last truncation keeps no history")


def _chat_of(chat: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request a request in another API translates to (400 for what it cannot
    be)."""
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def _prompt_ids(
    body: CompletionRequest | ChatCompletionRequest, state: ServerState
) -> list[list[int]]:
    """Token ids of the request's prompts: chat's messages through the chat template;
    completions' texts as the tokenizer encodes them, token-id prompts as given (each id
    checked against the vocabulary), each before the ``suffix`` if one is given (a
    fill-in-the-middle prompt)."""
    from speculative.targets import encode_infill, encode_prompt

    tokenizer = state.loaded.tokenizer
    param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    try:
        if isinstance(body, ChatCompletionRequest):
            template = body.template_options()
            return [_chat_ids(state, body.chat_messages(), body.template_tools(), template)]
        prompts = []
        for prompt in body.prompts():
            if body.suffix:
                param = "suffix"
                prompts.append(encode_infill(tokenizer, prompt, body.suffix))
            elif isinstance(prompt, str):
                prompts.append(encode_prompt(tokenizer, prompt, None, chat=False))
            else:
                prompts.append(list(prompt))
    except ValueError as exc:
        raise ApiError(400, str(exc), param=param) from None
    for ids in prompts:
        _check_vocabulary(ids, state, param)
    return prompts


def _echoes(
    body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]], state: ServerState
) -> list[str]:
    """Each prompt's echoed text: a text prompt as given, a token-id prompt decoded."""
    assert isinstance(body, CompletionRequest)
    return [
        prompt if isinstance(prompt, str) else state.loaded.decode(ids)
        for prompt, ids in zip(body.prompts(), prompts, strict=True)
    ]


def _constraints(
    body: CompletionRequest | ChatCompletionRequest, state: ServerState
) -> Callable[[], TokenConstraint] | None:
    """Fresh grammar constraints for the rows of a request with an output format (a JSON
    response_format, vLLM's structured_outputs, or tools to call; compiled
    once for all its choices), or None."""
    chat = isinstance(body, ChatCompletionRequest)
    output = body.output_format(state.call_syntax) if chat else body.output_format()
    if output is None:
        return None
    from speculative.structured import constraints_for

    param = "response_format" if body.structured_outputs is None else "structured_outputs"
    if isinstance(body, ChatCompletionRequest) and body.may_call():
        param = "tools"  # a function's parameters schema
    try:
        return constraints_for(state.loaded, output)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=param) from None


def _max_tokens(
    body: CompletionRequest | ChatCompletionRequest, prompt_tokens: int, state: ServerState
) -> int:
    limit = state.max_prompt_tokens
    if prompt_tokens > limit:
        raise ApiError(
            400,
            f"the prompt has {prompt_tokens} tokens; this server takes at most {limit}",
            param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    window = state.context_window
    room = None if window is None else window - prompt_tokens
    wanted = body.wanted_tokens()
    if wanted is None:
        default = state.config.default_max_tokens
        return default if room is None else max(1, min(default, room))
    if room is not None and wanted > room:
        raise ApiError(
            400,
            f"max_tokens {wanted} plus the prompt's {prompt_tokens} tokens exceed the "
            f"context window of {window} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return wanted


def _speculation(
    body: CompletionRequest | ChatCompletionRequest, state: ServerState
) -> tuple[str, int]:
    """The request's drafter (one loaded at startup, or none) and γ."""
    options = body.speculative
    draft = state.default_draft
    gamma = state.row_gamma
    if options is not None:
        draft = options.draft if options.draft is not None else draft
        gamma = options.gamma if options.gamma is not None else gamma
    if draft not in state.drafter_names():
        raise ApiError(
            400,
            f"speculative.draft '{draft}' is not loaded; choose one of "
            f"{', '.join(state.drafter_names())} (drafters are chosen when the server starts)",
            param="speculative.draft",
        )
    return draft, gamma


# ---- responses ------------------------------------------------------------------------
def _speculative_stats(
    prepared: Prepared, results: list[GenerationResult], ttft: float | None
) -> dict:
    """The request's speculation statistics, over all its choices."""
    kinds = [k for result in results for r in result.rounds for k in token_kinds(r)]
    stats = GenerationStats.together([result.stats for result in results]).to_dict()
    return {
        "draft": prepared.draft,
        "gamma": prepared.gamma if prepared.draft != NONE else 0,
        "drafted": stats["drafted_tokens"],
        "accepted": stats["accepted_tokens"],
        "recovered": kinds.count("recovered"),
        "bonus": kinds.count("bonus"),
        "alpha": stats["acceptance_rate"],
        "tau": stats["mean_accepted_length"],
        "per_position_acceptance": stats["per_position_acceptance"],
        "target_passes": stats["target_calls"],
        "completion_tokens": stats["new_tokens"],
        "seconds": stats["seconds"],
        "tokens_per_second": stats["tokens_per_second"],
        "time_to_first_token": ttft,
    }


def _usage(prepared: Prepared, results: list[GenerationResult]) -> dict[str, Any]:
    """Tokens of the request: each prompt once (its ``cached_tokens``: those its rows
    found in the cache, a live or finished row's, the fewest of its rows), every row's
    completion."""
    completion = sum(len(result.token_ids) for result in results)
    prompt = sum(len(ids) for ids in prepared.prompts)
    per_prompt = max(1, len(results) // len(prepared.prompts))
    cached = sum(
        min(r.stats.cached_prompt_tokens for r in results[p * per_prompt : (p + 1) * per_prompt])
        for p in range(len(results) // per_prompt)
    )
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if prepared.prediction is not None:  # OpenAI's counts of the predicted tokens
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(a for a, _ in prepared.predicted),
            "rejected_prediction_tokens": sum(r for _, r in prepared.predicted),
        }
    return usage


def _finish_reason(result: GenerationResult) -> str:
    return openai_finish_reason(result.finish_reason)


def _calls_reason(result: GenerationResult, prepared: Prepared, reply: Reply) -> str:
    """A reply with calls: ``tool_calls`` (``function_call`` for legacy functions);
    ``length`` where the budget cut the reply (its last call, or a next one before its
    name), and the result's own reason where a stop string cut its last call."""
    reason = _finish_reason(result)
    if reason == "length" or reply.cut:
        return reason
    return "function_call" if _legacy(prepared) else "tool_calls"


def _legacy(prepared: Prepared) -> bool:
    """Whether the request gave OpenAI's legacy ``functions`` (and gets their reply)."""
    body = prepared.body
    return isinstance(body, ChatCompletionRequest) and body.legacy_functions()


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_id,
        "object": "model",
        "created": 0,
        "owned_by": "speculative",
        "max_model_len": state.context_window,
        "speculative": {
            "drafters": state.drafter_names(),
            "default_draft": state.default_draft,
            "gamma": state.row_gamma,
            "gamma_policy": "load-aware" if state.pass_costs is not None else "fixed",
            "max_batch": state.config.max_batch,
        },
    }


class _Envelope:
    """id / object / created / model of one response (shared by all its chunks)."""

    def __init__(self, prepared: Prepared, state: ServerState) -> None:
        chat = prepared.endpoint != "completions"
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = state.model_id

    def wrap(self, choices: list[dict], stream: bool, **extra: Any) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if stream and self.chat else ""
        )
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def delta(
        self,
        text: str | None,
        finish: str | None,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
        index: int = 0,
        calls: list[dict[str, Any]] | None = None,
        legacy: bool = False,
        reasoning: str | None = None,
    ) -> dict[str, Any]:
        if not self.chat:
            return {
                "index": index,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if reasoning is not None:  # a reasoning model's thinking (vLLM's field)
            delta["reasoning_content"] = reasoning
        if text is not None:
            delta["content"] = text
        if calls and legacy:  # the legacy form: one call, no id
            delta["function_call"] = calls[0]["function"]
        elif calls:  # the calls' new parts (CallStream.deltas)
            delta["tool_calls"] = calls
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


async def _complete(
    request: Request,
    prepared: Prepared,
    jobs: list[Job],
    state: ServerState,
    scheduler: Scheduler,
    metrics: ServerMetrics,
) -> Response:
    """A whole (non-streamed) response; a client that goes away cancels its rows."""
    body = await _whole_body(prepared, jobs, state, scheduler, metrics, request.is_disconnected)
    if body is None:
        return Response(status_code=499)
    await prepared.settle(body)
    return JSONResponse(body)


async def _whole_body(
    prepared: Prepared,
    jobs: list[Job],
    state: ServerState,
    scheduler: Scheduler,
    metrics: ServerMetrics,
    disconnected: Callable[[], Awaitable[bool]] | None,
) -> dict[str, Any] | None:
    """A whole response's body once every row has finished; None where ``disconnected``
    (polled) said the client went away, its rows cancelled."""
    ttft = None
    results: list[GenerationResult] = []
    next_check = time.monotonic() + DISCONNECT_POLL_SECONDS
    for job in jobs:  # the choices decode together; their events wait in their queues
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_SECONDS)
            except TimeoutError:
                event = None
            if time.monotonic() >= next_check:  # rounds may arrive faster than any timeout
                next_check = time.monotonic() + DISCONNECT_POLL_SECONDS
                if disconnected is not None and await disconnected():
                    _cancel_unfinished(jobs, prepared.endpoint, scheduler, metrics)
                    return None
            if event is None or isinstance(event, RoundEvent):
                if event is not None and event.round.tokens:
                    first = time.perf_counter() - job.submitted
                    ttft = first if ttft is None else min(ttft, first)
                continue
            if isinstance(event, ErrorEvent):
                _cancel_unfinished(jobs, prepared.endpoint, scheduler, metrics, count=False)
                metrics.count_request(prepared.endpoint, "500")
                raise ApiError(500, event.message, "server_error")
            break
        assert isinstance(event, DoneEvent)
        results.append(event.result)
    envelope = _Envelope(prepared, state)
    choices = [
        _whole_choice(i, prepared, result, envelope, state)
        for i, result in enumerate(prepared.best(results))
    ]
    metrics.count_request(prepared.endpoint, "200")
    body = envelope.wrap(
        choices,
        stream=False,
        usage=_usage(prepared, results),
        speculative=_speculative_stats(prepared, results, ttft),
    )
    if prepared.answer is not None:
        body = prepared.answer.whole(body)
    return body


async def _start_background(
    prepared: Prepared,
    jobs: list[Job],
    state: ServerState,
    scheduler: Scheduler,
    metrics: ServerMetrics,
    store: ResponseStore,
) -> Response:
    """A background Responses request: kept as "queued" at once and answered so (with
    ``stream``, its events streamed as they come, resumable by ``GET …?stream=true``); its
    rows decode on whoever listens, and the kept response becomes the whole one (or
    "failed", or "cancelled" by ``POST /v1/responses/{id}/cancel``)."""
    request = prepared.responses
    assert request is not None and prepared.response_id is not None
    queued = response_object(request, prepared.response_id, int(time.time()), [], "queued", None)
    log = EventLog() if request.stream else None
    stored = StoredResponse(queued, prepared.input_items, log=log)
    stored.started = lambda: any(job.admitted is not None for job in jobs)

    async def decode() -> None:
        try:
            if stored.log is None:
                body = await _whole_body(prepared, jobs, state, scheduler, metrics, None)
                assert body is not None
            else:
                body = await _logged(stored.log, prepared, jobs, state, metrics)
        except asyncio.CancelledError:
            _cancel_unfinished(jobs, prepared.endpoint, scheduler, metrics)
            body = {**queued, "status": "cancelled"}
        except Exception as exc:  # (an ApiError's message as it is, others named)
            message = exc.message if isinstance(exc, ApiError) else f"internal error: {exc!r}"
            _cancel_unfinished(jobs, prepared.endpoint, scheduler, metrics, count=False)
            body = {**queued, "status": "failed",
                    "error": {"code": "server_error", "message": message}}  # fmt: skip
        await store.finish(stored, body)
        if prepared.join is not None:
            await prepared.join(body)

    await store.put(stored)
    stored.task = asyncio.get_running_loop().create_task(decode())
    if stored.log is not None:
        return sse_events(stored.log.after(0))
    return JSONResponse(queued)


async def _logged(
    log: EventLog, prepared: Prepared, jobs: list[Job], state: ServerState, metrics: ServerMetrics
) -> dict[str, Any]:
    """Decode a background stream into ``log``; the whole response its last event has."""
    last: dict[str, Any] = {}
    async for last in _response_events(prepared, _chunks(prepared, jobs, state, metrics)):
        await log.add(last)
    return last["response"]


def _whole_choice(
    index: int,
    prepared: Prepared,
    result: GenerationResult,
    envelope: _Envelope,
    state: ServerState,
) -> dict[str, Any]:
    """One choice of a whole response: its text (cut at a stop string), finish reason and
    (where asked) its tokens' log-probabilities."""
    decode = state.loaded.decode
    text = _assembler(prepared, state.decode_reply)
    text.push(result.token_ids, ["target"] * len(result.token_ids))
    echo = prepared.echo(index)
    logprobs = LogprobsFormatter(decode, envelope.chat, text_offset=len(echo))
    if prepared.body.wanted_logprobs() is not None:  # (ranked rows report them unasked)
        logprobs.add(result.logprobs)
    token_logprobs = joined(
        prepared.echoed_logprobs(index, decode, result), logprobs.take(text, final=True)
    )
    reason = _finish_reason(result)
    if envelope.chat:
        message: dict[str, Any] = {"role": "assistant", "content": text.final_text()}
        reply = _reply(prepared, text)
        if reply is not None:
            message["content"] = reply.content
        if prepared.thinking is not None:  # the thinking split from the answer
            reasoning, answer = split_reasoning(message["content"] or "", prepared.thinking)
            message["reasoning_content"] = reasoning
            message["content"] = answer if answer or not (reply and reply.calls) else None
        if echo and isinstance(message["content"], str):
            message["content"] = echo + message["content"]
        if reply is not None and reply.calls:
            reason = _calls_reason(result, prepared, reply)
            if _legacy(prepared):
                message["function_call"] = reply.calls[0]["function"]
            else:
                message["tool_calls"] = reply.calls
        return {
            "index": index,
            "message": message,
            "logprobs": token_logprobs,
            "finish_reason": reason,
            "stop_reason": _stop_reason(prepared, result, state),
        }
    return {
        "index": index,
        "text": echo + text.final_text(),
        "logprobs": token_logprobs,
        "finish_reason": reason,
        "stop_reason": _stop_reason(prepared, result, state),
    }


def _stop_reason(
    prepared: Prepared, result: GenerationResult, state: ServerState
) -> str | int | None:
    """vLLM's ``stop_reason``: the stop string that ended the choice, or the
    ``stop_token_ids`` token; None where the model's end of sequence or the budget did."""
    body = prepared.body
    if result.finish_reason == "stop":
        criteria, tokens = prepared.batch_requests[0].stop, result.token_ids
        text = state.loaded.decode(tokens)
        found = find_stop(text, criteria.stop_strings, criteria.quiet_chars(tokens))
        return None if found is None else text[found[0] : found[1]]
    last = result.token_ids[-1] if result.token_ids else None
    if result.finish_reason != "eos" or last not in body.stop_tokens():
        return None
    model_ends = frozenset() if body.ignore_eos else state.loaded.eos_token_ids
    return None if last in model_ends else last  # (the model's end comes first, as vLLM's)


def _mean_logprob(result: GenerationResult) -> float:
    """A completion's mean log-probability per token (−inf for none)."""
    entries = result.logprobs or []
    return sum(e.logprob for e in entries) / len(entries) if entries else float("-inf")


def _assembler(prepared: Prepared, decode: Callable[[Sequence[int]], str]) -> TextAssembler:
    """A choice's text, cut at the request's stop strings, and where the reply may call
    a function also before its first call (the calls stream by :class:`CallStream`)."""
    body = prepared.body
    calls = isinstance(body, ChatCompletionRequest) and body.may_call()
    return TextAssembler(
        decode,
        body.stop_strings(),
        prepared.call_syntax.calls_start if calls else None,
        body.stop_tokens(),
        body.include_stop_str_in_output,
        quiet=max(0, body.min_tokens - 1),  # (a stop string inside them does not count)
    )


def _reply(prepared: Prepared, text: TextAssembler) -> Reply | None:
    """A complete reply's text and function calls, where the request gave tools to
    call (None otherwise); a call the budget or a stop string cut short keeps its
    arguments as far as they go, once its name was written (:func:`split_calls`)."""
    body = prepared.body
    if not isinstance(body, ChatCompletionRequest) or not body.may_call():
        return None
    assert body.tools is not None
    return split_calls(text.reply_text(final=True), body.tools, prepared.call_syntax)


def _call_stream(prepared: Prepared) -> CallStream | None:
    body = prepared.body
    if not isinstance(body, ChatCompletionRequest) or not body.may_call():
        return None
    assert body.tools is not None
    return CallStream(body.tools, prepared.call_syntax)


def _call_deltas(choice: _StreamedChoice, final: bool) -> list[dict]:
    """The streamed calls' new parts, from the reply so far (:meth:`TextAssembler.
    reply_text`)."""
    if choice.calls is None:
        return []
    return choice.calls.deltas(choice.text.reply_text(final))


@dataclass
class _RunningStats:
    """α and τ so far, sent with every streamed chunk (the playground shows them live)."""

    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    passes: int = 0

    def add(self, round_: Round) -> None:
        self.drafted += round_.drafted
        self.accepted += round_.num_accepted
        self.tokens += len(round_.tokens)
        self.passes += 1

    def to_dict(self) -> dict[str, float]:
        alpha = self.accepted / self.drafted if self.drafted else 0.0
        return {"alpha": alpha, "tau": self.tokens / self.passes if self.passes else 0.0}


@dataclass
class _StreamedChoice:
    """One choice of a streamed response: its text, log-probabilities and running α, τ."""

    text: TextAssembler
    logprobs: LogprobsFormatter
    calls: CallStream | None  # where the reply may call functions
    reasoning: ReasoningStream | None  # where the reply's thinking is split from it
    running: _RunningStats = field(default_factory=_RunningStats)
    started: bool = False  # an event came (the echoed prompt, if any, went first)


async def _merged_events(jobs: list[Job]) -> AsyncIterator[tuple[int, Event]]:
    """(choice, event) of every job as they come, until each has finished or failed."""
    pending = {asyncio.ensure_future(job.events.get()): i for i, job in enumerate(jobs)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t]):
                index = pending.pop(task)
                event = task.result()
                if isinstance(event, RoundEvent):
                    pending[asyncio.ensure_future(jobs[index].events.get())] = index
                yield index, event
    finally:
        for task in pending:
            task.cancel()


async def _stream(
    prepared: Prepared, jobs: list[Job], state: ServerState, metrics: ServerMetrics
) -> AsyncIterator[bytes]:
    """The response's SSE bytes: the chunks of :func:`_chunks`, or for a request in
    another API (Responses, Messages) the events they make."""
    chunks = _chunks(prepared, jobs, state, metrics)
    if prepared.answer is None:
        async for chunk in chunks:
            yield sse(chunk)
        return
    last = None
    async for last in _response_events(prepared, chunks):
        yield sse(last, last["type"])
    if last is not None and prepared.responses is not None:  # (its last event's response)
        await prepared.settle(last["response"])


async def _response_events(
    prepared: Prepared, chunks: AsyncIterator[dict[str, Any] | str]
) -> AsyncIterator[dict[str, Any]]:
    """A request's stream events in its API, made from its chat chunks (a Responses
    request's last one carries the whole response)."""
    assert prepared.answer is not None
    events = prepared.answer.events()
    for event in events.start():
        yield event
    async for chunk in chunks:
        for event in events.end() if chunk == "[DONE]" else events.feed(chunk):
            yield event


async def _chunks(
    prepared: Prepared, jobs: list[Job], state: ServerState, metrics: ServerMetrics
) -> AsyncIterator[dict[str, Any] | str]:
    """The stream's chunks (payloads): each choice's text as it becomes final
    (``index``: its choice), each choice's finish chunk, then one with the request's
    ``speculative`` stats, the usage chunk when asked, and ``[DONE]``."""
    envelope = _Envelope(prepared, state)
    decode = state.loaded.decode
    choices = [
        _StreamedChoice(
            _assembler(prepared, state.decode_reply),
            LogprobsFormatter(decode, envelope.chat, len(prepared.echo(i))),
            _call_stream(prepared),
            None if prepared.thinking is None else ReasoningStream(prepared.thinking),
        )
        for i in range(len(jobs))
    ]
    options = prepared.body.stream_options
    include_usage = options is not None and options.include_usage
    ttft = None
    results: dict[int, GenerationResult] = {}
    if envelope.chat:
        for i in range(len(jobs)):
            yield envelope.wrap([envelope.delta("", None, role=True, index=i)], stream=True)
    async for i, event in _merged_events(jobs):
        if isinstance(event, ErrorEvent):
            metrics.count_request(prepared.endpoint, "500")
            yield ApiError(500, event.message, "server_error").body()
            yield "[DONE]"
            return
        choice = choices[i]
        echo = prepared.echo(i)
        if echo and not choice.started and isinstance(event, RoundEvent):
            scored = prepared.echoed_logprobs(i, decode, event.round)  # on the first round
            delta = envelope.delta(echo, None, logprobs=scored, index=i)
            yield envelope.wrap([delta], stream=True)
        choice.started = True
        if isinstance(event, RoundEvent):
            choice.running.add(event.round)
            choice.logprobs.add(event.round.logprobs)
            pieces = choice.text.push(event.round.tokens, token_kinds(event.round))
        else:
            pieces = choice.text.finish()
        final = isinstance(event, DoneEvent)
        reply = _reply(prepared, choice.text) if final else None
        if reply is not None and not reply.calls:  # text after all (the budget cut a call)
            rest = (reply.content or "")[choice.text.sent :]
            pieces = [*pieces, (rest, "target")] if rest else pieces
        text, reasoning = "".join(p for p, _ in pieces), None
        if choice.reasoning is not None:  # the thinking and the answer, routed
            reasoning, text = choice.reasoning.feed(text, final)
        if text or reasoning:
            if ttft is None:
                ttft = time.perf_counter() - jobs[i].submitted
            delta = envelope.delta(
                text or None if reasoning else text, None,
                logprobs=choice.logprobs.take(choice.text, final), index=i,
                reasoning=reasoning or None,
            )  # fmt: skip
            pieces_out = {"pieces": [list(p) for p in pieces], **choice.running.to_dict()}
            yield envelope.wrap([delta], stream=True, speculative=pieces_out)
        calls = _call_deltas(choice, final)
        if calls:
            delta = envelope.delta(None, None, index=i, calls=calls, legacy=_legacy(prepared))
            yield envelope.wrap([delta], stream=True)
        if isinstance(event, DoneEvent):
            results[i] = event.result
            result = event.result
            reason = _finish_reason(result)
            if reply is not None and reply.calls:
                reason = _calls_reason(result, prepared, reply)
            finish = envelope.delta(  # with the log-probabilities of tokens that sent no text
                None if envelope.chat else "", reason,
                logprobs=choice.logprobs.take(choice.text, final=True), index=i,
            )  # fmt: skip
            finish["stop_reason"] = _stop_reason(prepared, result, state)
            last = len(results) == len(jobs)
            ordered = [results[k] for k in sorted(results)]
            extra = {"speculative": _speculative_stats(prepared, ordered, ttft)} if last else {}
            yield envelope.wrap([finish], stream=True, **extra)
    ordered = [results[k] for k in sorted(results)]
    if include_usage:
        yield envelope.wrap([], stream=True, usage=_usage(prepared, ordered))
    metrics.count_request(prepared.endpoint, "200")
    yield "[DONE]"


def _cancel_unfinished(
    jobs: list[Job],
    endpoint: str,
    scheduler: Scheduler,
    metrics: ServerMetrics,
    count: bool = True,
) -> None:
    """Cancel every job of a request that has not ended; ``count``: as one cancelled
    request in the metrics if any had not."""
    if count and any(not job.done and not job.cancelled for job in jobs):
        metrics.count_request(endpoint, "cancelled")
    for job in jobs:
        scheduler.cancel(job)
