"""The Responses API's stored responses: what ``previous_response_id``, ``GET`` /
``DELETE /v1/responses/{id}``, ``/input_items`` and background responses read.

Responses are kept as records (a ``response`` object and the input items it answered),
the most recently used ``capacity`` of them, in the server's memory
(:class:`LocalRecords`; a restart forgets them all) or, behind ``serve --replicas``, in
one Ray actor every replica reads (``speculative.scaleout.ray_serve``), so a follow-up, a
poll or a cancel may reach any replica. Each keeps the whole conversation it saw, so a
follow-up finds it in one lookup and an earlier response's eviction or deletion does not
break the conversations that went on from it.

A background response decodes in the replica that took it (:class:`ResponseStore` keeps
its task); that replica writes its record as its status moves, and with shared records
it also looks, every ``WATCH_S``, for cancels asked of its responses through another
replica.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from speculative.server.conversations import Conversations
from speculative.server.protocol import ApiError

# the states a background response moves through before it ends
RUNNING = ("queued", "in_progress")
WATCH_S = 0.05  # how often shared records are read for status and cancels
EVENTS = "response.events"  # the kind of record that holds a background stream's events
EVENTS_SUFFIX = "/events"  # its id: the response's and this
STREAMS_KEPT = 64  # background streams whose events are kept to be streamed again
CANCEL_WAIT_S = 30.0  # how long a cancel through another replica waits for the response to end


@dataclass
class EventLog:
    """A background stream's events as they are made, in the replica decoding it; readers
    wait for more until it ends. ``flushed`` of them are written to the records."""

    events: list[dict[str, Any]] = field(default_factory=list)
    flushed: int = 0
    ended: bool = False
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def add(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        async with self.changed:
            self.changed.notify_all()

    async def end(self) -> None:
        self.ended = True
        async with self.changed:
            self.changed.notify_all()

    def _beyond(self, count: int) -> bool:
        return len(self.events) > count or self.ended

    async def after(self, start: int) -> AsyncIterator[dict[str, Any]]:
        """Its events from index ``start`` on, as they come, until it ends."""
        while True:
            while start < len(self.events):
                yield self.events[start]
                start += 1
            if self.ended:
                return
            async with self.changed:
                await self.changed.wait_for(functools.partial(self._beyond, start))


@dataclass
class StoredResponse:
    """One kept response: its ``response`` object as last reported (a background one's
    status moves) and the input items it was answered from (earlier turns included)."""

    body: dict[str, Any]
    input_items: list[dict[str, Any]]
    task: asyncio.Task | None = None  # a background response's decoding (in this replica)
    started: Callable[[], bool] | None = None  # whether its rows were admitted
    written: str = ""  # the status its record holds
    log: EventLog | None = None  # a background stream's events (where it decodes)

    @property
    def id(self) -> str:
        return self.body["id"]

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


Record = tuple[dict[str, Any], list[dict[str, Any]]]  # (response object, input items)


class ResponseRecords(Protocol):
    """Where kept responses live (coroutines: shared records are a remote call away)."""

    shared: bool  # whether other replicas read and write them too

    async def put(self, body: dict[str, Any], input_items: list[dict[str, Any]]) -> None: ...

    async def update(self, body: dict[str, Any]) -> None:
        """A kept response's new state (nothing where it was deleted meanwhile)."""

    async def get(self, response_id: str) -> Record | None: ...

    async def delete(self, response_id: str) -> bool: ...

    async def extend(self, record_id: str, items: list[dict[str, Any]]) -> bool:
        """Append to a record's items (a conversation's); False where it is not kept."""

    async def remove_item(self, record_id: str, item_id: str) -> bool:
        """Take one item (by its id) out of a record's items; False where there is none."""

    async def items_after(self, record_id: str, start: int) -> list[dict[str, Any]] | None:
        """A record's items from index ``start`` on; None where it is not kept."""

    async def ask_cancel(self, response_id: str) -> None:
        """Mark a running response to be cancelled by the replica decoding it."""

    async def cancels_asked(self, response_ids: list[str]) -> list[str]:
        """Which of ``response_ids`` were asked to cancel (each reported once)."""


def _running(body: dict[str, Any]) -> bool:
    """Whether a kept object is a response still decoding (a conversation has no status)."""
    return body.get("status") in RUNNING


