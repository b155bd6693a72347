"""OpenAI's Files and Batch APIs: upload a JSONL file of requests, run it as a batch
beside the live traffic, download the answers.

``POST /v1/files`` (multipart: ``file``, ``purpose``), ``GET /v1/files[/{id}[/content]]``,
``DELETE /v1/files/{id}``; ``POST /v1/batches`` (``input_file_id``, ``endpoint``
``/v1/chat/completions``, ``/v1/completions`` or ``/v1/responses``, ``completion_window``,
``metadata``), ``GET /v1/batches[/{id}]``, ``POST /v1/batches/{id}/cancel``. A batch's
lines (``custom_id``, ``method`` "POST", ``url`` its endpoint, ``body``) are checked when
it is created (a malformed file fails the batch, with each line's error); then each is
decoded as the same request sent alone would be, at most ``concurrency`` at a time, so
live requests keep rows of the batch. Answers go, in input order, to an output file
(OpenAI's batch output lines), requests that fail to an error file. Files and batches
live in the server's memory (``--files-store-bytes`` of files at most; a restart forgets
them), in the replica that took them.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from speculative.batch_jobs import openai_batch_line
from speculative.server.protocol import ApiError

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
             "/v1/responses": "responses"}  # fmt: skip
T = TypeVar("T")
# run one request alone: (the endpoint's name, its body) -> its whole answer, or ApiError
Answerer = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


def _id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def _found(kept: Mapping[str, T], key: str, kind: str, replicas: int) -> T:
    """``kept[key]``, or a 404 naming the ``kind`` of object (and, behind replicas, that
    each keeps its own)."""
    if key not in kept:
        where = (f"; this endpoint runs {replicas} replicas, each keeping its own files and "
                 "batches" if replicas > 1 else "")  # fmt: skip
        raise ApiError(404, f"no {kind} with id '{key}'{where}", code=f"{kind}_not_found")
    return kept[key]


@dataclass
class StoredFile:
    id: str
    filename: str
    purpose: str
    data: bytes
    created_at: int = field(default_factory=lambda: int(time.time()))

    def object(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": len(self.data),
                "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}  # fmt: skip


@dataclass
class FileStore:
    """Uploaded files and batches' output files, up to ``max_bytes`` in all."""

    max_bytes: int
    replicas: int = 1  # copies of the server behind its endpoint (each keeps its own files)
    files: OrderedDict[str, StoredFile] = field(default_factory=OrderedDict)

    def add(self, filename: str, purpose: str, data: bytes) -> StoredFile:
        held = sum(len(kept.data) for kept in self.files.values())
        if held + len(data) > self.max_bytes:
            raise ApiError(
                413, f"the server keeps at most {self.max_bytes} bytes of files "
                f"(serve --files-store-bytes) and holds {held}: delete some",
                code="files_store_full",
            )  # fmt: skip
        stored = StoredFile(_id("file-"), filename, purpose, data)
        self.files[stored.id] = stored
        return stored

    def get(self, file_id: str) -> StoredFile:
        return _found(self.files, file_id, "file", self.replicas)

    def delete(self, file_id: str) -> dict[str, Any]:
        self.get(file_id)
        del self.files[file_id]
        return {"id": file_id, "object": "file", "deleted": True}


@dataclass
class BatchLine:
    custom_id: str
    body: dict[str, Any]


@dataclass
class Batch:
    """One batch: its requests, status, counts and files."""

    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, Any] | None
    id: str = field(default_factory=lambda: _id("batch_"))
    status: str = "validating"
    created_at: int = field(default_factory=lambda: int(time.time()))
    times: dict[str, int] = field(default_factory=dict)  # "in_progress_at", … as they come
    total: int = 0
    completed: int = 0
    failed: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)  # the file's, when it failed
    task: asyncio.Task | None = None

    def move(self, status: str) -> None:
        self.status = status
        self.times[f"{status}_at"] = int(time.time())

    def object(self) -> dict[str, Any]:
        stamps = ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling",
                  "cancelled")  # fmt: skip
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status, "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id, "created_at": self.created_at,
            **{f"{name}_at": self.times.get(f"{name}_at") for name in stamps},
            "expires_at": None,
            "request_counts": {"total": self.total, "completed": self.completed,
                               "failed": self.failed},
            "metadata": self.metadata,
        }  # fmt: skip


