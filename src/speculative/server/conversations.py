"""OpenAI's Conversations API: a conversation kept on the server, whose items a response
made with ``conversation`` continues and then grows by (its input and output items).

``POST /v1/conversations`` (optional first ``items`` and ``metadata``), ``GET`` /
``POST`` (new ``metadata``) / ``DELETE /v1/conversations/{id}``, and its items: ``GET``
(paged as ``/input_items`` are) and ``POST /v1/conversations/{id}/items``, ``GET`` /
``DELETE /v1/conversations/{id}/items/{item_id}``. Conversations are kept with the
Responses API's answers, in the same records (:mod:`speculative.server.stored`): the
``--responses-store`` most recently used objects of both kinds, shared by ``--replicas``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from speculative.server.protocol import ApiError
from speculative.server.responses import InputItem, new_id

if TYPE_CHECKING:
    from speculative.server.stored import ResponseRecords

MAX_ITEMS = 20  # items added at once (OpenAI's limit)
MAX_METADATA = 16  # metadata pairs; keys up to 64 characters, values up to 512


class ConversationCreate(BaseModel):
    """``POST /v1/conversations``."""

    model_config = ConfigDict(extra="ignore")

    items: list[InputItem] = Field(default_factory=list, max_length=MAX_ITEMS)
    metadata: dict[str, str] | None = None


class ConversationUpdate(BaseModel):
    """``POST /v1/conversations/{id}``."""

    model_config = ConfigDict(extra="ignore")

    metadata: dict[str, str]


class ItemsCreate(BaseModel):
    """``POST /v1/conversations/{id}/items``."""

    model_config = ConfigDict(extra="ignore")

    items: list[InputItem] = Field(min_length=1, max_length=MAX_ITEMS)


def checked_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    """``metadata`` within OpenAI's limits, or a 400."""
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA:
        raise ApiError(400, f"metadata holds at most {MAX_METADATA} pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise ApiError(
                400, "metadata keys are at most 64 characters and values at most 512",
                param="metadata",
            )  # fmt: skip
    return metadata


@dataclass
class Conversations:
    """The kept conversations (in ``records``, beside the kept responses)."""

    records: ResponseRecords
    enabled: bool = True  # false with serve --responses-store 0

    async def create(self, request: ConversationCreate) -> dict[str, Any]:
        self._check_enabled()
        body = {
            "id": new_id("conv"),
            "object": "conversation",
            "created_at": int(time.time()),
            "metadata": checked_metadata(request.metadata),
        }
        await self.records.put(body, [item.stored() for item in request.items])
        return body

    async def get(self, conversation_id: str, param: str | None = None) -> dict[str, Any]:
        return (await self._record(conversation_id, param))[0]

    async def items(self, conversation_id: str, param: str | None = None) -> list[dict[str, Any]]:
        """Its items, oldest first (what a response made with it continues)."""
        return (await self._record(conversation_id, param))[1]

    async def update(self, conversation_id: str, request: ConversationUpdate) -> dict[str, Any]:
        body = {**await self.get(conversation_id), "metadata": checked_metadata(request.metadata)}
        await self.records.update(body)
        return body

    async def delete(self, conversation_id: str) -> dict[str, Any]:
        await self.get(conversation_id)
        await self.records.delete(conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    async def add(self, conversation_id: str, request: ItemsCreate) -> list[dict[str, Any]]:
        """``POST …/items``: the items added (as kept, with ids)."""
        self._check_enabled()
        items = [item.stored() for item in request.items]
        if not await self.append(conversation_id, items):
            raise self._missing(conversation_id, None)
        return items

    async def append(self, conversation_id: str, items: list[dict[str, Any]]) -> bool:
        """Append kept items (a response's turn); False where the conversation is gone."""
        return await self.records.extend(conversation_id, items)

    async def item(self, conversation_id: str, item_id: str) -> dict[str, Any]:
        for item in await self.items(conversation_id):
            if item.get("id") == item_id:
                return item
        raise _missing_item(conversation_id, item_id)

    async def remove(self, conversation_id: str, item_id: str) -> dict[str, Any]:
        """Take an item out; the conversation object."""
        body = await self.get(conversation_id)
        if not await self.records.remove_item(conversation_id, item_id):
            raise _missing_item(conversation_id, item_id)
        return body

    async def _record(
        self, conversation_id: str, param: str | None
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        self._check_enabled()
        record = await self.records.get(conversation_id)
        if record is None or record[0].get("object") != "conversation":
            raise self._missing(conversation_id, param)
        return record

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise ApiError(
                400, "this server keeps no conversations (serve --responses-store 0)",
                code="conversations_disabled",
            )  # fmt: skip

    def _missing(self, conversation_id: str, param: str | None) -> ApiError:
        return ApiError(
            404, f"no conversation with id '{conversation_id}': it was never made here, was "
            "deleted, or is no longer kept", param=param, code="conversation_not_found",
        )  # fmt: skip


def _missing_item(conversation_id: str, item_id: str) -> ApiError:
    return ApiError(
        404, f"conversation '{conversation_id}' has no item with id '{item_id}'",
        code="item_not_found",
    )  # fmt: skip
