"""The response bodies and stream chunks of ``/v1/completions`` and ``/v1/chat/completions``."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel

from batchspec.server.events import Finished, Tokens
from batchspec.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    Usage,
)


@dataclass(frozen=True)
class ReplyContext:
    """What every body of one request's reply repeats."""

    request_id: str
    model: str
    prompt_ids: list[int]
    return_token_ids: bool
    created: int = field(default_factory=lambda: int(time.time()))


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_of(finished: Finished) -> Usage:
    return Usage(
        prompt_tokens=finished.prompt_tokens,
        completion_tokens=finished.completion_tokens,
        total_tokens=finished.prompt_tokens + finished.completion_tokens,
    )


class ReplyFormat(Protocol):
    id_prefix: str

    def full(self, ctx: ReplyContext, text: str, finished: Finished) -> BaseModel: ...

    def opening(self, ctx: ReplyContext) -> list[BaseModel]: ...

    def delta(self, ctx: ReplyContext, tokens: Tokens) -> BaseModel: ...

    def closing(self, ctx: ReplyContext, finished: Finished) -> BaseModel: ...

    def usage(self, ctx: ReplyContext, finished: Finished) -> BaseModel: ...


class CompletionFormat:
    id_prefix = "cmpl"

    def full(self, ctx: ReplyContext, text: str, finished: Finished) -> CompletionResponse:
        ids = ctx.return_token_ids
        choice = CompletionChoice(
            text=text, finish_reason=finished.finish_reason,
            prompt_token_ids=ctx.prompt_ids if ids else None, token_ids=finished.token_ids if ids else None,
        )
        return self._body(ctx, [choice], usage_of(finished))

    def opening(self, ctx: ReplyContext) -> list[BaseModel]:
        return []

    def delta(self, ctx: ReplyContext, tokens: Tokens) -> CompletionResponse:
        ids = tokens.token_ids if ctx.return_token_ids else None
        return self._body(ctx, [CompletionChoice(text=tokens.text, finish_reason=None, token_ids=ids)])

    def closing(self, ctx: ReplyContext, finished: Finished) -> CompletionResponse:
        return self._body(ctx, [CompletionChoice(text="", finish_reason=finished.finish_reason)])

    def usage(self, ctx: ReplyContext, finished: Finished) -> CompletionResponse:
        return self._body(ctx, [], usage_of(finished))

    @staticmethod
    def _body(ctx: ReplyContext, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices, usage=usage)


class ChatFormat:
    id_prefix = "chatcmpl"

    def full(self, ctx: ReplyContext, text: str, finished: Finished) -> ChatCompletionResponse:
        ids = ctx.return_token_ids
        choice = ChatChoice(
            message=AssistantMessage(content=text), finish_reason=finished.finish_reason,
            prompt_token_ids=ctx.prompt_ids if ids else None, token_ids=finished.token_ids if ids else None,
        )
        return ChatCompletionResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=[choice], usage=usage_of(finished)
        )

    def opening(self, ctx: ReplyContext) -> list[BaseModel]:
        return [self._chunk(ctx, [ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])]

    def delta(self, ctx: ReplyContext, tokens: Tokens) -> ChatCompletionChunk:
        ids = tokens.token_ids if ctx.return_token_ids else None
        return self._chunk(ctx, [ChatChunkChoice(delta=ChatDelta(content=tokens.text), token_ids=ids)])

    def closing(self, ctx: ReplyContext, finished: Finished) -> ChatCompletionChunk:
        return self._chunk(ctx, [ChatChunkChoice(delta=ChatDelta(), finish_reason=finished.finish_reason)])

    def usage(self, ctx: ReplyContext, finished: Finished) -> ChatCompletionChunk:
        return self._chunk(ctx, [], usage_of(finished))

    @staticmethod
    def _chunk(ctx: ReplyContext, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices, usage=usage
        )
