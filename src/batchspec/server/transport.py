"""uvicorn's h11 protocol with a deadline on each request's head.

uvicorn closes a keep-alive connection idle between requests, but has no limit on the time a client takes to
send a request's line and headers: a connection that sends nothing, or a byte now and then, stays open for
ever. :func:`timed_protocol` gives a protocol class that closes a connection whose request head is not complete
within ``head_timeout_s`` of the connection opening or of the previous response.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadTimeoutProtocol(H11Protocol):
    """:class:`H11Protocol` that closes connections slower than ``head_timeout_s`` to send a request head."""

    head_timeout_s: float = 30.0
    head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._head_arrived()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._head_arrived()
        self.head_timer = self.loop.call_later(self.head_timeout_s, self._head_too_slow)

    def _head_arrived(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_too_slow(self) -> None:
        self.head_timer = None
        if self.conn.their_state is h11.IDLE:
            self.timeout_keep_alive_handler()


def timed_protocol(head_timeout_s: float) -> type[HeadTimeoutProtocol]:
    """A protocol class for uvicorn's ``http`` option whose request heads must arrive within ``head_timeout_s``."""
    return type("TimedH11Protocol", (HeadTimeoutProtocol,), {"head_timeout_s": head_timeout_s})
