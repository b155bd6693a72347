"""The Responses API's stored responses: what ``previous_response_id``, ``GET`` /
``DELETE /v1/responses/{id}``, ``/input_items`` and background responses read.

Responses are kept in the server's memory, the most recently used ``capacity`` of them
(a restart forgets them all; with ``serve --replicas`` each replica keeps its own). Each
keeps the whole conversation it saw, so a follow-up finds it in one lookup and an earlier
response's eviction or deletion does not break the conversations that went on from it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from speculative.server.protocol import ApiError

# the states a background response moves through before it ends
RUNNING = ("queued", "in_progress")


@dataclass
class StoredResponse:
    """One kept response: its ``response`` object as last reported (a background one's
    status moves) and the input items it was answered from (earlier turns included)."""

    body: dict[str, Any]
    input_items: list[dict[str, Any]]
    task: asyncio.Task | None = None  # a background response's decoding
    started: Callable[[], bool] | None = None  # whether its rows were admitted

    @property
    def running(self) -> bool:
        return self.body["status"] in RUNNING

    def current(self) -> dict[str, Any]:
        """The ``response`` object now: a queued background response whose rows the
        scheduler admitted is "in_progress"."""
        if self.body["status"] == "queued" and self.started is not None and self.started():
            return {**self.body, "status": "in_progress"}
        return self.body

    def conversation(self) -> list[dict[str, Any]]:
        """The items a follow-up continues: the input, then the output."""
        return [*self.input_items, *self.body["output"]]


@dataclass
class ResponseStore:
    """The last ``capacity`` responses kept (least recently used first out; a background
    response still decoding is never evicted)."""

    capacity: int
    replicas: int = 1  # copies of the server behind its endpoint (each has its own store)
    kept: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def put(self, stored: StoredResponse) -> None:
        response_id = stored.body["id"]
        self.kept[response_id] = stored
        self.kept.move_to_end(response_id)
        finished = [key for key, value in self.kept.items() if not value.running]
        for key in finished[: max(0, len(self.kept) - self.capacity)]:
            del self.kept[key]

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The kept response, or 404 (naming ``param`` where a request field gave the id)."""
        stored = self.kept.get(response_id)
        if stored is None:
            reason = (
                "it was never made here, was deleted, or is no longer kept (this server "
                f"keeps the last {self.capacity})"
                if self.enabled
                else "this server keeps no responses (serve --responses-store 0)"
            )
            if self.replicas > 1:
                reason += (
                    f"; this endpoint runs {self.replicas} replicas, each keeping its own "
                    "responses: send the whole conversation as input instead"
                )
            raise ApiError(
                404,
                f"no response with id '{response_id}': {reason}",
                param=param,
                code="response_not_found",
            )
        self.kept.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> StoredResponse:
        stored = self.get(response_id)
        if stored.task is not None and stored.running:
            stored.task.cancel()  # its rows leave the batch
        del self.kept[response_id]
        return stored


def item_page(
    items: list[dict[str, Any]], limit: int, order: str, after: str | None
) -> dict[str, Any]:
    """``/input_items``' answer: a list page of ``items`` (``order`` "asc" or "desc"),
    starting after the item ``after`` names."""
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit must be between 1 and 100, got {limit}", param="limit")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise ApiError(400, f"no input item with id '{after}'", param="after")
        start = ids.index(after) + 1
    page = ordered[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(ordered),
    }
