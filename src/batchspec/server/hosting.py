"""Running the application with uvicorn: in a thread beside the engine loop, which the calling thread drives
(``batchspec serve``, the online benchmark), or in a background thread with the loop on a thread of its own (tests).

In the foreground, SIGTERM and SIGINT start a graceful shutdown: the listening socket closes, the requests in
flight get the application's shutdown timeout to finish and are then ended with a 503, the engine loop drains,
and the process exits with status 0. uvicorn's own graceful-shutdown timeout, a few seconds later, backs this up.
"""

from __future__ import annotations

import logging
import math
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI

from batchspec.config import check_fields, integer, number, option, optional
from batchspec.server.app import Front
from batchspec.server.loop import EngineLoop
from batchspec.server.transport import DEFAULT_HEAD_TIMEOUT_S, DEFAULT_MAX_IDLE, timed_protocol

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 60.0
SHUTDOWN_TIMEOUT_S = 120.0
SHUTDOWN_BACKSTOP_S = 5.0
DEFAULT_KEEP_ALIVE_S = 5

T = TypeVar("T")


def a_file(name: str, value: str) -> str:
    """The check of a file option: a path to an existing file."""
    if not Path(value).is_file():
        raise ValueError(f"{value} does not exist or is not a file")
    return str(value)


@dataclass(frozen=True)
class HttpOptions:
    """How uvicorn serves the application.

    Attributes:
        ssl_keyfile, ssl_certfile: serve HTTPS with this PEM key and certificate (both or neither).
        keep_alive_timeout_s: seconds an idle keep-alive connection stays open between requests.
        head_timeout_s: seconds a client has to send a request's line and headers, from the moment it connects
            (or, on a kept-alive connection, from the first byte of its next request); else it is closed.
        max_idle_connections: connections kept open without a request in progress; a new connection beyond them
            closes the one idle longest. (The cap on requests handled at once is ``RequestLimits.max_connections``.)
    """

    ssl_keyfile: str | None = option(None, check=optional(a_file), metavar="PATH",
                                     help="Serve HTTPS with this PEM private key.")
    ssl_certfile: str | None = option(None, check=optional(a_file), metavar="PATH",
                                      help="Serve HTTPS with this PEM certificate.")
    keep_alive_timeout_s: int = option(DEFAULT_KEEP_ALIVE_S, check=integer(1), metavar="S", minimum=1,
                                       help="Seconds an idle connection stays open.")
    head_timeout_s: float = option(
        DEFAULT_HEAD_TIMEOUT_S, check=number(0.0, above=True), metavar="S", minimum=0.001,
        help="Seconds a client has to send a request's line and headers once connected (or once it starts its next "
        "request on a kept-alive connection); a slower one is disconnected.",
    )
    max_idle_connections: int = option(
        DEFAULT_MAX_IDLE, check=integer(1), metavar="N", minimum=1,
        help="Connections kept open without a request in progress; a new one beyond them closes the connection "
        "idle longest.",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("HTTPS needs both a key file and a certificate file")

    @property
    def scheme(self) -> str:
        return "http" if self.ssl_certfile is None else "https"


class DrainingServer(uvicorn.Server):
    """A uvicorn server that starts the application's shutdown clock as soon as it begins shutting down."""

    def __init__(self, config: uvicorn.Config, front: Front) -> None:
        super().__init__(config)
        self.front = front

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.front.begin_shutdown()
        await super().shutdown(sockets)


def make_server(app: FastAPI, http: HttpOptions, log_level: str, **where: Any) -> DrainingServer:
    """A server for ``app`` (built by :func:`~batchspec.server.app.create_app`) at ``where`` (host and port)."""
    front: Front = app.state.front
    config = uvicorn.Config(
        app, log_level=log_level, lifespan="on", http=timed_protocol(http.head_timeout_s, http.max_idle_connections),
        ssl_keyfile=http.ssl_keyfile, ssl_certfile=http.ssl_certfile, timeout_keep_alive=http.keep_alive_timeout_s,
        timeout_graceful_shutdown=math.ceil(front.shutdown_timeout_s + SHUTDOWN_BACKSTOP_S), **where,
    )
    return DrainingServer(config, front)


def serve_forever(
    app: FastAPI, host: str, port: int, *, log_level: str = "info", http: HttpOptions = HttpOptions()
) -> None:
    """Serve ``app`` on ``host:port`` until SIGTERM or SIGINT, then drain and return. The calling thread (the one
    that loaded the models) drives the engine loop; uvicorn runs in a thread beside it."""
    server = make_server(app, http, log_level, host=host, port=port)
    loop = app.state.serving.loop
    thread = threading.Thread(target=_serve_then_stop, args=(server, loop), name="batchspec-http", daemon=True)
    with _signals_to(server):
        loop.drive(started=thread.start)
    thread.join()
    if not server.started:
        raise OSError(f"the server could not start on {host}:{port} (see the log above)")


def _serve_then_stop(server: uvicorn.Server, loop: EngineLoop, sockets: list[socket.socket] | None = None) -> None:
    """Run ``server``; when it ends (drained, or never started), the engine loop stops too. uvicorn ends a failed
    startup (a port taken) with ``sys.exit``, which here ends only this thread: ``server.started`` tells."""
    try:
        server.run(sockets=sockets)
    except SystemExit:
        logger.debug("uvicorn exited during startup")
    finally:
        loop.stop(timeout=0)


@contextmanager
def _signals_to(server: uvicorn.Server) -> Iterator[None]:
    """SIGTERM and SIGINT begin ``server``'s graceful shutdown (a second SIGINT forces it), as uvicorn's own
    handlers do when it runs on the main thread."""

    def shut_down(signum: int, frame) -> None:
        logger.info("shutting down after %s", signal.Signals(signum).name)
        server.handle_exit(signum, frame)

    previous = {sig: signal.signal(sig, shut_down) for sig in (signal.SIGTERM, signal.SIGINT)}
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
def serve_in_thread(
    app: FastAPI, host: str = "127.0.0.1", *, log_level: str = "warning", http: HttpOptions = HttpOptions()
) -> Iterator[RunningServer]:
    """Serve ``app`` on a free port of ``host`` in a daemon thread for the duration of the ``with`` block (its
    engine loop drives rounds on a thread of its own)."""
    sock = _free_socket(host)
    server = make_server(app, http, log_level)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="batchspec-http", daemon=True)
    thread.start()
    running = RunningServer(_url(http, sock), app, server, thread)
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