@dataclass
class LocalRecords:
    """The last ``capacity`` responses and conversations in this process's memory, least
    recently used first out (a background stream's events with their response); a
    background response still decoding is never evicted.
    (Behind ``--replicas`` one Ray actor holds them.)"""

    capacity: int
    shared: bool = False
    kept: OrderedDict[str, Record] = field(default_factory=OrderedDict)
    cancels: set[str] = field(default_factory=set)

    async def put(self, body: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        self.kept[body["id"]] = (body, input_items)
        self.kept.move_to_end(body["id"])
        counted = [key for key, (kept, _) in self.kept.items() if kept.get("object") != EVENTS]
        finished = [key for key in counted if not _running(self.kept[key][0])]
        for key in finished[: max(0, len(counted) - self.capacity)]:
            del self.kept[key]
            self.kept.pop(_events_id(key), None)  # (a stream's events go with it)
        self._drop_old_streams()

    def _drop_old_streams(self) -> None:
        """Keep the events of the last ``STREAMS_KEPT`` background streams (a response
        that has ended stays kept, without them; one still decoding keeps them)."""
        streams = [key for key, (kept, _) in self.kept.items() if kept.get("object") == EVENTS]
        for key in streams[: max(0, len(streams) - STREAMS_KEPT)]:
            response = self.kept.get(key.removesuffix(EVENTS_SUFFIX))
            if response is None or not _running(response[0]):
                del self.kept[key]

    async def update(self, body: dict[str, Any]) -> None:
        kept = self.kept.get(body["id"])
        if kept is not None and not (_running(body) and not _running(kept[0])):  # (never back)
            self.kept[body["id"]] = (body, kept[1])

    async def get(self, response_id: str) -> Record | None:
        if response_id in self.kept:
            self.kept.move_to_end(response_id)
        return self.kept.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return self.kept.pop(response_id, None) is not None

    async def extend(self, record_id: str, items: list[dict[str, Any]]) -> bool:
        kept = self.kept.get(record_id)
        if kept is not None:
            self.kept[record_id] = (kept[0], [*kept[1], *items])
        return kept is not None

    async def remove_item(self, record_id: str, item_id: str) -> bool:
        kept = self.kept.get(record_id)
        left = [item for item in kept[1] if item.get("id") != item_id] if kept else []
        if kept is None or len(left) == len(kept[1]):
            return False
        self.kept[record_id] = (kept[0], left)
        return True

    async def items_after(self, record_id: str, start: int) -> list[dict[str, Any]] | None:
        kept = self.kept.get(record_id)
        return None if kept is None else kept[1][start:]

    async def ask_cancel(self, response_id: str) -> None:
        self.cancels.add(response_id)

    async def cancels_asked(self, response_ids: list[str]) -> list[str]:
        asked = [key for key in response_ids if key in self.cancels]
        self.cancels.difference_update(asked)
        return asked


@dataclass
class ResponseStore:
    """A server's view of its kept responses: the records (its own or shared) and the
    background responses this server is decoding."""

    capacity: int
    replicas: int = 1  # copies of the server behind its endpoint
    records: ResponseRecords | None = None  # None: this server's own LocalRecords
    decoding: dict[str, StoredResponse] = field(default_factory=dict)  # here, by id
    conversations: Conversations = field(init=False)  # kept in the same records
    _watcher: asyncio.Task | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.records is None:
            self.records = LocalRecords(self.capacity)
        self.conversations = Conversations(self.records, self.enabled)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    async def put(self, stored: StoredResponse) -> None:
        """Keep a response; a running one is a background response this server decodes
        (its ``task`` is set right after, before anything else can run here)."""
        body = stored.current()
        stored.written = body["status"]
        if stored.log is not None:  # (its events' record first: a reader finds both)
            await self.records.put({"id": _events_id(stored.id), "object": EVENTS}, [])
        await self.records.put(body, stored.input_items)
        if stored.running:
            self.decoding[stored.id] = stored
            self._watch()

    async def finish(self, stored: StoredResponse, body: dict[str, Any]) -> None:
        """A background response's end (whole, "failed" or "cancelled")."""
        stored.body = body
        if stored.log is not None:  # every event written before the status that ends it
            await self._flush(stored.log, stored.id)
            await stored.log.end()
        self.decoding.pop(stored.id, None)
        await self.records.update(body)

    async def events(self, response_id: str, after: int) -> AsyncIterator[dict[str, Any]]:
        """A background stream's events after sequence number ``after``, as they come
        until it ends (from this server's log where it decodes here, else from the
        records); 400 for a response that was not streamed."""
        stored = await self.get(response_id)
        recorded = await self.records.items_after(_events_id(response_id), 0)
        if stored.log is None and recorded is None:
            raise ApiError(
                400, f"response '{response_id}' was not made with background and stream, or "
                f"its events are no longer kept (the last {STREAMS_KEPT} streams'): GET it "
                "without stream", param="stream",
            )  # fmt: skip
        if stored.log is not None:
            return stored.log.after(after + 1)
        return self._recorded_events(response_id, after + 1)

    async def _recorded_events(self, response_id: str, start: int) -> AsyncIterator[dict[str, Any]]:
        """Events from the records, read every ``WATCH_S`` until the response has ended."""
        while True:
            record = await self.records.get(response_id)
            ended = record is None or not _running(record[0])
            for event in await self.records.items_after(_events_id(response_id), start) or []:
                start += 1
                yield event
            if ended:  # (its events were all written before its end)
                return
            await asyncio.sleep(WATCH_S)

    async def _flush(self, log: EventLog, response_id: str) -> None:
        """Write the events the records lack (each once, in order)."""
        start, log.flushed = log.flushed, len(log.events)
        if log.flushed > start:
            await self.records.extend(_events_id(response_id), log.events[start : log.flushed])

    async def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The kept response, or 404 (naming ``param`` where a request field gave the id)."""
        record = await self.records.get(response_id)
        if record is None or record[0].get("object") != "response":  # (not a conversation)
            raise self._missing(response_id, param)
        return self.decoding.get(response_id) or StoredResponse(*record)

    async def delete(self, response_id: str) -> None:
        """Forget a response (a running one is cancelled, wherever it decodes)."""
        stored = await self.get(response_id)
        await self.records.delete(response_id)
        await self.records.delete(_events_id(response_id))
        if stored.running:
            await self._cancel(stored)

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """Cancel a background response; its ``response`` object once it has ended."""
        stored = await self.get(response_id)
        if not stored.body.get("background"):
            raise ApiError(400, "only a background response can be cancelled")
        if stored.running:
            await self._cancel(stored)
            if stored.task is None:  # another replica's: read it once that replica ended it
                stored = await self._ended(response_id, stored)
        return stored.current()

    async def _cancel(self, stored: StoredResponse) -> None:
        if stored.task is not None:  # decoding here: its rows leave the batch
            stored.task.cancel()
            await asyncio.gather(stored.task, return_exceptions=True)
        else:  # decoding in another replica, which looks for the ask
            await self.records.ask_cancel(stored.id)

    async def _ended(self, response_id: str, stored: StoredResponse) -> StoredResponse:
        """The response once the replica decoding it has ended it (as it was if deleted)."""
        deadline = time.monotonic() + CANCEL_WAIT_S
        while stored.running and time.monotonic() < deadline:
            await asyncio.sleep(WATCH_S)
            record = await self.records.get(response_id)
            if record is None:
                break
            stored = StoredResponse(*record)
        return stored

    def _watch(self) -> None:
        """With shared records: while this server decodes background responses, write
        their moves to "in_progress" and their streams' new events, and end those another
        replica was asked to cancel."""
        if self.records.shared and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.get_running_loop().create_task(self._watching())

    async def _watching(self) -> None:
        while self.decoding:
            for stored in list(self.decoding.values()):
                body = stored.current()
                if body["status"] != stored.written:
                    stored.written = body["status"]
                    await self.records.update(body)
                if stored.log is not None:
                    await self._flush(stored.log, stored.id)
            for response_id in await self.records.cancels_asked(list(self.decoding)):
                stored = self.decoding.get(response_id)
                if stored is not None and stored.task is not None:
                    stored.task.cancel()
            await asyncio.sleep(WATCH_S)

    def _missing(self, response_id: str, param: str | None) -> ApiError:
        reason = (
            "it was never made here, was deleted, or is no longer kept (this server "
            f"keeps the last {self.capacity})"
            if self.enabled
            else "this server keeps no responses (serve --responses-store 0)"
        )
        if self.replicas > 1 and not self.records.shared:
            reason += (
                f"; this endpoint runs {self.replicas} replicas, each keeping its own "
                "responses: send the whole conversation as input instead"
            )
        return ApiError(
            404, f"no response with id '{response_id}': {reason}", param=param,
            code="response_not_found",
        )  # fmt: skip


def _events_id(response_id: str) -> str:
    """The record that holds a background stream's events."""
    return response_id + EVENTS_SUFFIX


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
