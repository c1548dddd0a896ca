"""Requests being answered, and how the server ends them early: a per-request deadline, and shutdown's drain time.

Both act on the asyncio side: the request's handler receives a :class:`~batchspec.server.events.Failed` event
(504 for the deadline, 503 for shutdown; in a stream whose headers are sent, an error event) and its handle is
cancelled, so the engine loop releases the row before its next round, whatever round is running.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from batchspec.server.events import Failed, RequestHandle

logger = logging.getLogger(__name__)

TIMEOUT_STATUS = 504
SHUTDOWN_STATUS = 503


@dataclass
class InFlight:
    """The handles of the requests being answered; ``expired`` is set once shutdown's drain time has run out.

    Attributes:
        request_timeout_s: seconds from arrival after which a request is ended with a 504 (None: no deadline).
    """

    request_timeout_s: float | None = None
    expired: asyncio.Event = field(default_factory=asyncio.Event)
    _open: dict[str, tuple[RequestHandle, asyncio.TimerHandle | None]] = field(default_factory=dict)

    def open(self, handle: RequestHandle) -> None:
        """Track ``handle`` until :meth:`close`; with a request timeout, arm its deadline."""
        timer = None
        if self.request_timeout_s is not None:
            message = f"the request did not finish within the server's request timeout of {self.request_timeout_s:g} s"
            timer = handle.loop.call_later(
                self.request_timeout_s, end_request, handle, Failed(message, TIMEOUT_STATUS, "request_timeout")
            )
        self._open[handle.request_id] = (handle, timer)

    def close(self, handle: RequestHandle) -> None:
        _, timer = self._open.pop(handle.request_id, (handle, None))
        if timer is not None:
            timer.cancel()

    def begin_shutdown(self, timeout_s: float) -> None:
        """Let the requests in flight finish for ``timeout_s`` seconds, then end the rest with a 503."""
        logger.info("shutting down: %d requests in flight get up to %g s", len(self._open), timeout_s)
        asyncio.get_running_loop().call_later(timeout_s, self.expire)

    def expire(self) -> None:
        """End every request still in flight with a 503 and tell waiting request readers to give up."""
        self.expired.set()
        if self._open:
            logger.warning("shutdown drain time is over: ending %d requests", len(self._open))
        failure = Failed("the server shut down before this request finished", SHUTDOWN_STATUS, "shutting_down")
        for handle, _ in list(self._open.values()):
            end_request(handle, failure)


def end_request(handle: RequestHandle, failure: Failed) -> None:
    """Cancel ``handle``'s request (its row leaves before the next round) and give its handler ``failure``."""
    handle.cancel()
    handle.events.put_nowait(failure)
