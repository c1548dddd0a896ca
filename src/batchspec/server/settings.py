"""What a server is started with: its options and its loaded models."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchspec.config import AUTO, METHODS, PROPOSERS
from batchspec.server.limits import RequestLimits
from batchspec.server.security import SecurityConfig

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_PREFILL_CHUNK = AUTO
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ServerConfig:
    """Options of one server, validated on construction.

    Attributes:
        method: "eqspec" (one running batch, realigned every round; predictable latency), "exspec" (a window of
            requests regrouped by length every round; more throughput, longer tails) or "autoregressive".
        max_batch_size: rows decoded together per round (B).
        max_queue: requests that may wait for admission beyond the running ones; one more gets a 429.
        proposer: who drafts (``draft``, ``ngram`` or ``hybrid``); None: the draft model when one is loaded,
            else prompt lookup.
        num_draft_tokens: drafts per row and round, or ``"auto"`` (chosen every round).
        window_size: exspec only: requests admitted at once (W >= B); default ``4 * max_batch_size``.
        served_model_name: the ``model`` name clients use; default the loaded models' name.
        check_invariants: check the batch invariants every round (slow; for tests).
        shutdown_timeout_s: on shutdown, seconds the requests in flight get to finish before they are ended with
            a 503; the engine loop's round in progress then gets as long again before the process exits.
        limits: body size, timeouts and the default output budget of every request.
        security: API key, CORS origins and the Host names answered.
        timing: split round time into stages for ``/metrics`` (cheap: on a GPU one device synchronisation a round).
        prefill_chunk: columns of new prompts read per round while other requests decode (chunked prefill: a long
            prompt delays the running streams a bounded amount per round); ``"auto"`` (default): as many as take
            about one decode round to read; None reads each prompt in one piece.
        cuda_graphs: ``"on"``, ``"off"`` or ``"auto"``: as :class:`~batchspec.config.SpecConfig` takes it.
        prefix_cache_size: bytes of prompt KV kept for reuse (0: off; ``"auto"``), as
            :class:`~batchspec.config.SpecConfig` takes it; entries are shared only between requests of one API key
            and ``cache_salt``.
    """

    method: str = "eqspec"
    max_batch_size: int = 8
    max_queue: int = 64
    num_draft_tokens: int | str = AUTO
    proposer: str | None = None
    window_size: int | None = None
    served_model_name: str | None = None
    check_invariants: bool = False
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    limits: RequestLimits = field(default_factory=RequestLimits)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    timing: bool = True
    prefill_chunk: int | str | None = DEFAULT_PREFILL_CHUNK
    cuda_graphs: str = "auto"
    prefix_cache_size: int | str = AUTO

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if self.proposer is not None and self.proposer not in PROPOSERS:
            raise ValueError(f"proposer must be one of {', '.join(PROPOSERS)}; got {self.proposer!r}")
        checked = [("max_batch_size", 1), ("max_queue", 0)]
        if self.num_draft_tokens != AUTO:
            checked.append(("num_draft_tokens", 1))
        for name, minimum in checked:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")
        if self.window_size is not None and self.window_size < self.max_batch_size:
            raise ValueError(f"window_size must be >= max_batch_size ({self.max_batch_size}); got {self.window_size}")
        chunk = self.prefill_chunk
        if chunk is not None and chunk != AUTO and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
            raise ValueError(f"prefill_chunk must be an integer >= 1, 'auto' or None; got {chunk!r}")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0; got {self.shutdown_timeout_s}")

