"""The FastAPI application: OpenAI-compatible routes around one engine loop.

``POST /v1/completions``, ``POST /v1/chat/completions`` (both also as server-sent events with ``stream: true``),
``GET /v1/models``, ``GET /health`` and ``GET /metrics``, behind the middleware of
:mod:`~batchspec.server.middleware`. Prompts are tokenized in a small thread pool, off the event loop. The engine
loop starts with the application and, on shutdown, finishes the requests it holds (those still running when the
shutdown timeout ends have been cancelled by then) before its thread ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchspec.config import SpecConfig
from batchspec.engine import build_engine
from batchspec.model_checks import vocab_size
from batchspec.models.pair import ModelPair
from batchspec.schedulers import make_scheduler
from batchspec.server.errors import APIError
from batchspec.server.events import GenerationParams
from batchspec.server.formats import ChatFormat, CompletionFormat, ReplyContext, ReplyFormat, new_request_id
from batchspec.server.handlers import Reply, Tracker, answer, submit
from batchspec.server.lifecycle import InFlight
from batchspec.server.loop import EngineLoop
from batchspec.server.metrics import CONTENT_TYPE, ServerMetrics, endpoint_label
from batchspec.server.middleware import install_middleware
from batchspec.server.prompts import ModelLimits, PromptSize, chat_params, completion_params
from batchspec.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    SamplingFields,
)
from batchspec.server.settings import ServerConfig
from batchspec.server.validation import validation_error

logger = logging.getLogger(__name__)

PREPARE_WORKERS = 2


@dataclass
class ServingState:
    """Everything the routes use, kept in ``app.state.serving``."""

    loop: EngineLoop
    metrics: ServerMetrics
    tokenizer: Any
    limits: ModelLimits
    model_name: str
    config: ServerConfig

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise APIError(404, f"model {requested!r} is not served here; use {self.model_name!r}",
                           param="model", code="model_not_found")


def build_state(models: ModelPair, config: ServerConfig) -> ServingState:
    """The engine, its loop and the metrics for ``models`` (checked like ``batchspec.generate`` checks them)."""
    spec = SpecConfig(
        method=config.method, batch_size=config.max_batch_size, num_draft_tokens=config.num_draft_tokens,
        proposer=config.proposer,
        window_size=config.window_size, check_invariants=config.check_invariants, timing=config.timing,
        prefill_chunk=config.prefill_chunk,
    )
    engine = build_engine(models.target, models.draft, spec)
    metrics = ServerMetrics()
    scheduler = make_scheduler(engine.config, online=True)
    loop = EngineLoop(engine, scheduler, models.tokenizer, max_queue=config.max_queue, metrics=metrics)
    metrics.watch(engine.stats, lambda: loop.status().queued, lambda: loop.status().running)
    context = context_length(models.target, engine.draft)
    limits = ModelLimits(context_length=context, vocab_size=vocab_size(models.target))
    name = config.served_model_name or models.name
    return ServingState(loop, metrics, models.tokenizer, limits, name, config)


def context_length(target: Any, draft: Any | None) -> int:
    """Positions both models can attend over: the smaller ``max_position_embeddings``."""
    models = [m for m in (target, draft) if m is not None]
    return min(int(m.config.get_text_config().max_position_embeddings) for m in models)


@dataclass
class Front:
    """What the routes use besides the engine: the requests in flight, the prompt-size bound, and the small pool
    that tokenizes and renders chat templates off the event loop (so a large prompt delays no other client)."""

    inflight: InFlight
    prompt_size: PromptSize
    pool: ThreadPoolExecutor
    shutdown_timeout_s: float

    async def prepare(self, work: Callable[..., GenerationParams], *args: Any) -> GenerationParams:
        return await asyncio.get_running_loop().run_in_executor(self.pool, partial(work, *args))

    def begin_shutdown(self) -> None:
        """Called when the HTTP server starts shutting down: requests in flight get ``shutdown_timeout_s``."""
        self.inflight.begin_shutdown(self.shutdown_timeout_s)


def create_app(models: ModelPair, config: ServerConfig) -> FastAPI:
    """The application serving ``models``; its engine loop runs while the application runs (lifespan)."""
    state = build_state(models, config)
    front = Front(
        InFlight(config.limits.request_timeout_s), PromptSize.of(models.tokenizer, state.limits.context_length),
        ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="batchspec-prepare"), config.shutdown_timeout_s,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop.start()
        logger.info("serving %s with %s, batch size %d", state.model_name, config.method, config.max_batch_size)
        yield
        logger.info("draining the engine loop")
        front.pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(state.loop.stop, config.shutdown_timeout_s)

    app = FastAPI(title="batchspec", lifespan=lifespan)
    app.state.serving = state
    app.state.front = front
    _install_error_handlers(app, state)
    install_middleware(app, config, state.metrics, front.inflight.expired)
    app.post("/v1/completions")(completions)
    app.post("/v1/chat/completions")(chat_completions)
    app.get("/v1/models")(list_models)
    app.get("/health")(health)
    app.get("/metrics")(metrics)
    return app


def _state(http: Request) -> ServingState:
    return http.app.state.serving


def _front(http: Request) -> Front:
    return http.app.state.front


async def completions(body: CompletionRequest, http: Request) -> Response:
    params = await _prepare(http, body, completion_params)
    return await _serve(http, _state(http), params, CompletionFormat(), body)


async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
    params = await _prepare(http, body, chat_params)
    return await _serve(http, _state(http), params, ChatFormat(), body)


async def _prepare(
    http: Request, body: CompletionRequest | ChatCompletionRequest, work: Callable[..., GenerationParams]
) -> GenerationParams:
    """Check the model and the prompt's size, then tokenize (``work``) in the pool, off the event loop."""
    state, front = _state(http), _front(http)
    state.check_model(body.model)
    front.prompt_size.check(body)
    return await front.prepare(work, body, state.tokenizer, state.limits, state.config.limits.default_max_tokens)


async def _serve(http: Request, state: ServingState, params, fmt: ReplyFormat, body: SamplingFields) -> Response:
    inflight = _front(http).inflight
    ctx = ReplyContext(new_request_id(fmt.id_prefix), state.model_name, params.prompt, body.return_token_ids)
    handle = submit(state.loop, state.metrics, inflight, ctx.request_id, params)
    tracker = Tracker(handle, state.metrics, endpoint_label(http.scope))
    return await answer(http, handle, tracker, Reply(fmt, ctx, body.stream, body.include_usage), inflight)


async def list_models(http: Request) -> ModelList:
    state = _state(http)
    card = ModelCard(id=state.model_name, created=0, max_model_len=state.limits.context_length)
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
        return reply(http, validation_error(error))

    async def on_http(http: Request, error: StarletteHTTPException) -> JSONResponse:
        return reply(http, APIError(error.status_code, str(error.detail), headers=dict(error.headers or {})))

    async def on_unexpected(http: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error serving %s", http.url.path)
        return reply(http, APIError(500, f"internal server error: {type(error).__name__}"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_invalid)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
