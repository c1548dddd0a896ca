"""How much requests may ask of the server: requests handled at once, body size and shape, time to send the body,
time to be answered, output length.

:class:`RequestCap` answers a request beyond ``max_connections`` handled at once with a 503 (``server_busy``,
``Retry-After``); ``/health`` is always answered, and connections that have sent no request do not count.
:class:`BodyGuard` reads every request body before the application sees it: a ``Content-Length`` beyond the limit
is a 413 before any of the body is read, a body sent in chunks is a 413 as soon as its bytes pass the limit, a
body that has not fully arrived within the read timeout is a 408, and one still arriving when shutdown's drain
time runs out is a 503. Each of these answers closes the connection.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchspec.config import check_fields, integer, number, option, optional
from batchspec.server.errors import APIError
from batchspec.server.security import Refuse, header

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_MAX_TOKENS = 512
DEFAULT_MAX_CONNECTIONS = 128
DEFAULT_MAX_MESSAGES = 1024
DEFAULT_MAX_CONTENT_PARTS = 1024
BUSY_RETRY_AFTER_S = 1
SECONDS = number(0.0, above=True)  # the check of a timeout
ALWAYS_ANSWERED = frozenset({"/health"})
CLOSE = {"Connection": "close"}


@dataclass(frozen=True)
class RequestLimits:
    """Limits of every request.

    Attributes:
        max_body_bytes: the largest request body accepted; a larger one is a 413.
        read_timeout_s: seconds a client has to send a request's body once its head has arrived (else a 408).
        request_timeout_s: seconds from arrival to the last token (None: no deadline); past it, a 504.
        default_max_tokens: the output budget of a request without ``max_tokens`` (capped by the context).
        max_connections: requests handled at once, from their head to the end of their answer (streams
            included); one more is a 503 ``server_busy``. ``/health`` is always answered and does not count.
        max_messages: messages of one chat request; more is a 400 ``too_many_messages``.
        max_content_parts: content parts of one chat request, all messages together; more is a 400.
    """

    max_body_bytes: int = option(
        DEFAULT_MAX_BODY_BYTES, check=integer(1), metavar="N", minimum=1,
        help="Largest request body; a larger one gets 413.",
    )
    read_timeout_s: float = option(
        DEFAULT_READ_TIMEOUT_S, check=SECONDS, metavar="S", minimum=0.001,
        help="Seconds a client has to send a request's body once its headers have arrived (408).",
    )
    request_timeout_s: float | None = option(
        None, check=optional(SECONDS), metavar="S", minimum=0.001,
        help="Seconds from arrival to the last token; a slower request is ended with 504 (default: none).",
    )
    default_max_tokens: int = option(
        DEFAULT_MAX_TOKENS, check=integer(1), metavar="N", minimum=1,
        help="Output budget of a request without max_tokens (capped by the context).",
    )
    max_connections: int = option(
        DEFAULT_MAX_CONNECTIONS, check=integer(1), metavar="N", minimum=1,
        help="Requests handled at once (streams included; idle connections and /health do not count); one more "
        "gets 503 server_busy with Retry-After.",
    )
    max_messages: int = option(
        DEFAULT_MAX_MESSAGES, check=integer(1), metavar="N", minimum=1,
        help="Messages of one chat request (400 beyond).",
    )
    max_content_parts: int = option(
        DEFAULT_MAX_CONTENT_PARTS, check=integer(1), metavar="N", minimum=1,
        help="Content parts of one chat request, all messages together (400 beyond).",
    )

    def __post_init__(self) -> None:
        check_fields(self)


class RequestCap:
    """ASGI middleware: at most ``limit`` HTTP requests handled at once; one more gets a 503 with ``Retry-After``
    (and the connection is closed), except on :data:`ALWAYS_ANSWERED` paths, which are cheap and never counted."""

    def __init__(self, app: ASGIApp, limit: int, refuse: Refuse) -> None:
        self.app = app
        self.limit = limit
        self.refuse = refuse
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in ALWAYS_ANSWERED:
            await self.app(scope, receive, send)
            return
        if self.active >= self.limit:
            error = APIError(
                503, f"the server is handling as many requests as it accepts at once ({self.limit}); retry later",
                code="server_busy", headers={"Retry-After": str(BUSY_RETRY_AFTER_S), **CLOSE},
            )
            await self.refuse(error, scope, receive, send)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


class BodyGuard:
    """ASGI middleware: reads the whole body within the limits, then hands the request on with that body."""

    def __init__(self, app: ASGIApp, limits: RequestLimits, expired: asyncio.Event, refuse: Refuse) -> None:
        self.app = app
        self.limits = limits
        self.expired = expired
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
        except APIError as error:
            await self.refuse(error, scope, receive, send)
            return
        if body is not None:
            await self.app(scope, _replay(body, receive), send)

    async def _read(self, scope: Scope, receive: Receive) -> bytes | None:
        """The body, or None if the client left; raises the APIError that refuses it."""
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limits.max_body_bytes:
            raise self._too_large()
        chunks: list[bytes] = []
        size = 0
        deadline = asyncio.get_running_loop().time() + self.limits.read_timeout_s
        expired = asyncio.ensure_future(self.expired.wait())
        try:
            while True:
                message = await self._next(receive, deadline, expired)
                if message["type"] == "http.disconnect":
                    return None
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > self.limits.max_body_bytes:
                    raise self._too_large()
                if not message.get("more_body", False):
                    return b"".join(chunks)
        finally:
            expired.cancel()

    async def _next(self, receive: Receive, deadline: float, expired: asyncio.Future) -> Message:
        """The next message of the body; raises a 408 past ``deadline`` and a 503 once ``expired`` is done."""
        arriving = asyncio.ensure_future(receive())
        remaining = deadline - asyncio.get_running_loop().time()
        done, _ = await asyncio.wait({arriving, expired}, timeout=max(remaining, 0.0),
                                     return_when=asyncio.FIRST_COMPLETED)
        if arriving in done:
            return arriving.result()
        arriving.cancel()
        if expired in done:
            raise APIError(503, "the server is shutting down", code="shutting_down", headers=CLOSE)
        raise APIError(408, f"the request body did not arrive within {self.limits.read_timeout_s:g} s",
                       code="read_timeout", headers=CLOSE)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than the server's limit of {self.limits.max_body_bytes} "
                        "bytes", code="request_too_large", headers=CLOSE)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` as one message, then what the client sends next (its disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay
