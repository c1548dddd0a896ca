"""What a server is started with: its options and its loaded models."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from batchspec.config import AUTO, SpecConfig, check_fields, integer, number, option
from batchspec.server.limits import RequestLimits
from batchspec.server.security import SecurityConfig

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_PREFILL_CHUNK = AUTO
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def serving_settings(**options: object) -> SpecConfig:
    """The engine settings of a server: ``options`` over the record's defaults, prompts read in chunks by default
    (``prefill_chunk="auto"``: a long prompt delays the running streams a bounded amount per round)."""
    return SpecConfig(**{"prefill_chunk": DEFAULT_PREFILL_CHUNK, **options})


@dataclass(frozen=True)
class ServerConfig:
    """Options of one server, validated on construction.

    Attributes:
        engine: the engine's settings (:class:`~batchspec.config.SpecConfig`, where each is declared): the method
            (eqspec: one running batch, predictable latency; exspec: a window of requests regrouped by length every
            round, more throughput, longer tails), ``batch_size`` (``--max-batch-size``: requests decoded together
            per round), the proposer and draft length, the exspec window, chunked prefill, CUDA graphs and the
            prefix cache, whose entries are shared only between requests of one API key and ``cache_salt``.
        max_queue: requests that may wait for admission beyond the running ones; one more gets a 429.
        served_model_name: the ``model`` name clients use; default the loaded models' name.
        shutdown_timeout_s: on shutdown, seconds the requests in flight get to finish before they are ended with
            a 503; the engine loop's round in progress then gets as long again before the process exits.
        limits: body size, timeouts and the default output budget of every request.
        security: API key, CORS origins and the Host names answered.
    """

    engine: SpecConfig = field(default_factory=serving_settings)
    max_queue: int = option(
        64, check=integer(0), metavar="N", minimum=0,
        help="Requests that may wait for a free row; beyond that the server answers 429 with Retry-After.",
    )
    served_model_name: str | None = option(None, metavar="NAME",
                                           help="The model name clients send (default: the preset).")
    shutdown_timeout_s: float = option(
        DEFAULT_SHUTDOWN_TIMEOUT_S, check=number(0.0), metavar="S", minimum=0.0,
        help="On SIGTERM, seconds requests in flight get to finish; the rest then get 503.",
    )
    limits: RequestLimits = field(default_factory=RequestLimits)
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def of(cls, **options: object) -> ServerConfig:
        """A config from keywords: the server's own fields, and the engine's settings by their names (``batch_size``,
        ``num_draft_tokens``, ...) over :func:`serving_settings`."""
        own = {spec.name for spec in fields(cls)} - {"engine"}
        engine = serving_settings(**{k: v for k, v in options.items() if k not in own})
        return cls(engine=engine, **{k: v for k, v in options.items() if k in own})
