"""The response bodies and stream chunks of ``/v1/completions`` and ``/v1/chat/completions``, with their
``n`` choices and their logprobs."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from batchspec.engine import TokenLogprob
from batchspec.server.events import Finished, Tokens
from batchspec.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FunctionCallDelta,
    PromptTokensDetails,
    TokenLogprobEntry,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from batchspec.server.tools import CallReader, call_finish_reason, split_calls


@dataclass
class TokenTexts:
    """Each token id's own text, as logprobs show it: the id decoded alone, special tokens kept (cached; one per
    server)."""

    tokenizer: Any
    _texts: dict[int, str] = field(default_factory=dict, repr=False)

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text


@dataclass(frozen=True)
class ReplyContext:
    """What every body of one request's reply repeats; ``texts`` names the tokens of logprobs."""

    request_id: str
    model: str
    prompt_ids: list[int]
    return_token_ids: bool
    texts: TokenTexts | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def token_text(self, token: int) -> str:
        if self.texts is None:
            raise ValueError("a reply with logprobs needs the server's token texts")
        return self.texts(token)


@dataclass
class ChoiceOutput:
    """One choice of a whole (not streamed) reply, gathered from its events: text, token logprobs and the prompt's
    (None when not asked for) and its end."""

    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    finished: Finished | None = None

    def add(self, event: Tokens | Finished) -> None:
        if isinstance(event, Finished):
            self.finished = event
            return
        self.parts.append(event.text)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *event.logprobs]

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def end(self) -> Finished:
        if self.finished is None:
            raise ValueError("the choice has not finished")
        return self.finished


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_of(finished: list[Finished]) -> Usage:
    """The request's usage: its prompt once, and the tokens of every choice; cached, the most prompt tokens any
    choice took from the prefix cache (choices after the first read the prompt the first read)."""
    prompt = finished[0].prompt_tokens
    completion = sum(f.completion_tokens for f in finished)
    cached = PromptTokensDetails(cached_tokens=max(f.cached_tokens for f in finished))
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=cached)


class ReplyFormat(Protocol):
    """How one request's reply is written; ``delta`` and ``closing`` give the stream's next events (``sse_events``:
    as named SSE events, ``event: <type>``, with no ``[DONE]`` at the end, as the Responses API streams)."""

    id_prefix: str
    sse_events: bool

    def full(self, ctx: ReplyContext, choices: list[ChoiceOutput]) -> BaseModel: ...

    def opening(self, ctx: ReplyContext, n: int) -> list[BaseModel]: ...

    def delta(self, ctx: ReplyContext, tokens: Tokens) -> list[BaseModel]: ...

    def closing(self, ctx: ReplyContext, finished: Finished) -> list[BaseModel]: ...

    def usage(self, ctx: ReplyContext, finished: list[Finished]) -> BaseModel: ...


def chat_logprobs(ctx: ReplyContext, logprobs: list[TokenLogprob] | None) -> ChatLogprobs | None:
    """Chat's ``logprobs``: each token's text, logprob, UTF-8 bytes and top alternatives."""
    if logprobs is None:
        return None

    def top(token: int, logprob: float) -> TopLogprob:
        text = ctx.token_text(token)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    return ChatLogprobs(content=[
        TokenLogprobEntry(**top(t.token, t.logprob).model_dump(), top_logprobs=[top(i, lp) for i, lp in t.top])
        for t in logprobs
    ])


def completion_logprobs(
    ctx: ReplyContext, logprobs: list[TokenLogprob] | None, offset: int, prompt: list[TokenLogprob] | None = None
) -> CompletionLogprobs | None:
    """The completions ``logprobs``, the first token at character ``offset`` of the choice's text; with ``prompt``
    (an echoed prompt's logprobs) the prompt's tokens first: its first token with none, then ``prompt``'s.

    Example (echo, prompt ids ``[5, 9]``, one output token 4): tokens ``[text(5), text(9), text(4)]``, logprobs
    ``[None, lp(9), lp(4)]``, top alternatives ``[None, {...}, {...}]``.
    """
    if logprobs is None and prompt is None:
        return None
    entries = [*(prompt or ()), *(logprobs or ())]
    tokens = [ctx.token_text(t.token) for t in entries]
    values: list[float | None] = [t.logprob for t in entries]
    tops: list[dict[str, float] | None] = [{ctx.token_text(i): lp for i, lp in t.top} for t in entries]
    if prompt is not None:
        tokens, values, tops = [ctx.token_text(ctx.prompt_ids[0]), *tokens], [None, *values], [None, *tops]
    starts = [offset]
    for text in tokens[:-1]:
        starts.append(starts[-1] + len(text))
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, text_offset=starts, top_logprobs=tops)


