"""Online benchmark (the paper's appendix D): requests arrive as a Poisson process and stream their answers.

For every method a server is started in this process on a free port of 127.0.0.1 (or a running server's URL is
used), ``requests`` streaming completions are sent with exponential gaps of mean ``1 / rate`` seconds, and the
run reports output throughput, request latency (arrival to last token) and time to first token at P50/P90/P99.

Each request runs in a thread of its own, started at its arrival time, and speaks plain HTTP/1.1 with the
standard library, so the load does not wait on the client.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from urllib.parse import urlsplit

import numpy as np

from batchspec.config import DEFAULT_MAX_NEW_TOKENS
from batchspec.models.pair import ModelPair
from batchspec.server.app import create_app
from batchspec.server.hosting import serve_while
from batchspec.server.settings import ServerConfig, serving_settings

MAX_REQUESTS = 10_000
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class OnlineWorkload:
    """What is sent: ``requests`` prompts (cycled from ``prompts``) at ``rate`` requests per second on average."""

    prompts: Sequence[str] | Sequence[Sequence[int]]
    rate: float
    requests: int
    max_tokens: int = DEFAULT_MAX_NEW_TOKENS
    arrival_seed: int = 0  # the arrival times' random generator
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("prompts must not be empty")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s; got {self.rate}")
        if not 1 <= self.requests <= MAX_REQUESTS:
            raise ValueError(f"requests must be in [1, {MAX_REQUESTS}]; got {self.requests}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1; got {self.max_tokens}")

    def arrivals(self) -> list[float]:
        """Seconds from the start at which each request is sent (a seeded Poisson process)."""
        rng = random.Random(self.arrival_seed)
        offsets, now = [], 0.0
        for _ in range(self.requests):
            offsets.append(now)
            now += rng.expovariate(self.rate)
        return offsets

    def payload(self, index: int, model: str | None) -> dict:
        prompt = self.prompts[index % len(self.prompts)]
        body = {
            "prompt": prompt if isinstance(prompt, str) else [int(t) for t in prompt],
            "max_tokens": self.max_tokens, "stream": True, "stream_options": {"include_usage": True},
        }
        return body if model is None else {**body, "model": model}


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it; times in seconds from the start of the run."""

    index: int
    sent_s: float
    done_s: float
    first_token_s: float | None
    completion_tokens: int
    status: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def latency_s(self) -> float:
        return self.done_s - self.sent_s


@dataclass(frozen=True)
class Percentiles:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        if not values:
            return cls(float("nan"), float("nan"), float("nan"), float("nan"))
        p50, p90, p99 = np.percentile(np.asarray(values, dtype=float), [50, 90, 99]).tolist()
        return cls(float(np.mean(values)), p50, p90, p99)


@dataclass(frozen=True)
class OnlineMethodResult:
    """One method's run: throughput in output tokens per second over the run's duration (first request sent to
    last request done), request latency and time to first token of the successful requests."""

    method: str
    requests: int
    failed: int
    duration_s: float
    output_tokens: int
    throughput_tokens_per_s: float
    latency_s: Percentiles
    ttft_s: Percentiles
    acceptance_rate: float | None = None


@dataclass(frozen=True)
class OnlineBenchmarkResult:
    model: str
    rate: float
    requests: int
    max_tokens: int
    batch_size: int | None
    results: list[OnlineMethodResult] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def run_online_benchmark(
    workload: OnlineWorkload,
    *,
    models: ModelPair | None = None,
    url: str | None = None,
    methods: Sequence[str] = ("eqspec", "exspec"),
    max_queue: int | None = None,
    warmup: int = 1,
    **settings: object,
) -> OnlineBenchmarkResult:
    """Run ``workload`` against an in-process server per method (``models``), or against the server at ``url``
    (then ``methods`` and ``settings`` are ignored and the one result is named after the server's model).
    ``settings``: the in-process servers' engine settings (``batch_size``, ``num_draft_tokens``, ...: the fields of
    :class:`~batchspec.config.SpecConfig`)."""
    if (models is None) == (url is None):
        raise ValueError("give exactly one of models= (in-process servers) or url= (a running server)")
    if url is not None:
        model = _served_model(url)
        result = measure(url, model, workload, method="server", warmup=warmup)
        return OnlineBenchmarkResult(model, workload.rate, workload.requests, workload.max_tokens, None, [result])
    results = []
    engine = serving_settings(**settings)
    for method in methods:
        queue = max_queue if max_queue is not None else workload.requests
        config = ServerConfig(engine=replace(engine, method=method), max_queue=queue)
        load = partial(measure, model=models.name, workload=workload, method=method, warmup=warmup)
        results.append(serve_while(create_app(models, config), load))
    return OnlineBenchmarkResult(
        models.name, workload.rate, workload.requests, workload.max_tokens, engine.batch_size, results
    )


