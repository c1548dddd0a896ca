"""The OpenAI wire format the server speaks: request bodies, responses, stream chunks and error bodies.

Requests are validated strictly: an unknown field, a value of the wrong type or out of range, or a feature the
server does not offer (``suffix``, ``best_of > 1``) is a 400 that names the field. ``temperature``
defaults to 0 (greedy decoding, the output the target's own greedy ``generate`` gives), not to OpenAI's 1.

Supported beyond plain sampling: ``n`` choices per request, ``logprobs`` (the target's raw logprobs, with up to
:data:`MAX_TOP_LOGPROBS` alternatives; on completions with ``echo`` the prompt's too), ``presence_penalty``,
``frequency_penalty``, ``logit_bias`` and ``response_format`` (JSON object or JSON schema), and on chat ``tools``,
``tool_choice`` and ``parallel_tool_calls`` with a history of assistant ``tool_calls`` and ``tool`` messages
(:mod:`~batchspec.server.tools`). Three extensions: ``top_k`` (sampling: keep the k most probable tokens),
``repetition_penalty`` (vLLM's) and ``return_token_ids: true``, which adds the prompt's and the output's token ids
to each choice so that a client can compare outputs token for token.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from batchspec.config import SEED_LIMIT, setting_default
from batchspec.engine import MAX_BIAS
from batchspec.engine import MAX_TOP as MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 4
MAX_CHOICES = 16
MAX_PENALTY = 2.0


class StrictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictRequest):
    include_usage: bool = False


class TextFormat(StrictRequest):
    type: Literal["text"]


class JsonObjectFormat(StrictRequest):
    type: Literal["json_object"]


class JsonSchema(StrictRequest):
    """OpenAI's ``response_format.json_schema``; the output always follows ``schema`` (as with ``strict: true``)."""

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(StrictRequest):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class SamplingFields(StrictRequest):
    """Fields shared by both endpoints."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = setting_default("temperature")
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = setting_default("top_p")
    top_k: Annotated[int, Field(ge=1)] | None = None
    seed: Annotated[int, Field(ge=0, lt=SEED_LIMIT)] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1.0
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    return_token_ids: bool = False

    @property
    def prompt_logprob_alternatives(self) -> int | None:
        """Alternatives per prompt token's logprobs; None: none (only completions' ``echo`` asks for them)."""
        return None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(not s for s in strings):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        bad = next((key for key in value or {} if not (key.isascii() and key.isdigit())), None)
        if bad is not None:
            raise ValueError(f"keys must be token ids (decimal integers >= 0); got {bad!r}")
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def bias(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``(token id, bias)`` pairs, by token id."""
        return tuple(sorted((int(key), value) for key, value in (self.logit_bias or {}).items()))


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: one prompt, as text or as token ids."""

    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    best_of: Literal[1] | None = None
    suffix: None = None

    @property
    def logprob_alternatives(self) -> int | None:
        """Alternatives per output token's logprobs; None: no logprobs."""
        return self.logprobs

    @property
    def prompt_logprob_alternatives(self) -> int | None:
        """Alternatives per prompt token's logprobs: ``logprobs`` when the prompt is echoed, else None."""
        return self.logprobs if self.echo else None


class TextPart(StrictRequest):
    type: Literal["text"]
    text: str


class FunctionCall(StrictRequest):
    """A call's function: its name and its arguments as a JSON text (an object)."""

    name: Annotated[str, Field(min_length=1)]
    arguments: str


class ToolCall(StrictRequest):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictRequest):
    """One message of the history; an assistant's may hold ``tool_calls`` (its content then may be null), and a
    ``tool`` message answers the call named by ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check_shape(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages may have tool_calls")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise ValueError("tool messages, and only they, need a tool_call_id")
        if self.content is None and self.tool_calls is None:
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class FunctionDefinition(StrictRequest):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(StrictRequest):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictRequest):
    name: str


class NamedToolChoice(StrictRequest):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(StrictRequest):
    """The tools a chat request offers the model and how it must use them (``tool_choice``: "auto" by default)."""

    tools: Annotated[list[ToolDefinition], Field(min_length=1)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, value: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        names = [tool.function.name for tool in value or []]
        if len(set(names)) != len(names):
            raise ValueError("function names must be distinct")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _check_choice(cls, value: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        names = [tool.function.name for tool in info.data.get("tools") or []]
        if value not in (None, "none", "auto") and not names:
            raise ValueError("a tool_choice that asks for a call needs tools")
        chosen = value.function.name if isinstance(value, NamedToolChoice) else None
        if chosen is not None and chosen not in names:
            raise ValueError(f"names {chosen!r}, which is not among the tools")
        return value


class ChatCompletionRequest(SamplingFields, ToolFields):
    """``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprob_alternatives(self) -> int | None:
        """Alternatives per output token's logprobs; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: per token its text, logprob, top alternatives (text → logprob) and its
    character offset in the choice's text; with ``echo`` the prompt's tokens come first, the first with no logprob."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    """One output token of a chat choice: its text, logprob and UTF-8 bytes, and the top alternatives."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str


class ToolCallDelta(BaseModel):
    """A whole call in one stream chunk: its place among the choice's calls, id, name and arguments."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallDelta


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChatLogprobs | None = None
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
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: ChatLogprobs | None = None
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
    # how the pair runs, from its load's record: device, dtype, quantize mode, native build (beyond OpenAI's fields)
    batchspec: dict[str, str] = Field(default_factory=dict)


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


OMITTED_WHEN_NONE = frozenset({"token_ids", "prompt_token_ids", "role", "content", "usage", "tool_calls"})
KEPT_IN = {"message": frozenset({"content"})}  # a whole message always has its content, null when it only calls tools


def wire(model: BaseModel) -> dict:
    """``model`` as JSON data, without the optional fields (extensions, empty delta parts) that are None."""
    return _strip(model.model_dump(mode="json"))


def _strip(value, kept: frozenset[str] = frozenset()):
    if isinstance(value, dict):
        return {k: _strip(v, KEPT_IN.get(k, frozenset())) for k, v in value.items()
                if not (v is None and k in OMITTED_WHEN_NONE and k not in kept)}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value