def serve_while(
    app: FastAPI, work: Callable[[str], T], host: str = "127.0.0.1", *, log_level: str = "warning",
    http: HttpOptions = HttpOptions(),
) -> T:
    """``work(url)``, run in a thread while ``app`` is served on a free port of ``host``; meanwhile the calling
    thread (the one that loaded the models) drives the engine loop, as in :func:`serve_forever`."""
    sock = _free_socket(host)
    server = make_server(app, http, log_level)
    loop: EngineLoop = app.state.serving.loop
    serving = threading.Thread(target=_serve_then_stop, args=(server, loop, [sock]), name="batchspec-http", daemon=True)
    running = RunningServer(_url(http, sock), app, server, serving)
    outcome: dict[str, Any] = {}

    def client() -> None:
        try:
            _wait_started(running)
            outcome["result"] = work(running.url)
        except BaseException as error:
            outcome["error"] = error
        finally:
            server.should_exit = True

    worker = threading.Thread(target=client, name="batchspec-client", daemon=True)

    def started() -> None:
        serving.start()
        worker.start()

    try:
        loop.drive(started=started)
    finally:
        server.should_exit = True
        serving.join(SHUTDOWN_TIMEOUT_S)
        sock.close()
    worker.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _free_socket(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    return sock


def _url(http: HttpOptions, sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"{http.scheme}://{host}:{port}"