def measure(url: str, model: str | None, workload: OnlineWorkload, *, method: str, warmup: int) -> OnlineMethodResult:
    """Send ``workload`` to ``url`` (after ``warmup`` unmeasured requests) and summarise what came back."""
    for index in range(warmup):
        stream_request(url, workload.payload(index, model), index, time.perf_counter(), workload.timeout_s)
    records = send_load(url, model, workload)
    ok = [r for r in records if r.ok]
    duration = max((r.done_s for r in records), default=0.0) - min((r.sent_s for r in records), default=0.0)
    tokens = sum(r.completion_tokens for r in ok)
    return OnlineMethodResult(
        method=method,
        requests=len(records),
        failed=len(records) - len(ok),
        duration_s=duration,
        output_tokens=tokens,
        throughput_tokens_per_s=tokens / duration if duration > 0 else 0.0,
        latency_s=Percentiles.of([r.latency_s for r in ok]),
        ttft_s=Percentiles.of([r.first_token_s - r.sent_s for r in ok if r.first_token_s is not None]),
        acceptance_rate=_acceptance_rate(url),
    )


def send_load(url: str, model: str | None, workload: OnlineWorkload) -> list[RequestRecord]:
    """Send every request of ``workload`` at its arrival time, each in its own thread; wait for all answers."""
    records: list[RequestRecord | None] = [None] * workload.requests
    threads = []
    start = time.perf_counter()

    def run(index: int) -> None:
        records[index] = stream_request(url, workload.payload(index, model), index, start, workload.timeout_s)

    for index, offset in enumerate(workload.arrivals()):
        time.sleep(max(0.0, start + offset - time.perf_counter()))
        thread = threading.Thread(target=run, args=(index,), name=f"loadgen-{index}", daemon=True)
        thread.start()
        threads.append(thread)
    deadline = time.perf_counter() + workload.timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.perf_counter()))
    now = time.perf_counter() - start
    return [r if r is not None else RequestRecord(i, now, now, None, 0, 0, "timed out") for i, r in enumerate(records)]


def stream_request(url: str, payload: dict, index: int, start: float, timeout_s: float) -> RequestRecord:
    """POST one streaming completion and read its events; times are relative to ``start``."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    sent = time.perf_counter() - start
    try:
        connection.request("POST", "/v1/completions", body=json.dumps(payload),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            body = response.read().decode(errors="replace")
            return RequestRecord(index, sent, time.perf_counter() - start, None, 0, response.status, body[:500])
        first, tokens, error = _read_events(response, start)
        return RequestRecord(index, sent, time.perf_counter() - start, first, tokens, 200, error)
    except OSError as error:
        return RequestRecord(index, sent, time.perf_counter() - start, None, 0, 0, f"{type(error).__name__}: {error}")
    finally:
        connection.close()


def _read_events(response: http.client.HTTPResponse, start: float) -> tuple[float | None, int, str | None]:
    """(first token time, completion tokens from the usage chunk, error message) of an SSE response."""
    first: float | None = None
    tokens = 0
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: ") :]
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            return first, tokens, str(chunk["error"].get("message"))
        if first is None and chunk.get("choices") and chunk["choices"][0].get("finish_reason") is None:
            first = time.perf_counter() - start
        if chunk.get("usage"):
            tokens = int(chunk["usage"]["completion_tokens"])
    return first, tokens, None


def _get(url: str, path: str) -> str:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.read().decode()
    finally:
        connection.close()


def _served_model(url: str) -> str:
    return json.loads(_get(url, "/v1/models"))["data"][0]["id"]


def _acceptance_rate(url: str) -> float | None:
    """The server's ``batchspec_draft_acceptance_rate`` gauge, when it exports one."""
    for line in _get(url, "/metrics").splitlines():
        if line.startswith("batchspec_draft_acceptance_rate "):
            return float(line.split()[1])
    return None
