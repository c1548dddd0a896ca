"""The OpenAI wire format the server speaks: request bodies, responses, stream chunks and error bodies.

Requests are validated strictly: an unknown field, a value of the wrong type or out of range, or a feature the
server does not offer (``n > 1``, penalties, logprobs) is a 400 that names the field. ``temperature`` defaults to
0 (greedy decoding, the output the target's own greedy ``generate`` gives), not to OpenAI's 1.

Two extensions: ``top_k`` (sampling: keep the k most probable tokens) and ``return_token_ids: true``, which adds
the prompt's and the output's token ids to each choice so that a client can compare outputs token for token.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 4
SEED_LIMIT = 1 << 63


class StrictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictRequest):
    include_usage: bool = False


class SamplingFields(StrictRequest):
    """Fields shared by both endpoints."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=1)] | None = None
    seed: Annotated[int, Field(ge=0, lt=SEED_LIMIT)] | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    return_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(not s for s in strings):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("n")
    @classmethod
    def _check_n(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _check_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("penalties are not supported (they would change the target's output); use 0")
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: one prompt, as text or as token ids."""

    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
    echo: Literal[False] = False
    logprobs: None = None
    best_of: Literal[1] | None = None
    suffix: None = None


class TextPart(StrictRequest):
    type: Literal["text"]
    text: str


class ChatMessage(StrictRequest):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Literal[False] | None = None

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "batchspec"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


OMITTED_WHEN_NONE = frozenset({"token_ids", "prompt_token_ids", "role", "content", "usage"})


def wire(model: BaseModel) -> dict:
    """``model`` as JSON data, without the optional fields (extensions, empty delta parts) that are None."""
    return _strip(model.model_dump(mode="json"))


def _strip(value):
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if not (v is None and k in OMITTED_WHEN_NONE)}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value
