"""uvicorn's h11 protocol with a deadline on each request's head and a bound on idle connections.

uvicorn closes a keep-alive connection idle between requests, but has no limit on the time a client takes to
send a request's line and headers: a connection that sends nothing, or a byte now and then, stays open for
ever. :func:`timed_protocol` gives a protocol class that closes a connection whose request head is not complete
within ``head_timeout_s`` of the connection opening, or of the first byte of a later request on a kept-alive
connection (until that byte, uvicorn's keep-alive timeout applies).

Connections without a request in progress (waiting for a head, or kept alive between requests) are *idle*; they
never count against the cap on requests handled at once (:class:`~batchspec.server.limits.RequestCap`). So that
many of them cannot use up the process's file descriptors either, at most ``max_idle`` are kept: a new
connection beyond them closes the idle connection that has waited longest.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEAD_TIMEOUT_S = 5.0
DEFAULT_MAX_IDLE = 512


class HeadTimeoutProtocol(H11Protocol):
    """:class:`H11Protocol` that closes connections slower than ``head_timeout_s`` to send a request head, and the
    longest-waiting idle connection when more than ``max_idle`` are idle.

    ``idle`` (the idle connections in the order they became idle) is shared by the connections of one server: each
    server gets a class of its own from :func:`timed_protocol`.
    """

    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S
    max_idle: int = DEFAULT_MAX_IDLE
    idle: dict[HeadTimeoutProtocol, None]
    head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()
        self._became_idle()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()
            self.idle.pop(self, None)
        elif not self.transport.is_closing():
            if self.head_timer is None:
                self._arm_head_timer()
            if self not in self.idle:
                self._became_idle()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._became_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self.idle.pop(self, None)
        super().connection_lost(exc)

    def _became_idle(self) -> None:
        self.idle[self] = None
        while len(self.idle) > self.max_idle:
            oldest = next(iter(self.idle))
            self.idle.pop(oldest)
            oldest.timeout_keep_alive_handler()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self.head_timer = self.loop.call_later(self.head_timeout_s, self._head_too_slow)

    def _cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_too_slow(self) -> None:
        self.head_timer = None
        if self.conn.their_state is h11.IDLE:
            self.timeout_keep_alive_handler()


def timed_protocol(head_timeout_s: float, max_idle: int = DEFAULT_MAX_IDLE) -> type[HeadTimeoutProtocol]:
    """A protocol class for uvicorn's ``http`` option whose request heads must arrive within ``head_timeout_s``
    and which keeps at most ``max_idle`` idle connections."""
    attributes = {"head_timeout_s": head_timeout_s, "max_idle": max_idle, "idle": {}}
    return type("TimedH11Protocol", (HeadTimeoutProtocol,), attributes)
