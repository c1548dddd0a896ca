"""What the engine thread tells a request's handler, and the handle through which it does.

The engine loop runs in its own thread; each request's HTTP handler runs on the server's asyncio event loop.
A :class:`RequestHandle` carries events across: the engine thread pushes them with ``call_soon_threadsafe``
into the handler's ``asyncio.Queue``, and the handler cancels through a thread-safe flag.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from batchspec.engine import GenerationParams, TokenLogprob

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tokens:
    """New output of choice ``index``: ``text`` (final, may be empty while text is held back) and the ``token_ids``
    behind it, with their logprobs when the request asked for them; the choice's first event carries its prompt's
    logprobs when the request asked for those."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    index: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class Finished:
    """Choice ``index`` of the request is done: ``finish_reason`` is "stop" (EOS or a stop string) or "length"."""

    finish_reason: str
    prompt_tokens: int
    token_ids: list[int]
    index: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Failed:
    """The request ends with an error: a round that served it raised (500), or the server ended it early: its
    deadline passed (504) or shutdown's drain time ran out (503)."""

    message: str
    status: int = 500
    code: str = "generation_failed"


@dataclass(frozen=True)
class Disconnected:
    """The client closed the connection (pushed by the handler's disconnect watcher, not by the engine)."""


Event = Tokens | Finished | Failed | Disconnected


@dataclass
class RequestHandle:
    """One request's channel between its handler (asyncio) and the engine thread."""

    request_id: str
    params: GenerationParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.perf_counter)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def push(self, event: Tokens | Finished | Failed) -> None:
        """Deliver ``event`` to the handler; called from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            logger.debug("request %s: event loop closed, dropped %s", self.request_id, type(event).__name__)

    async def next_event(self) -> Event:
        return await self.events.get()

    def cancel(self) -> None:
        """The client left: the engine loop retires the row before its next round. Idempotent."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()