class CompletionFormat:
    """One request's completions reply (it counts, per streamed choice, the characters of its logprob tokens so
    far: their ``text_offset``). With ``echo`` (the prompt's text) each choice's text starts with the prompt, and
    its logprobs with the prompt's when the request asked for logprobs; a stream sends the prompt in each choice's
    first chunk."""

    id_prefix = "cmpl"
    sse_events = False

    def __init__(self, echo: str | None = None) -> None:
        self.echo = echo
        self._offsets: dict[int, int] = {}
        self._echoed: set[int] = set()

    def full(self, ctx: ReplyContext, choices: list[ChoiceOutput]) -> CompletionResponse:
        ids = ctx.return_token_ids
        bodies = [
            CompletionChoice(
                index=i, text=(self.echo or "") + c.text, finish_reason=c.end.finish_reason,
                logprobs=completion_logprobs(ctx, c.logprobs, 0, c.prompt_logprobs),
                prompt_token_ids=ctx.prompt_ids if ids else None, token_ids=c.end.token_ids if ids else None,
            )
            for i, c in enumerate(choices)
        ]
        return self._body(ctx, bodies, usage_of([c.end for c in choices]))

    def opening(self, ctx: ReplyContext, n: int) -> list[BaseModel]:
        return []

    def delta(self, ctx: ReplyContext, tokens: Tokens) -> list[CompletionResponse]:
        ids = tokens.token_ids if ctx.return_token_ids else None
        start = self._offsets.get(tokens.index, 0)
        logprobs = completion_logprobs(ctx, tokens.logprobs, start, tokens.prompt_logprobs)
        if logprobs is not None:
            self._offsets[tokens.index] = start + sum(len(text) for text in logprobs.tokens)
        choice = CompletionChoice(index=tokens.index, text=self._echo(tokens.index) + tokens.text, finish_reason=None,
                                  logprobs=logprobs, token_ids=ids)
        return [self._body(ctx, [choice])]

    def closing(self, ctx: ReplyContext, finished: Finished) -> list[CompletionResponse]:
        choice = CompletionChoice(index=finished.index, text=self._echo(finished.index),
                                  finish_reason=finished.finish_reason)
        return [self._body(ctx, [choice])]

    def _echo(self, index: int) -> str:
        """The prompt's text the first time choice ``index`` streams, else nothing."""
        if self.echo is None or index in self._echoed:
            return ""
        self._echoed.add(index)
        return self.echo

    def usage(self, ctx: ReplyContext, finished: list[Finished]) -> CompletionResponse:
        return self._body(ctx, [], usage_of(finished))

    @staticmethod
    def _body(ctx: ReplyContext, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices, usage=usage)


class ChatFormat:
    """One request's chat reply; with ``parse_calls`` (a request that offers tools), each choice's tool calls are
    read out of its text (:mod:`~batchspec.server.tools`): a whole reply's message has them as ``tool_calls``, a
    stream sends each call whole in the chunk that completes it, and a choice that called tools and ended on its
    own finishes with "tool_calls"."""

    id_prefix = "chatcmpl"
    sse_events = False

    def __init__(self, parse_calls: bool = False) -> None:
        self.parse_calls = parse_calls
        self._readers: dict[int, CallReader] = {}

    def full(self, ctx: ReplyContext, choices: list[ChoiceOutput]) -> ChatCompletionResponse:
        ids = ctx.return_token_ids
        bodies = [
            ChatChoice(
                index=i, **self._answer(c),
                logprobs=chat_logprobs(ctx, c.logprobs),
                prompt_token_ids=ctx.prompt_ids if ids else None, token_ids=c.end.token_ids if ids else None,
            )
            for i, c in enumerate(choices)
        ]
        return ChatCompletionResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=bodies,
            usage=usage_of([c.end for c in choices]),
        )

    def opening(self, ctx: ReplyContext, n: int) -> list[BaseModel]:
        return [self._chunk(ctx, [ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                for i in range(n)]

    def delta(self, ctx: ReplyContext, tokens: Tokens) -> list[ChatCompletionChunk]:
        ids = tokens.token_ids if ctx.return_token_ids else None
        choice = ChatChunkChoice(index=tokens.index, delta=self._delta(tokens),
                                 logprobs=chat_logprobs(ctx, tokens.logprobs), token_ids=ids)
        return [self._chunk(ctx, [choice])]

    def closing(self, ctx: ReplyContext, finished: Finished) -> list[ChatCompletionChunk]:
        reason, delta = finished.finish_reason, ChatDelta()
        if self.parse_calls:
            reader = self._reader(finished.index)
            reason, delta = call_finish_reason(reason, reader.calls), ChatDelta(content=reader.flush() or None)
        return [self._chunk(ctx, [ChatChunkChoice(index=finished.index, delta=delta, finish_reason=reason)])]

    def _answer(self, choice: ChoiceOutput) -> dict[str, Any]:
        """A whole choice's message and finish reason."""
        if not self.parse_calls:
            return {"message": AssistantMessage(content=choice.text), "finish_reason": choice.end.finish_reason}
        content, calls = split_calls(choice.text)
        return {"message": AssistantMessage(content=content, tool_calls=calls or None),
                "finish_reason": call_finish_reason(choice.end.finish_reason, calls)}

    def _delta(self, tokens: Tokens) -> ChatDelta:
        if not self.parse_calls:
            return ChatDelta(content=tokens.text)
        reader = self._reader(tokens.index)
        content, calls = reader.feed(tokens.text)
        first = len(reader.calls) - len(calls)
        deltas = [ToolCallDelta(index=first + i, id=c.id, function=FunctionCallDelta(**c.function.model_dump()))
                  for i, c in enumerate(calls)]
        return ChatDelta(content=content, tool_calls=deltas or None)

    def _reader(self, index: int) -> CallReader:
        return self._readers.setdefault(index, CallReader())

    def usage(self, ctx: ReplyContext, finished: list[Finished]) -> ChatCompletionChunk:
        return self._chunk(ctx, [], usage_of(finished))

    @staticmethod
    def _chunk(ctx: ReplyContext, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices, usage=usage
        )
