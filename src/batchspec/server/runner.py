"""Running the application with uvicorn: in the foreground (``batchspec serve``) or in a background thread
(tests and the online benchmark).

In the foreground, SIGTERM and SIGINT start a graceful shutdown: the listening socket closes, every request in
flight is answered, the engine loop drains, and the process exits with status 0.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 60.0
SHUTDOWN_TIMEOUT_S = 120.0


def serve_forever(app: FastAPI, host: str, port: int, *, log_level: str = "info") -> None:
    """Serve ``app`` on ``host:port`` until SIGTERM or SIGINT, then drain and return."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on"))
    with _signals_end_quietly():
        server.run()
    if not server.started:
        raise OSError(f"the server could not start on {host}:{port} (see the log above)")


@contextmanager
def _signals_end_quietly() -> Iterator[None]:
    """uvicorn handles SIGTERM/SIGINT while it runs and re-raises them afterwards; with these handlers in
    place the re-raised signal ends nothing, so a drained server exits normally (status 0)."""

    def drained(signum: int, frame) -> None:
        logger.info("shut down after %s", signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, drained) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass
class RunningServer:
    """A server running in a background thread; ``url`` is its base URL (``http://127.0.0.1:PORT``)."""

    url: str
    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Graceful shutdown: requests in flight are answered first."""
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"the server at {self.url} did not stop within {timeout} s")


@contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", *, log_level: str = "warning") -> Iterator[RunningServer]:
    """Serve ``app`` on a free port of ``host`` in a daemon thread for the duration of the ``with`` block."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="batchspec-http", daemon=True)
    thread.start()
    running = RunningServer(f"http://{host}:{port}", app, server, thread)
    try:
        _wait_started(running)
        yield running
    finally:
        running.stop()
        sock.close()


def _wait_started(running: RunningServer) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not running.server.started:
        if not running.thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server at {running.url} did not start")
        time.sleep(0.01)
