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

from batchspec.engine.grammar import Grammar
from batchspec.engine.logprobs import TokenLogprob
from batchspec.engine.sampling import SamplingParams, derive_row_seeds
from batchspec.engine.shaping import Penalties

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationParams:
    """One validated request as the engine loop sees it.

    Attributes:
        prompt: token ids, non-empty, already checked against the context length.
        max_tokens: new tokens at most (>= 1).
        stop: strings that end the output (the text is cut before the first one found).
        sampling: temperature, top-k and top-p; the default (temperature 0) is greedy decoding.
        seed: the request's seed; the row's seed is derived from it as ``batchspec.generate(..., seed=seed)``
            derives it for a single prompt, so both give the same tokens. None draws a fresh seed.
        cache_namespace: which requests may share cached prompt prefixes with this one (one API key and
            ``cache_salt``: :func:`batchspec.server.security.cache_namespace`).
        penalties: presence, frequency and repetition penalties and the logit bias (default: none).
        grammar: the grammar the output must follow (structured outputs, tool calls), or None.
        logprobs: None for no logprobs; else how many top alternatives each output token reports (0: its own only).
        prompt_logprobs: likewise for the prompt's tokens after the first (completions' ``echo``); each choice's
            row reads the prompt once more for them.
        n: how many choices (rows) to generate for the prompt; choice ``i`` samples with ``row_seeds()[i]``.
    """

    prompt: list[int]
    max_tokens: int
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    cache_namespace: str = ""
    penalties: Penalties = field(default_factory=Penalties)
    grammar: Grammar | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("prompt must hold at least one token")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1; got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1; got {self.n}")

    def row_seeds(self) -> list[int]:
        """One seed per choice, as ``batchspec.generate(..., seed=seed)`` derives them for ``n`` prompts (so
        choice 0's seed is the one a lone ``n = 1`` request gets)."""
        return derive_row_seeds(self.seed, self.n)


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
