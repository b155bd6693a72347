"""The server's HTTP plumbing: error bodies in OpenAI's (or Anthropic's) shape, the API key, request
bodies read within their limit and parsed, SSE framing, list pages."""

from __future__ import annotations

import hmac
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from speculative.server.anthropic import error_body
from speculative.server.protocol import ApiError, validation_error
from speculative.server.state import ServerState
from speculative.server.stored import item_page

ANTHROPIC_PATHS = ("/v1/messages",)  # where errors take Anthropic's shape
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
Body = TypeVar("Body", bound=BaseModel)


def install_error_handlers(app: FastAPI) -> None:
    """Errors as JSON in OpenAI's shape (in Anthropic's under ``/v1/messages``)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(
            request, ApiError(exc.status_code, str(exc.detail), code=str(exc.status_code))
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        error = ApiError(500, f"internal error: {type(exc).__name__}", "server_error")
        return _error(request, error)


def _error(request: Request, error: ApiError) -> JSONResponse:
    if request.url.path.startswith(ANTHROPIC_PATHS):
        return JSONResponse(error_body(error.status, error.message), status_code=error.status)
    return JSONResponse(error.body(), status_code=error.status)


def authorize(request: Request, state: ServerState) -> None:
    """401 unless the request carries the API key (compared in constant time)."""
    key = state.config.api_key
    if not key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer":  # Anthropic's clients send it as x-api-key
        given = request.headers.get("x-api-key", "")
    if not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError(401, "missing or wrong API key", param=None, code="invalid_api_key")


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON; 413 past ``limit`` bytes (checked while reading), 400 if not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is larger than {limit} bytes", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(
                413, f"the request body is larger than {limit} bytes", code="body_too_large"
            )
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None


async def parsed(request: Request, model: type[Body], state: ServerState) -> Body:
    """The request's JSON body as ``model``; 400 (naming the field) or 413."""
    return validated(await read_json(request, state.config.max_body_bytes), model)


def validated(payload: Any, model: type[Body]) -> Body:
    """A JSON body as ``model``; 400 (naming the field)."""
    if not isinstance(payload, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def sse(payload: dict[str, Any] | str, event: str | None = None) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    named = f"event: {event}\n" if event is not None else ""
    return f"{named}data: {data}\n\n".encode()


def sse_events(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """A stream of Responses API events, as they come."""

    async def encoded() -> AsyncIterator[bytes]:
        async for event in events:
            yield sse(event, event["type"])

    return StreamingResponse(encoded(), media_type="text/event-stream", headers=SSE_HEADERS)


class CancellingStream(StreamingResponse):
    """A streamed response that cancels its job however the response ends (finished,
    client gone, error): the row leaves the batch before the next round."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kw: Any):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def page(request: Request, items: list[dict[str, Any]]) -> dict[str, Any]:
    """A list page of kept items as the request's ``limit``, ``order`` and ``after`` ask."""
    query = request.query_params
    limit = query.get("limit", "20")
    if not limit.isdigit():
        raise ApiError(400, f"limit must be an integer, got {limit!r}", param="limit")
    return item_page(items, int(limit), query.get("order", "desc"), query.get("after"))
