"""``POST /v1/responses``: OpenAI's Responses API, text only and stateless, served as a chat request.

A request is translated into a :class:`~batchspec.server.protocol.ChatCompletionRequest` (``instructions`` as a
first system message, ``input`` as the messages, ``function_call`` / ``function_call_output`` items as the
assistant's tool calls and the tool messages, ``text.format`` as ``response_format``, the flat function tools as
chat tools), which then takes the chat path: the same rendering, generation, stop handling, errors and metrics.
:class:`ResponsesFormat` writes the result back as a ``response`` object, or as the Responses stream's events.

Nothing is stored: ``store`` is accepted whatever its value (OpenAI's default is true, and the SDK sends nothing),
and a response can be neither retrieved nor continued. A 400 names the field for what needs state or is not text:
``previous_response_id``, ``conversation``, ``background: true``, built-in tools (``web_search``,
``file_search``, ...), input parts other than text.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, ValidationInfo, field_validator

from batchspec.config import setting_default
from batchspec.engine import GenerationParams
from batchspec.server.errors import APIError, bad_request
from batchspec.server.events import Finished, Tokens
from batchspec.server.params import PromptReader
from batchspec.server.protocol import ChatCompletionRequest, StrictRequest, ToolCall
from batchspec.server.response_bodies import ChoiceOutput, ReplyContext
from batchspec.server.tools import CallReader, split_calls
from batchspec.server.validation import validation_error

TEXT_PARTS = ("input_text", "output_text")
UNSUPPORTED = {
    "previous_response_id": "responses are not stored, so none can be continued; send the whole conversation",
    "conversation": "conversations are not stored; send the whole conversation as input",
    "prompt": "stored prompt templates are not supported",
}


class TextPart(StrictRequest):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(StrictRequest):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(StrictRequest):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictRequest):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


ITEM_KINDS = ("message", "function_call", "function_call_output")


def _item_kind(value: Any) -> str | None:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)


def check_input_items(items: Any) -> None:
    """A clear error for an input item of another kind (reasoning, built-in tool calls, references) or a
    content part that is not text (images, files, audio)."""
    for item in items if isinstance(items, list) else []:
        kind = _item_kind(item)
        if kind not in ITEM_KINDS:
            raise ValueError(f"input items of type {kind!r} are not supported (only {', '.join(ITEM_KINDS)})")
        content = item.get("content") if isinstance(item, dict) else None
        for part in content if isinstance(content, list) else []:
            part_kind = part.get("type") if isinstance(part, dict) else None
            if part_kind not in TEXT_PARTS:
                raise ValueError(f"only text input is supported (input_text parts); got a {part_kind!r} part")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]


class FunctionTool(StrictRequest):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(StrictRequest):
    type: Literal["function"]
    name: str


class JsonSchemaText(StrictRequest):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class PlainFormat(StrictRequest):
    type: Literal["text", "json_object"]


class TextConfig(StrictRequest):
    format: Annotated[PlainFormat | JsonSchemaText, Field(discriminator="type")] = PlainFormat(type="text")
    verbosity: Literal["medium"] | None = None


class ResponsesRequest(StrictRequest):
    """``POST /v1/responses``; fields that need state or a built-in tool are refused with a 400 naming them."""

    model: str | None = None
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = setting_default("temperature")
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = setting_default("top_p")
    stream: bool = False
    text: TextConfig = TextConfig()
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    previous_response_id: None = None
    conversation: None = None
    prompt: None = None

    @field_validator(*UNSUPPORTED, mode="before")
    @classmethod
    def _stateful(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(UNSUPPORTED[info.field_name])
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _text_input(cls, value: Any) -> Any:
        check_input_items(value)
        return value

    @field_validator("background", mode="before")
    @classmethod
    def _background(cls, value: Any) -> Any:
        if value is True:
            raise ValueError("background responses are not supported (they would have to be stored)")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        for tool in value if isinstance(value, list) else []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"only function tools are supported; built-in tools such as {kind!r} are not")
        return value

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as a chat request (validated as one: its checks and 400s apply)."""
        body: dict[str, Any] = {
            "model": self.model, "messages": self._messages(), "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream, "user": self.user,
            "parallel_tool_calls": self.parallel_tool_calls, "response_format": self._response_format(),
        }
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if self.tool_choice is not None:
            choice = self.tool_choice
            body["tool_choice"] = (choice if isinstance(choice, str)
                                   else {"type": "function", "function": {"name": choice.name}})
        return ChatCompletionRequest.model_validate(body)

    def _response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format
        if isinstance(fmt, JsonSchemaText):
            schema = fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
            return {"type": "json_schema", "json_schema": schema}
        return None if fmt.type == "text" else {"type": "json_object"}

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            else:
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1]["role"] == "assistant":
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return messages


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["completed"] = "completed"


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseObject(BaseModel):
    """A ``response`` object: the request's settings echoed, its output items and usage."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputMessage | OutputFunctionCall]
    parallel_tool_calls: bool
    previous_response_id: None = None
    store: bool = False
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str]
    user: str | None
    usage: ResponseUsage | None = None


class StreamEvent(BaseModel):
    """One event of a streamed response: its ``type``, its place in the stream and the type's own fields."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int


