"""The FastAPI application: OpenAI-compatible routes around one engine loop.

``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` (all also as server-sent events
with ``stream: true``), ``GET /v1/models``, ``GET /health`` and ``GET /metrics``, behind the middleware of
:mod:`~batchspec.server.middleware`. Request bodies are parsed, validated and tokenized in small thread pools, off
the event loop (:class:`~batchspec.server.params.PromptReader`), so that no body stalls other clients; small
bodies have a pool of their own, so that they never wait behind large ones. The engine
loop starts with the application and, on shutdown, finishes the requests it holds (those still running when the
shutdown timeout ends have been cancelled by then) before its thread ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchspec.engine import bridge_of, make_scheduler
from batchspec.families import positions_of
from batchspec.model_checks import vocab_size
from batchspec.models.pair import ModelPair
from batchspec.run import RunConfig, build_run, resolve_loaded
from batchspec.server.bodies import BodyBounds
from batchspec.server.chat import ChatEncoder
from batchspec.server.errors import APIError, bad_request
from batchspec.server.handlers import Reply, Tracker, answer, submit
from batchspec.server.lifecycle import InFlight
from batchspec.server.loop import EngineLoop
from batchspec.server.middleware import install_middleware
from batchspec.server.params import ModelLimits, PromptReader, PromptSize, StructuredOutputs
from batchspec.server.prometheus import CONTENT_TYPE, ServerMetrics, endpoint_label
from batchspec.server.protocol import ModelCard, ModelList, SamplingFields
from batchspec.server.response_bodies import (
    ChatFormat,
    CompletionFormat,
    ReplyContext,
    ReplyFormat,
    TokenTexts,
    new_request_id,
)
from batchspec.server.responses_api import ResponsesFormat, read_request
from batchspec.server.security import cache_namespace
from batchspec.server.settings import ServerConfig
from batchspec.server.tools import ToolUse
from batchspec.server.validation import validation_error

logger = logging.getLogger(__name__)

PREPARE_WORKERS = 2
QUICK_BODY_BYTES = 64 * 1024


@dataclass
class ServingState:
    """Everything the routes use, kept in ``app.state.serving``."""

    loop: EngineLoop
    metrics: ServerMetrics
    tokenizer: Any
    limits: ModelLimits
    model_name: str
    served: dict[str, str]  # ModelPair.served(): how the pair runs, for /v1/models
    config: ServerConfig
    structured: StructuredOutputs
    texts: TokenTexts

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise APIError(404, f"model {requested!r} is not served here; use {self.model_name!r}",
                           param="model", code="model_not_found")


def build_state(models: ModelPair, config: ServerConfig, run: RunConfig | None = None) -> ServingState:
    """The engine, its loop and the metrics for ``models`` (checked like ``batchspec.generate`` checks them): the
    engine of ``run`` (``serve`` hands the record it made, :func:`~batchspec.run.resolve_run`), else of
    ``config.engine`` with these models (:func:`~batchspec.run.resolve_loaded`)."""
    run = run or resolve_loaded(config.engine, models.target, models.draft)
    engine = build_run(run, models.target, models.draft)
    metrics = ServerMetrics()
    scheduler = make_scheduler(engine.config, online=True)
    loop = EngineLoop(engine, scheduler, models.tokenizer, max_queue=config.max_queue, metrics=metrics)
    held = (lambda: 0) if engine.prefixes is None else (lambda: engine.prefixes.stats.bytes_held)
    metrics.watch(engine.stats, lambda: loop.status().queued, lambda: loop.status().running, held)
    context = context_length(models.target, engine.draft)
    limits = ModelLimits(context_length=context, vocab_size=vocab_size(models.target))
    name = config.served_model_name or models.name
    structured = StructuredOutputs.of(models.tokenizer, limits.vocab_size, engine.config.eos_token_ids)
    return ServingState(loop, metrics, models.tokenizer, limits, name, models.served(), config, structured,
                        TokenTexts(models.tokenizer))


def context_length(target: Any, draft: Any | None) -> int:
    """Positions both models can attend over: the smaller of their :func:`~batchspec.families.positions_of`
    (``max_position_embeddings``, or fewer where a family bounds them); the target's alone where the draft is of
    another tokenizer (it counts its own tokens, and drafts nothing for a row past its positions)."""
    models = [m for m in (target, draft) if m is not None and bridge_of(m) is None]
    return min(positions_of(m.config.get_text_config()) for m in models)


def prompt_reader(models: ModelPair, state: ServingState) -> PromptReader:
    """How the server reads requests for ``models``: bounds from the options and the model's context."""
    limits, context = state.config.limits, state.limits.context_length
    chat = ChatEncoder.of(models.tokenizer)
    return PromptReader(
        BodyBounds(context, limits.max_messages, limits.max_content_parts),
        PromptSize.of(models.tokenizer, context, chat.cost), models.tokenizer, chat, state.limits,
        limits.default_max_tokens, state.check_model, state.structured,
    )


