"""The routes of what the server keeps: stored Responses API answers (``GET`` /
``DELETE /v1/responses/{id}``, its ``input_items`` and ``cancel``, a background stream
resumed) and OpenAI's Conversations API (:mod:`speculative.server.conversations`)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from speculative.server.conversations import (
    ConversationCreate,
    Conversations,
    ConversationUpdate,
    ItemsCreate,
)
from speculative.server.http import authorize, page, parsed, sse_events
from speculative.server.protocol import ApiError
from speculative.server.state import ServerState
from speculative.server.stored import ResponseStore, item_page


def install_stored_responses(app: FastAPI, state: ServerState, store: ResponseStore) -> None:
    """``GET`` / ``DELETE /v1/responses/{id}``, its ``input_items`` and ``cancel``."""

    @app.get("/v1/responses/{response_id}", response_model=None)
    async def get_response(request: Request, response_id: str) -> dict[str, Any] | Response:
        """The response; with ``stream=true`` a background stream's events after
        ``starting_after`` (its sequence numbers), as they come."""
        authorize(request, state)
        query = request.query_params
        if query.get("stream", "false").lower() in ("true", "1"):
            after = query.get("starting_after", "-1")
            if not after.lstrip("-").isdigit():
                raise ApiError(400, f"starting_after must be an integer, got {after!r}",
                               param="starting_after")  # fmt: skip
            return sse_events(await store.events(response_id, int(after)))
        return (await store.get(response_id)).current()

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
        authorize(request, state)
        await store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(request: Request, response_id: str) -> dict[str, Any]:
        authorize(request, state)
        return page(request, (await store.get(response_id)).input_items)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> dict[str, Any]:
        authorize(request, state)
        return await store.cancel(response_id)


def install_conversations(app: FastAPI, state: ServerState, kept: Conversations) -> None:
    """OpenAI's Conversations API (:mod:`speculative.server.conversations`)."""

    @app.post("/v1/conversations")
    async def create_conversation(request: Request) -> dict[str, Any]:
        authorize(request, state)
        return await kept.create(await parsed(request, ConversationCreate, state))

    @app.get("/v1/conversations/{conversation_id}")
    async def get_conversation(request: Request, conversation_id: str) -> dict[str, Any]:
        authorize(request, state)
        return await kept.get(conversation_id)

    @app.post("/v1/conversations/{conversation_id}")
    async def update_conversation(request: Request, conversation_id: str) -> dict[str, Any]:
        authorize(request, state)
        update = await parsed(request, ConversationUpdate, state)
        return await kept.update(conversation_id, update)

    @app.delete("/v1/conversations/{conversation_id}")
    async def delete_conversation(request: Request, conversation_id: str) -> dict[str, Any]:
        authorize(request, state)
        return await kept.delete(conversation_id)

    @app.get("/v1/conversations/{conversation_id}/items")
    async def list_items(request: Request, conversation_id: str) -> dict[str, Any]:
        authorize(request, state)
        return page(request, await kept.items(conversation_id))

    @app.post("/v1/conversations/{conversation_id}/items")
    async def add_items(request: Request, conversation_id: str) -> dict[str, Any]:
        authorize(request, state)
        added = await kept.add(conversation_id, await parsed(request, ItemsCreate, state))
        return item_page(added, len(added), "asc", None)

    @app.get("/v1/conversations/{conversation_id}/items/{item_id}")
    async def get_item(request: Request, conversation_id: str, item_id: str) -> dict[str, Any]:
        authorize(request, state)
        return await kept.item(conversation_id, item_id)

    @app.delete("/v1/conversations/{conversation_id}/items/{item_id}")
    async def delete_item(request: Request, conversation_id: str, item_id: str) -> dict[str, Any]:
        authorize(request, state)
        return await kept.remove(conversation_id, item_id)