def response_id(ctx: ReplyContext) -> str:
    return "resp_" + ctx.request_id.partition("-")[2]


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponsesFormat:
    """One request's reply as a ``response`` object or as the Responses stream's events (sequence numbered).

    When the request offers tools, calls are parsed out of the output (:mod:`~batchspec.server.tools`): each
    becomes a ``function_call`` item after the message, and a response that only calls tools has no message. The
    stream opens its message item at the first content it has to send.
    """

    request: ResponsesRequest
    parse_calls: bool
    id_prefix: str = "resp"
    sse_events: bool = True
    created_at: int = field(default_factory=lambda: int(time.time()))
    message_id: str = field(default_factory=lambda: item_id("msg"))
    reader: CallReader = field(default_factory=CallReader)
    sequence: int = 0
    opened: bool = False
    parts: list[str] = field(default_factory=list)

    def full(self, ctx: ReplyContext, choices: list[ChoiceOutput]) -> ResponseObject:
        choice = choices[0]
        content, calls = split_calls(choice.text) if self.parse_calls else (choice.text, [])
        status = _status(choice.end)
        message = [] if content is None else [self._message(content, status)]
        return self._response(ctx, status, [*message, *map(_call_item, calls)], choice.end)

    def opening(self, ctx: ReplyContext, n: int) -> list[BaseModel]:
        shell = self._response(ctx, "in_progress", [], None)
        return [self._event("response.created", response=shell), self._event("response.in_progress", response=shell)]

    def delta(self, ctx: ReplyContext, tokens: Tokens) -> list[BaseModel]:
        text = self.reader.feed(tokens.text)[0] if self.parse_calls else tokens.text
        return self._text(text)

    def closing(self, ctx: ReplyContext, finished: Finished) -> list[BaseModel]:
        events = self._text(self.reader.flush())
        if not self.opened and not self.reader.calls:
            events += self._open()
        status = _status(finished)
        output: list[OutputMessage | OutputFunctionCall] = []
        if self.opened:
            text = "".join(self.parts)
            part = OutputText(text=text)
            done = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
            events += [self._event("response.output_text.done", **done, text=text, logprobs=[]),
                       self._event("response.content_part.done", **done, part=part)]
            output.append(self._message(text, status))
            events.append(self._event("response.output_item.done", output_index=0, item=output[-1]))
        for call in map(_call_item, self.reader.calls):
            events += [self._event("response.output_item.added", output_index=len(output), item=call),
                       self._event("response.output_item.done", output_index=len(output), item=call)]
            output.append(call)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=self._response(ctx, status, output, finished))]

    def usage(self, ctx: ReplyContext, finished: list[Finished]) -> ResponseUsage:
        return _usage(finished[0])

    def _text(self, text: str) -> list[BaseModel]:
        if not text:
            return []
        events = [] if self.opened else self._open()
        self.parts.append(text)
        return [*events, self._event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                     content_index=0, delta=text, logprobs=[])]

    def _open(self) -> list[BaseModel]:
        self.opened = True
        item = OutputMessage(id=self.message_id, status="in_progress", content=[])
        return [self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", item_id=self.message_id, output_index=0,
                            content_index=0, part=OutputText(text=""))]

    def _event(self, kind: str, **fields: Any) -> StreamEvent:
        self.sequence += 1
        return StreamEvent(type=kind, sequence_number=self.sequence - 1, **fields)

    def _message(self, text: str, status: str) -> OutputMessage:
        return OutputMessage(id=self.message_id, status=status, content=[OutputText(text=text)])

    def _response(self, ctx: ReplyContext, status: str, output: list, finished: Finished | None) -> ResponseObject:
        request = self.request
        choice = request.tool_choice or "auto"
        return ResponseObject(
            id=response_id(ctx), created_at=self.created_at, status=status, model=ctx.model, output=output,
            incomplete_details=IncompleteDetails() if status == "incomplete" else None,
            instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            parallel_tool_calls=request.parallel_tool_calls is not False, temperature=request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            text={"format": request.text.format.model_dump(by_alias=True, exclude_none=True)},
            tool_choice=choice if isinstance(choice, str) else choice.model_dump(),
            tools=[t.model_dump(exclude_none=True) for t in request.tools or []],
            metadata=request.metadata or {}, user=request.user,
            usage=None if finished is None else _usage(finished),
        )


def _status(finished: Finished) -> str:
    return "incomplete" if finished.finish_reason == "length" else "completed"


def _usage(finished: Finished) -> ResponseUsage:
    return ResponseUsage(input_tokens=finished.prompt_tokens, output_tokens=finished.completion_tokens,
                         total_tokens=finished.prompt_tokens + finished.completion_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=finished.cached_tokens))


def _call_item(call: ToolCall) -> OutputFunctionCall:
    return OutputFunctionCall(id=item_id("fc"), call_id=call.id, name=call.function.name,
                              arguments=call.function.arguments)


RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text"}


def read_request(reader: PromptReader, raw: bytes) -> tuple[ResponsesRequest, ChatCompletionRequest, GenerationParams]:
    """A ``/v1/responses`` body as its request, the chat request it stands for, and that request's params (read
    as the chat endpoint reads one); errors name the Responses fields."""
    request = reader.bounds.parse(raw, ResponsesRequest)
    reader.check_model(request.model)
    try:
        chat = request.chat_request()
        if len(chat.messages) > reader.bounds.max_messages:
            raise bad_request(f"the input has {len(chat.messages)} messages; at most {reader.bounds.max_messages} "
                              "are accepted", param="input", code="too_many_messages")
        reader.size.check(chat)
        return request, chat, reader.chat_request(chat)
    except ValidationError as error:
        raise _renamed(validation_error(error.errors(include_url=False, include_input=False))) from None
    except APIError as error:
        raise _renamed(error) from None


def _renamed(error: APIError) -> APIError:
    """``error`` with the chat field it names replaced by the Responses field it came from."""
    error.param = RENAMED.get(error.param or "", error.param)
    return error