@dataclass
class Front:
    """What the routes use besides the engine: the requests in flight, the prompt reader, and the two small pools
    that run it off the event loop, one for bodies of at most :data:`QUICK_BODY_BYTES` and one for the others (so
    that a large or intricate body delays no other client, and a small request waits behind no large one)."""

    inflight: InFlight
    reader: PromptReader
    shutdown_timeout_s: float
    pool: ThreadPoolExecutor = field(default_factory=lambda: _pool("batchspec-prepare"))
    quick_pool: ThreadPoolExecutor = field(default_factory=lambda: _pool("batchspec-prepare-quick"))

    async def prepare(self, read: Callable[[bytes], Any], raw: bytes) -> Any:
        pool = self.quick_pool if len(raw) <= QUICK_BODY_BYTES else self.pool
        return await asyncio.get_running_loop().run_in_executor(pool, partial(read, raw))

    def close(self) -> None:
        for pool in (self.pool, self.quick_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    def begin_shutdown(self) -> None:
        """Called when the HTTP server starts shutting down: requests in flight get ``shutdown_timeout_s``."""
        self.inflight.begin_shutdown(self.shutdown_timeout_s)


def _pool(name: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix=name)


def create_app(models: ModelPair, config: ServerConfig, run: RunConfig | None = None) -> FastAPI:
    """The application serving ``models`` (with the engine of ``run`` when given, see :func:`build_state`); its
    engine loop runs while the application runs (lifespan)."""
    state = build_state(models, config, run)
    front = Front(
        InFlight(config.limits.request_timeout_s), prompt_reader(models, state), config.shutdown_timeout_s,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop.start()
        settings = config.engine
        logger.info("serving %s with %s, batch size %d", state.model_name, settings.method.value, settings.batch_size)
        yield
        logger.info("draining the engine loop")
        front.close()
        await asyncio.to_thread(state.loop.stop, config.shutdown_timeout_s)

    app = FastAPI(title="batchspec", lifespan=lifespan)
    app.state.serving = state
    app.state.front = front
    _install_error_handlers(app, state)
    install_middleware(app, config, state.metrics, front.inflight.expired)
    app.post("/v1/completions")(completions)
    app.post("/v1/chat/completions")(chat_completions)
    app.post("/v1/responses")(responses)
    app.get("/v1/models")(list_models)
    app.get("/health")(health)
    app.get("/metrics")(metrics)
    return app


def _state(http: Request) -> ServingState:
    return http.app.state.serving


def _front(http: Request) -> Front:
    return http.app.state.front


async def completions(http: Request) -> Response:
    front = _front(http)
    body, params = await front.prepare(front.reader.completion, await _json_body(http))
    state = _state(http)
    echo = None
    if body.echo:
        echo = body.prompt if isinstance(body.prompt, str) else state.texts.tokenizer.decode(params.prompt)
    return await _serve(http, state, params, CompletionFormat(echo), body)


async def chat_completions(http: Request) -> Response:
    front = _front(http)
    body, params = await front.prepare(front.reader.chat_completion, await _json_body(http))
    return await _serve(http, _state(http), params, ChatFormat(parse_calls=ToolUse.of(body).parsed), body)


async def responses(http: Request) -> Response:
    """``POST /v1/responses``, served as the chat request it stands for (:mod:`~batchspec.server.responses_api`)."""
    front = _front(http)
    body, chat, params = await front.prepare(partial(read_request, front.reader), await _json_body(http))
    fmt = ResponsesFormat(body, parse_calls=ToolUse.of(chat).parsed)
    return await _serve(http, _state(http), params, fmt, chat)


async def _json_body(http: Request) -> bytes:
    """The request's body, read by the body guard; a 400 unless it is sent as JSON (a web page can send any other
    content type to another origin without asking first)."""
    media = (http.headers.get("content-type") or "").split(";")[0].strip().lower()
    kind, _, subtype = media.partition("/")
    if kind != "application" or not (subtype == "json" or subtype.endswith("+json")):
        raise bad_request("the request body must be JSON, sent with 'Content-Type: application/json'",
                          code="invalid_content_type")
    return await http.body()


async def _serve(http: Request, state: ServingState, params, fmt: ReplyFormat, body: SamplingFields) -> Response:
    inflight = _front(http).inflight
    params = replace(params, cache_namespace=cache_namespace(http.scope, body.cache_salt))
    ctx = ReplyContext(new_request_id(fmt.id_prefix), state.model_name, params.prompt, body.return_token_ids,
                       state.texts)
    handle = submit(state.loop, state.metrics, inflight, ctx.request_id, params)
    tracker = Tracker(handle, state.metrics, endpoint_label(http.scope))
    return await answer(http, handle, tracker, Reply(fmt, ctx, body.stream, body.include_usage), inflight)


async def list_models(http: Request) -> ModelList:
    state = _state(http)
    card = ModelCard(id=state.model_name, created=0, max_model_len=state.limits.context_length, batchspec=state.served)
    return ModelList(data=[card])


async def health(http: Request) -> JSONResponse:
    status = _state(http).loop.status()
    body = {"status": "ok" if status.alive else "engine stopped", "queued": status.queued, "running": status.running}
    return JSONResponse(body, status_code=200 if status.alive else 503)


async def metrics(http: Request) -> Response:
    return Response(_state(http).metrics.render(), media_type=CONTENT_TYPE)


def _install_error_handlers(app: FastAPI, state: ServingState) -> None:
    def reply(http: Request, error: APIError) -> JSONResponse:
        state.metrics.requests.labels(endpoint=endpoint_label(http.scope), status=str(error.status)).inc()
        return error.response()

    async def on_api_error(http: Request, error: APIError) -> JSONResponse:
        return reply(http, error)

    async def on_invalid(http: Request, error: RequestValidationError) -> JSONResponse:
        return reply(http, validation_error(error.errors()))

    async def on_http(http: Request, error: StarletteHTTPException) -> JSONResponse:
        return reply(http, APIError(error.status_code, str(error.detail), headers=dict(error.headers or {})))

    async def on_unexpected(http: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error serving %s", http.url.path)
        return reply(http, APIError(500, f"internal server error: {type(error).__name__}"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_invalid)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