def batch_lines(data: bytes, endpoint: str) -> tuple[list[BatchLine], list[dict[str, Any]]]:
    """A batch file's requests, and each malformed line's error (OpenAI's shape)."""
    lines, errors = [], []
    seen: set[str] = set()
    for number, text in enumerate(data.decode("utf-8", "replace").splitlines(), start=1):
        if not text.strip():
            continue
        problem = None
        try:
            request = json.loads(text)
        except json.JSONDecodeError as exc:
            request, problem = None, f"not JSON ({exc.msg})"
        if problem is None and not isinstance(request, dict):
            problem = "a line must be a JSON object"
        elif problem is None:
            custom_id, body = request.get("custom_id"), request.get("body")
            if not isinstance(custom_id, str) or not custom_id:
                problem = "custom_id must be a non-empty string"
            elif custom_id in seen:
                problem = f"custom_id '{custom_id}' repeats"
            elif request.get("method", "POST") != "POST" or request.get("url") != endpoint:
                problem = f"url must be the batch's endpoint {endpoint} (POST)"
            elif not isinstance(body, dict):
                problem = "body must be a request object"
            else:
                seen.add(custom_id)
                lines.append(BatchLine(custom_id, body))
        if problem is not None:
            errors.append({"code": "invalid_request", "message": problem, "param": None,
                           "line": number})  # fmt: skip
    if not lines and not errors:
        errors.append({"code": "empty_file", "message": "the file holds no requests",
                       "param": None, "line": None})  # fmt: skip
    return lines, errors


@dataclass
class Batches:
    """The server's batches: created from uploaded files, each run as a task."""

    files: FileStore
    answer: Answerer
    concurrency: int = 1  # a batch's requests decoding at once
    kept: OrderedDict[str, Batch] = field(default_factory=OrderedDict)

    def create(self, request: dict[str, Any]) -> Batch:
        endpoint = request.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}",
                           param="endpoint")  # fmt: skip
        source = self.files.get(str(request.get("input_file_id")))
        batch = Batch(endpoint, source.id, str(request.get("completion_window", "24h")),
                      request.get("metadata"))  # fmt: skip
        self.kept[batch.id] = batch
        lines, errors = batch_lines(source.data, endpoint)
        if errors:
            batch.errors = errors
            batch.move("failed")
            return batch
        batch.total = len(lines)
        batch.move("in_progress")
        batch.task = asyncio.get_running_loop().create_task(self._run(batch, lines))
        return batch

    def get(self, batch_id: str) -> Batch:
        return _found(self.kept, batch_id, "batch", self.files.replicas)

    async def cancel(self, batch_id: str) -> Batch:
        """Stop a batch: its requests decoding leave the batch; the answers it has are
        written out."""
        batch = self.get(batch_id)
        if batch.status == "in_progress" and batch.task is not None:
            batch.move("cancelling")
            batch.task.cancel()
            await asyncio.gather(batch.task, return_exceptions=True)
        return batch

    async def _run(self, batch: Batch, lines: list[BatchLine]) -> None:
        name = ENDPOINTS[batch.endpoint]
        gate = asyncio.Semaphore(self.concurrency)
        outputs: list[dict[str, Any] | None] = [None] * len(lines)

        async def one(index: int, line: BatchLine) -> None:
            async with gate:
                outputs[index] = await self._answered(name, line)
            if outputs[index]["error"] is None:
                batch.completed += 1
            else:
                batch.failed += 1

        tasks = [asyncio.ensure_future(one(i, line)) for i, line in enumerate(lines)]
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._write(batch, outputs)
            batch.move("cancelled")
            return
        batch.move("finalizing")
        self._write(batch, outputs)
        batch.move("completed")

    async def _answered(self, name: str, line: BatchLine) -> dict[str, Any]:
        """A request's output line: its answer, or its error."""
        try:
            return openai_batch_line(line.custom_id, 200, await self.answer(name, line.body))
        except Exception as exc:  # (an ApiError as it is; anything else as a 500)
            if not isinstance(exc, ApiError):
                exc = ApiError(500, f"internal error: {type(exc).__name__}", "server_error")
            error = {"code": exc.code or exc.type, "message": exc.message}
            return openai_batch_line(line.custom_id, exc.status, exc.body(), error)

    def _write(self, batch: Batch, outputs: list[dict[str, Any] | None]) -> None:
        """The output file (answers, input order) and the error file (failed requests)."""
        done = [line for line in outputs if line is not None]
        good = [line for line in done if line["error"] is None]
        bad = [line for line in done if line["error"] is not None]
        for kept, kind in ((good, "output"), (bad, "error")):
            if not kept:
                continue
            data = "".join(json.dumps(line) + "\n" for line in kept).encode()
            stored = self.files.add(f"{batch.id}_{kind}.jsonl", "batch_output", data)
            setattr(batch, f"{kind}_file_id", stored.id)


def listed(objects: list[dict[str, Any]], limit: int, after: str | None) -> dict[str, Any]:
    """A list page of objects, newest first, after the one ``after`` names."""
    newest = objects[::-1]
    ids = [item["id"] for item in newest]
    start = ids.index(after) + 1 if after in ids else 0
    page = newest[start : start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + limit < len(newest)}  # fmt: skip
