"""The routes of what the server keeps: stored Responses API answers (``GET`` /
``DELETE /v1/responses/{id}``, its ``input_items`` and ``cancel``, a background stream
resumed), OpenAI's Conversations API (:mod:`speculative.server.conversations`), and its
Files and Batch APIs (:mod:`speculative.server.batches`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response

from speculative.server.batches import Batches, FileStore, listed
from speculative.server.conversations import (
    ConversationCreate,
    Conversations,
    ConversationUpdate,
    ItemsCreate,
)
from speculative.server.http import authorize, page, parsed, read_json, sse_events
from speculative.server.protocol import ApiError
from speculative.server.state import ServerState
from speculative.server.stored import ResponseStore, item_page


def install_stored_responses(app: FastAPI, state: ServerState, store: ResponseStore) -> None:
    """``GET`` / ``DELETE /v1/responses/{id}``, its ``input_items`` and ``cancel``."""
    router = _guarded(state)

    @router.get("/v1/responses/{response_id}", response_model=None)
    async def get_response(request: Request, response_id: str) -> dict[str, Any] | Response:
        """The response; with ``stream=true`` a background stream's events after
        ``starting_after`` (its sequence numbers), as they come."""
        query = request.query_params
        if query.get("stream", "false").lower() in ("true", "1"):
            after = query.get("starting_after", "-1")
            if not after.lstrip("-").isdigit():
                raise ApiError(400, f"starting_after must be an integer, got {after!r}",
                               param="starting_after")  # fmt: skip
            return sse_events(await store.events(response_id, int(after)))
        return (await store.get(response_id)).current()

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        await store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items(request: Request, response_id: str) -> dict[str, Any]:
        return page(request, (await store.get(response_id)).input_items)

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict[str, Any]:
        return await store.cancel(response_id)

    app.include_router(router)


def install_conversations(app: FastAPI, state: ServerState, kept: Conversations) -> None:
    """OpenAI's Conversations API (:mod:`speculative.server.conversations`)."""
    router = _guarded(state)

    @router.post("/v1/conversations")
    async def create_conversation(request: Request) -> dict[str, Any]:
        return await kept.create(await parsed(request, ConversationCreate, state))

    @router.get("/v1/conversations/{conversation_id}")
    async def get_conversation(conversation_id: str) -> dict[str, Any]:
        return await kept.get(conversation_id)

    @router.post("/v1/conversations/{conversation_id}")
    async def update_conversation(request: Request, conversation_id: str) -> dict[str, Any]:
        update = await parsed(request, ConversationUpdate, state)
        return await kept.update(conversation_id, update)

    @router.delete("/v1/conversations/{conversation_id}")
    async def delete_conversation(conversation_id: str) -> dict[str, Any]:
        return await kept.delete(conversation_id)

    @router.get("/v1/conversations/{conversation_id}/items")
    async def list_items(request: Request, conversation_id: str) -> dict[str, Any]:
        return page(request, await kept.items(conversation_id))

    @router.post("/v1/conversations/{conversation_id}/items")
    async def add_items(request: Request, conversation_id: str) -> dict[str, Any]:
        added = await kept.add(conversation_id, await parsed(request, ItemsCreate, state))
        return item_page(added, len(added), "asc", None)

    @router.get("/v1/conversations/{conversation_id}/items/{item_id}")
    async def get_item(conversation_id: str, item_id: str) -> dict[str, Any]:
        return await kept.item(conversation_id, item_id)

    @router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
    async def delete_item(conversation_id: str, item_id: str) -> dict[str, Any]:
        return await kept.remove(conversation_id, item_id)

    app.include_router(router)


def install_files_and_batches(
    app: FastAPI, state: ServerState, files: FileStore, batches: Batches
) -> None:
    """OpenAI's Files and Batch APIs (:mod:`speculative.server.batches`)."""
    router = _guarded(state)

    @router.post("/v1/files")
    async def upload(request: Request) -> dict[str, Any]:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > files.max_bytes:
            raise ApiError(
                413, f"the file is larger than the {files.max_bytes} bytes the server keeps "
                "(serve --files-store-bytes)", code="body_too_large",
            )  # fmt: skip
        try:
            form = await request.form()
        except Exception as exc:  # (not multipart, or malformed)
            raise ApiError(400, f"upload the file as multipart/form-data: {exc}") from None
        upload, purpose = form.get("file"), form.get("purpose")
        if upload is None or isinstance(upload, str):
            raise ApiError(400, "the form has no file", param="file")
        if not isinstance(purpose, str) or not purpose:
            raise ApiError(400, "the form has no purpose", param="purpose")
        data = await upload.read()
        return files.add(upload.filename or "upload", purpose, data).object()

    @router.get("/v1/files")
    async def list_files(request: Request) -> dict[str, Any]:
        purpose = request.query_params.get("purpose")
        kept = [f.object() for f in files.files.values() if purpose in (None, f.purpose)]
        return listed(kept, _limit(request, 10_000), request.query_params.get("after"))

    @router.get("/v1/files/{file_id}")
    async def get_file(file_id: str) -> dict[str, Any]:
        return files.get(file_id).object()

    @router.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        return Response(files.get(file_id).data, media_type="application/octet-stream")

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> dict[str, Any]:
        return files.delete(file_id)

    @router.post("/v1/batches")
    async def create_batch(request: Request) -> dict[str, Any]:
        body = await read_json(request, state.config.max_body_bytes)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return batches.create(body).object()

    @router.get("/v1/batches")
    async def list_batches(request: Request) -> dict[str, Any]:
        kept = [batch.object() for batch in batches.kept.values()]
        return listed(kept, _limit(request, 100), request.query_params.get("after"))

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str) -> dict[str, Any]:
        return batches.get(batch_id).object()

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> dict[str, Any]:
        return (await batches.cancel(batch_id)).object()

    app.include_router(router)


def _limit(request: Request, largest: int) -> int:
    limit = request.query_params.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= largest:
        raise ApiError(400, f"limit must be an integer from 1 to {largest}", param="limit")
    return int(limit)


def _guarded(state: ServerState) -> APIRouter:
    """Routes that answer only requests with the API key (401 otherwise)."""

    async def check(request: Request) -> None:
        authorize(request, state)

    return APIRouter(dependencies=[Depends(check)])
