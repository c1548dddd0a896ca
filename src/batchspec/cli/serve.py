"""``batchspec serve``: an OpenAI-compatible HTTP server with continuous admission."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Annotated

import typer

from batchspec.cli.common import loaded_line, model_choice, settings_choice, with_options
from batchspec.cli.errors import user_errors
from batchspec.config import SpecConfig
from batchspec.models.choice import ModelChoice
from batchspec.run import load_run, resolve_run
from batchspec.server.hosting import HttpOptions
from batchspec.server.limits import RequestLimits
from batchspec.server.security import API_KEY_ENV, SecurityConfig
from batchspec.server.settings import DEFAULT_HOST, DEFAULT_PORT, DEFAULT_PREFILL_CHUNK, ServerConfig


class LogLevel(StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


HostOption = Annotated[
    str, typer.Option("--host", metavar="ADDRESS", help="Address to listen on; the default accepts local clients only.")
]
PortOption = Annotated[int, typer.Option("--port", metavar="PORT", min=1, max=65535, help="TCP port to listen on.")]
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


def names(value: str | None) -> tuple[str, ...]:
    """A comma-separated option as a tuple of its non-empty, stripped items."""
    return tuple(item.strip() for item in (value or "").split(",") if item.strip())


SERVE_SETTINGS = settings_choice(
    "method", "proposer", "batch_size", "num_draft_tokens", "draft_vocabulary", "window_size", "prefill_chunk",
    "timing", "cuda_graphs", "prefix_cache_size", flags={"batch_size": "--max-batch-size"},
    prefill_chunk=DEFAULT_PREFILL_CHUNK,
)


@dataclass(frozen=True)
class Access:
    """Where ``serve`` listens and who may call it: the address, and the rules for it (:class:`SecurityConfig`)."""

    host: str
    security: SecurityConfig


def access_choice(
    host: HostOption = DEFAULT_HOST,
    api_key: ApiKeyOption = None,
    allowed_origins: AllowedOriginsOption = None,
    allowed_hosts: AllowedHostsOption = None,
) -> Access:
    """The address of ``--host`` and the rules of ``--api-key``, ``--allowed-origins`` and ``--allowed-hosts``."""
    security = SecurityConfig.for_bind(
        host, api_key=api_key, allowed_origins=names(allowed_origins), allowed_hosts=names(allowed_hosts)
    )
    return Access(host, security)


LIMITS = settings_choice(
    "max_body_bytes", "read_timeout_s", "request_timeout_s", "default_max_tokens", "max_connections", "max_messages",
    "max_content_parts", record=RequestLimits,
    flags={"read_timeout_s": "--read-timeout", "request_timeout_s": "--request-timeout"},
)
HTTP = settings_choice(
    "ssl_keyfile", "ssl_certfile", "keep_alive_timeout_s", "head_timeout_s", "max_idle_connections",
    record=HttpOptions, flags={"keep_alive_timeout_s": "--keep-alive-timeout", "head_timeout_s": "--head-timeout"},
)
SERVER = settings_choice(
    "max_queue", "served_model_name", "shutdown_timeout_s", record=ServerConfig,
    flags={"shutdown_timeout_s": "--shutdown-timeout"},
)


@with_options(models=model_choice, settings=SERVE_SETTINGS, server=SERVER, access=access_choice, limits=LIMITS,
              http=HTTP)
def serve_command(
    models: ModelChoice,
    settings: SpecConfig,
    server: ServerConfig,
    access: Access,
    limits: RequestLimits,
    http: HttpOptions,
    port: PortOption = DEFAULT_PORT,
    log_level: LogLevelOption = LogLevel.INFO,
) -> None:
    """Serve the models over HTTP with the OpenAI API: /v1/completions, /v1/chat/completions (also streaming),
    /v1/models, /health and /metrics (Prometheus).

    Requests that arrive while others decode join the running batch between rounds; with temperature 0 every
    answer is the target's own greedy output for that prompt alone: exactly on the CPU's default integer forward
    (--quantize auto: int8 on the VNNI builds, int4 for 4-bit GGUF files such as the presets' on the avx2 build)
    and in float32 (--quantize none), up to near-ties (the two best tokens within a few rounding steps) in bfloat16
    or float16.
    SIGTERM or Ctrl-C gives the requests in flight --shutdown-timeout seconds to finish, then exits.
    """
    from batchspec.server import create_app, serve_forever

    logging.basicConfig(level=log_level.value.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with user_errors():
        run = resolve_run(settings, models)  # a --cuda-graphs the device cannot run fails here, before loading
        config = replace(server, engine=run.engine, limits=limits, security=access.security)
        loaded = load_run(run)
        typer.echo(loaded_line(loaded), err=True)
        app = create_app(loaded, config, run)
        served = config.served_model_name or loaded.name
        typer.echo(f"Serving {served} ({loaded.dtype}) on {http.scheme}://{access.host}:{port}/v1", err=True)
        serve_forever(app, access.host, port, log_level=log_level.value, http=http)
