"""Serving one request: submit it to the engine loop (one row per choice), then answer with one body or a
server-sent event stream once every choice finished.

A stream's response headers are sent only once the request's first round is done, so that a failure in that
round is still a plain 500. While the request runs, a watcher notices the client leaving and cancels the request,
which frees its row before the next round.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from batchspec.engine import GenerationParams
from batchspec.server.errors import APIError
from batchspec.server.events import Disconnected, Event, Failed, Finished, RequestHandle, Tokens
from batchspec.server.lifecycle import InFlight
from batchspec.server.loop import EngineLoop, QueueFull, ServerClosing
from batchspec.server.prometheus import ServerMetrics
from batchspec.server.protocol import wire
from batchspec.server.response_bodies import ChoiceOutput, ReplyContext, ReplyFormat

logger = logging.getLogger(__name__)

CLIENT_CLOSED = 499


@dataclass
class Tracker:
    """Records one request's timing and outcome into the metrics once its last choice finished (errors answered
    before any body is sent are counted by the application's error handlers)."""

    handle: RequestHandle
    metrics: ServerMetrics
    endpoint: str
    first_token_at: float | None = None
    finished: list[Finished] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.finished) == self.handle.params.n

    def saw(self, event: Event) -> None:
        if isinstance(event, Tokens) and event.token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
            self.metrics.ttft.observe(self.first_token_at - self.handle.created)
        elif isinstance(event, Finished):
            self.finished.append(event)
            if self.done:
                self.metrics.observe_finished(
                    prompt_tokens=event.prompt_tokens, latency_s=time.perf_counter() - self.handle.created,
                    completion_tokens=sum(f.completion_tokens for f in self.finished),
                )
                self.count(200)
        elif isinstance(event, Disconnected):
            self.count(CLIENT_CLOSED)

    def count(self, status: int) -> None:
        self.metrics.requests.labels(endpoint=self.endpoint, status=str(status)).inc()


@dataclass
class DisconnectWatch:
    """Waits for ``http.disconnect`` and then cancels the request and wakes its handler; closing it also ends
    the request's place among those ``inflight``."""

    handle: RequestHandle
    inflight: InFlight
    task: asyncio.Task | None = field(default=None, repr=False)

    @classmethod
    def start(cls, receive: Callable, handle: RequestHandle, inflight: InFlight) -> DisconnectWatch:
        watch = cls(handle, inflight)
        watch.task = asyncio.create_task(watch._watch(receive))
        return watch

    async def _watch(self, receive: Callable) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.handle.cancel()
        self.handle.events.put_nowait(Disconnected())

    def close(self) -> None:
        """Stop watching and cancel the request if it is still running (a no-op once it finished)."""
        if self.task is not None:
            self.task.cancel()
        self.handle.cancel()
        self.inflight.close(self.handle)


class EventStream(StreamingResponse):
    """An SSE response that cancels its request however the stream ends."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


@dataclass(frozen=True)
class Reply:
    """How to answer one submitted request."""

    fmt: ReplyFormat
    ctx: ReplyContext
    stream: bool
    include_usage: bool


def submit(
    loop: EngineLoop, metrics: ServerMetrics, inflight: InFlight, request_id: str, params: GenerationParams
) -> RequestHandle:
    """A handle for ``params`` queued in the engine loop and tracked in ``inflight`` (until the reply's watch
    closes); 429 when the queue is full, 503 when closing."""
    handle = RequestHandle(request_id, params, asyncio.get_running_loop())
    try:
        loop.submit(handle)
    except QueueFull as error:
        metrics.rejected.inc()
        raise APIError(
            429, str(error), code="queue_full", headers={"Retry-After": str(error.retry_after)}
        ) from error
    except ServerClosing as error:
        raise APIError(503, str(error), code="shutting_down") from error
    inflight.open(handle)
    return handle


async def answer(http: Request, handle: RequestHandle, tracker: Tracker, reply: Reply, inflight: InFlight) -> Response:
    """Wait for the request's events and answer with one body or, for ``reply.stream``, an event stream."""
    watch = DisconnectWatch.start(http.receive, handle, inflight)
    handed_over = False
    try:
        if not reply.stream:
            return await _whole(handle, tracker, reply)
        first = await _next(handle, tracker)
        response = EventStream(_sse(first, handle, tracker, reply), on_close=watch.close)
        handed_over = True
        return response
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        if not handed_over:
            watch.close()


async def _next(handle: RequestHandle, tracker: Tracker) -> Tokens | Finished:
    """The next engine event; a failure raises a 500, a client that left ends the request."""
    event = await handle.next_event()
    tracker.saw(event)
    if isinstance(event, Failed):
        raise APIError(event.status, event.message, code=event.code)
    if isinstance(event, Disconnected):
        raise ClientGone
    return event


class ClientGone(Exception):
    """The client closed the connection; nobody reads the answer."""


async def _whole(handle: RequestHandle, tracker: Tracker, reply: Reply) -> JSONResponse:
    choices = [ChoiceOutput() for _ in range(handle.params.n)]
    while not tracker.done:
        event = await _next(handle, tracker)
        choices[event.index].add(event)
    return JSONResponse(wire(reply.fmt.full(reply.ctx, choices)))


async def _sse(first: Tokens | Finished, handle: RequestHandle, tracker: Tracker, reply: Reply) -> AsyncIterator[str]:
    """Every choice's chunks as its events come (each chunk names its choice's ``index``), then the usage."""
    fmt, ctx = reply.fmt, reply.ctx
    for chunk in fmt.opening(ctx, handle.params.n):
        yield _data(wire(chunk), fmt.sse_events)
    event: Tokens | Finished = first
    try:
        while True:
            for chunk in fmt.delta(ctx, event) if isinstance(event, Tokens) else fmt.closing(ctx, event):
                yield _data(wire(chunk), fmt.sse_events)
            if tracker.done:
                break
            event = await _next(handle, tracker)
    except APIError as error:
        tracker.count(error.status)
        yield _data(error.body.model_dump())
        return
    except ClientGone:
        return
    if reply.include_usage:
        yield _data(wire(fmt.usage(ctx, tracker.finished)))
    if not fmt.sse_events:
        yield "data: [DONE]\n\n"


def _data(payload: dict, named: bool = False) -> str:
    """One SSE event; ``named``: with an ``event:`` line giving the payload's ``type``."""
    name = f"event: {payload['type']}\n" if named else ""
    return f"{name}data: {json.dumps(payload, ensure_ascii=False)}\n\n"
