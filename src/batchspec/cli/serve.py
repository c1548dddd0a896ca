"""``batchspec serve``: an OpenAI-compatible HTTP server with continuous admission."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from batchspec.cli.common import model_choice, settings_choice, with_options
from batchspec.cli.errors import user_errors
from batchspec.config import SpecConfig
from batchspec.devices import resolve_device
from batchspec.engine import graph_mode
from batchspec.models.choice import ModelChoice, load_models
from batchspec.server.hosting import DEFAULT_KEEP_ALIVE_S, HttpOptions
from batchspec.server.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONTENT_PARTS,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_MAX_TOKENS,
    DEFAULT_READ_TIMEOUT_S,
    RequestLimits,
)
from batchspec.server.security import API_KEY_ENV, SecurityConfig
from batchspec.server.settings import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    ServerConfig,
)
from batchspec.server.transport import DEFAULT_HEAD_TIMEOUT_S, DEFAULT_MAX_IDLE


class LogLevel(StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


HostOption = Annotated[
    str, typer.Option("--host", metavar="ADDRESS", help="Address to listen on; the default accepts local clients only.")
]
PortOption = Annotated[int, typer.Option("--port", metavar="PORT", min=1, max=65535, help="TCP port to listen on.")]
MaxQueueOption = Annotated[
    int,
    typer.Option(
        "--max-queue", metavar="N", min=0,
        help="Requests that may wait for a free row; beyond that the server answers 429 with Retry-After.",
    ),
]
ServedNameOption = Annotated[
    str | None,
    typer.Option("--served-model-name", metavar="NAME", help="The model name clients send (default: the preset)."),
]
LogLevelOption = Annotated[LogLevel, typer.Option("--log-level", help="Server log verbosity.")]
ApiKeyOption = Annotated[
    str | None,
    typer.Option(
        "--api-key", metavar="KEY", envvar=API_KEY_ENV, show_default=False,
        help="Require 'Authorization: Bearer KEY' on every route but /health (prefer the environment variable: "
        "a command line is visible to other users).",
    ),
]
AllowedOriginsOption = Annotated[
    str | None,
    typer.Option("--allowed-origins", metavar="ORIGINS",
                 help="Comma-separated origins (https://app.example.com, or *) whose web pages may call the API "
                 "(CORS); default none."),
]
AllowedHostsOption = Annotated[
    str | None,
    typer.Option("--allowed-hosts", metavar="NAMES",
                 help="Comma-separated Host names answered besides the loopback names (a server on loopback "
                 "answers only those by default; * answers any)."),
]
SslKeyfileOption = Annotated[
    Path | None, typer.Option("--ssl-keyfile", metavar="PATH", help="Serve HTTPS with this PEM private key.")
]
SslCertfileOption = Annotated[
    Path | None, typer.Option("--ssl-certfile", metavar="PATH", help="Serve HTTPS with this PEM certificate.")
]
MaxBodyBytesOption = Annotated[
    int, typer.Option("--max-body-bytes", metavar="N", min=1, help="Largest request body; a larger one gets 413.")
]
HeadTimeoutOption = Annotated[
    float,
    typer.Option("--head-timeout", metavar="S", min=0.001,
                 help="Seconds a client has to send a request's line and headers once connected (or once it starts "
                 "its next request on a kept-alive connection); a slower one is disconnected."),
]
ReadTimeoutOption = Annotated[
    float,
    typer.Option("--read-timeout", metavar="S", min=0.001,
                 help="Seconds a client has to send a request's body once its headers have arrived (408)."),
]
KeepAliveOption = Annotated[
    int, typer.Option("--keep-alive-timeout", metavar="S", min=1, help="Seconds an idle connection stays open.")
]
MaxConnectionsOption = Annotated[
    int,
    typer.Option("--max-connections", metavar="N", min=1,
                 help="Requests handled at once (streams included; idle connections and /health do not count); "
                 "one more gets 503 server_busy with Retry-After."),
]
MaxIdleConnectionsOption = Annotated[
    int,
    typer.Option("--max-idle-connections", metavar="N", min=1,
                 help="Connections kept open without a request in progress; a new one beyond them closes the "
                 "connection idle longest."),
]
MaxMessagesOption = Annotated[
    int, typer.Option("--max-messages", metavar="N", min=1, help="Messages of one chat request (400 beyond).")
]
MaxContentPartsOption = Annotated[
    int,
    typer.Option("--max-content-parts", metavar="N", min=1,
                 help="Content parts of one chat request, all messages together (400 beyond)."),
]
RequestTimeoutOption = Annotated[
    float | None,
    typer.Option("--request-timeout", metavar="S", min=0.001,
                 help="Seconds from arrival to the last token; a slower request is ended with 504 (default: none)."),
]
DefaultMaxTokensOption = Annotated[
    int,
    typer.Option("--default-max-tokens", metavar="N", min=1,
                 help="Output budget of a request without max_tokens (capped by the context)."),
]
ShutdownTimeoutOption = Annotated[
    float,
    typer.Option("--shutdown-timeout", metavar="S", min=0.0,
                 help="On SIGTERM, seconds requests in flight get to finish; the rest then get 503."),
]


def names(value: str | None) -> tuple[str, ...]:
    """A comma-separated option as a tuple of its non-empty, stripped items."""
    return tuple(item.strip() for item in (value or "").split(",") if item.strip())


@dataclass(frozen=True)
class NetworkOptions:
    """The options of ``batchspec serve`` that shape its HTTP side, as parsed."""

    host: str
    api_key: str | None
    allowed_origins: str | None
    allowed_hosts: str | None
    ssl_keyfile: Path | None
    ssl_certfile: Path | None
    max_body_bytes: int
    head_timeout: float
    read_timeout: float
    keep_alive_timeout: int
    max_connections: int
    max_idle_connections: int
    max_messages: int
    max_content_parts: int
    request_timeout: float | None
    default_max_tokens: int

    def security(self) -> SecurityConfig:
        return SecurityConfig.for_bind(
            self.host, api_key=self.api_key, allowed_origins=names(self.allowed_origins),
            allowed_hosts=names(self.allowed_hosts),
        )

    def limits(self) -> RequestLimits:
        return RequestLimits(
            max_body_bytes=self.max_body_bytes, read_timeout_s=self.read_timeout,
            request_timeout_s=self.request_timeout, default_max_tokens=self.default_max_tokens,
            max_connections=self.max_connections, max_messages=self.max_messages,
            max_content_parts=self.max_content_parts,
        )

    def http(self) -> HttpOptions:
        keyfile, certfile = (str(p) if p is not None else None for p in (self.ssl_keyfile, self.ssl_certfile))
        return HttpOptions(ssl_keyfile=keyfile, ssl_certfile=certfile, keep_alive_timeout_s=self.keep_alive_timeout,
                           head_timeout_s=self.head_timeout, max_idle_connections=self.max_idle_connections)


def network_choice(
    host: HostOption = DEFAULT_HOST,
    api_key: ApiKeyOption = None,
    allowed_origins: AllowedOriginsOption = None,
    allowed_hosts: AllowedHostsOption = None,
    ssl_keyfile: SslKeyfileOption = None,
    ssl_certfile: SslCertfileOption = None,
    max_body_bytes: MaxBodyBytesOption = DEFAULT_MAX_BODY_BYTES,
    head_timeout: HeadTimeoutOption = DEFAULT_HEAD_TIMEOUT_S,
    read_timeout: ReadTimeoutOption = DEFAULT_READ_TIMEOUT_S,
    keep_alive_timeout: KeepAliveOption = DEFAULT_KEEP_ALIVE_S,
    max_connections: MaxConnectionsOption = DEFAULT_MAX_CONNECTIONS,
    max_idle_connections: MaxIdleConnectionsOption = DEFAULT_MAX_IDLE,
    max_messages: MaxMessagesOption = DEFAULT_MAX_MESSAGES,
    max_content_parts: MaxContentPartsOption = DEFAULT_MAX_CONTENT_PARTS,
    request_timeout: RequestTimeoutOption = None,
    default_max_tokens: DefaultMaxTokensOption = DEFAULT_MAX_TOKENS,
) -> NetworkOptions:
    """The HTTP side of ``serve``: where it listens, who may call it and the bounds of every request."""
    return NetworkOptions(
        host=host, api_key=api_key, allowed_origins=allowed_origins, allowed_hosts=allowed_hosts,
        ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile, max_body_bytes=max_body_bytes, head_timeout=head_timeout,
        read_timeout=read_timeout, keep_alive_timeout=keep_alive_timeout, max_connections=max_connections,
        max_idle_connections=max_idle_connections, max_messages=max_messages, max_content_parts=max_content_parts,
        request_timeout=request_timeout, default_max_tokens=default_max_tokens,
    )


SERVE_SETTINGS = settings_choice(
    "method", "proposer", "batch_size", "num_draft_tokens", "window_size", "prefill_chunk", "timing", "cuda_graphs",
    "prefix_cache_size", flags={"batch_size": "--max-batch-size"}, prefill_chunk=DEFAULT_PREFILL_CHUNK,
)


@with_options(models=model_choice, network=network_choice, settings=SERVE_SETTINGS)
def serve_command(
    models: ModelChoice,
    network: NetworkOptions,
    settings: SpecConfig,
    port: PortOption = DEFAULT_PORT,
    max_queue: MaxQueueOption = 64,
    served_model_name: ServedNameOption = None,
    log_level: LogLevelOption = LogLevel.INFO,
    shutdown_timeout: ShutdownTimeoutOption = DEFAULT_SHUTDOWN_TIMEOUT_S,
) -> None:
    """Serve the models over HTTP with the OpenAI API: /v1/completions, /v1/chat/completions (also streaming),
    /v1/models, /health and /metrics (Prometheus).

    Requests that arrive while others decode join the running batch between rounds; with temperature 0 every
    answer is the target's own greedy output for that prompt alone: exactly in float32 (--dtype auto, the default
    on the CPU), up to near-ties (the two best tokens within a few rounding steps) in bfloat16 or float16.
    SIGTERM or Ctrl-C gives the requests in flight --shutdown-timeout seconds to finish, then exits.
    """
    from batchspec.server import create_app, serve_forever

    logging.basicConfig(level=log_level.value.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with user_errors():
        http, limits, security = network.http(), network.limits(), network.security()
        models.check_for(settings.method, settings.proposer)
        graph_mode(settings.cuda_graphs, resolve_device(models.device))
        engine = replace(settings, proposer=models.proposer_for(settings.method, settings.proposer))
        config = ServerConfig(
            engine=engine, max_queue=max_queue, served_model_name=served_model_name,
            shutdown_timeout_s=shutdown_timeout, limits=limits, security=security,
        )
        loaded = load_models(models, engine.method, engine.proposer)
        typer.echo(f"Loaded {loaded.name} ({loaded.precision}) in {loaded.seconds:.1f} s", err=True)
        app = create_app(loaded, config)
        served = config.served_model_name or loaded.name
        typer.echo(f"Serving {served} ({loaded.dtype}) on {http.scheme}://{network.host}:{port}/v1", err=True)
        serve_forever(app, network.host, port, log_level=log_level.value, http=http)
