"""Tool calls on ``/v1/chat/completions``: the tools handed to the chat template, the grammar that makes the output
a call when ``tool_choice`` asks for one, and the calls read back out of the generated text, whole or streamed.

The format is the one Qwen2.5's template (and Hermes-style templates) teach the model: each call is
``<tool_call>\\n{"name": <function name>, "arguments": <arguments object>}\\n</tool_call>``, calls one per line.
The template itself writes the tools into the prompt (``apply_chat_template(..., tools=...)``); a template that
does not is refused with a 400. ``tool_choice``:

* ``"auto"`` (the default): the model writes text, calls, or both; the calls are parsed out of the text;
* ``"none"``: the tools are not shown to the model and its text is returned as it is;
* ``"required"``: the output is one call or more (one when ``parallel_tool_calls`` is false), each of a tool's name
  with arguments valid under its ``parameters`` schema, enforced by a grammar;
* ``{"type": "function", "function": {"name": ...}}``: the output is one call of that function, likewise enforced.

The grammar writes the JSON as the template writes it in the history (``", "`` and ``": "`` separators). Where
the tokenizer has ``<tool_call>`` as a token of its own (Qwen2.5), the grammar names that token (llguidance's
``<tool_call>`` syntax), so the output holds exactly the token the model itself would emit; elsewhere the tags are
literal text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from batchspec.engine import Grammar, GrammarCompiler, GrammarError
from batchspec.server.errors import bad_request
from batchspec.server.protocol import FunctionCall, NamedToolChoice, ToolCall, ToolDefinition, ToolFields

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
CALL_START = '\n{{"name": {name}, "arguments": '
CALL_END = "}\n"
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolUse:
    """What a request's tool fields mean for its prompt and output.

    Attributes:
        template_tools: the tools as the chat template takes them (None: render no tools).
        parsed: whether calls are parsed out of the output.
        forced: the tools one of which the output must call (``required`` or a named function), or None.
        parallel: whether a forced output may hold several calls.
    """

    template_tools: list[dict[str, Any]] | None = None
    parsed: bool = False
    forced: list[ToolDefinition] | None = None
    parallel: bool = False

    @classmethod
    def of(cls, request: ToolFields) -> ToolUse:
        if not request.tools or request.tool_choice == "none":
            return cls()
        choice = request.tool_choice or "auto"
        rendered = [tool.model_dump(exclude_none=True) for tool in request.tools]
        if choice == "auto":
            return cls(rendered, parsed=True)
        if isinstance(choice, NamedToolChoice):
            chosen = [t for t in request.tools if t.function.name == choice.function.name]
            return cls(rendered, parsed=True, forced=chosen)
        return cls(rendered, parsed=True, forced=request.tools, parallel=request.parallel_tool_calls is not False)

    def compile(self, compiler: GrammarCompiler) -> Grammar | None:
        """The grammar that forces a call, compiled; None when nothing is forced; a 400 naming ``tools`` when
        llguidance refuses it (a schema it cannot compile)."""
        if self.forced is None:
            return None
        try:
            return compiler.lark(calls_grammar(self.forced, self.parallel, tag_syntax(compiler)))
        except GrammarError as error:
            raise bad_request(f"the tools' parameters could not be compiled to a grammar: {error}",
                              param="tools") from None


@lru_cache(maxsize=8)
def tag_syntax(compiler: GrammarCompiler) -> tuple[str, str]:
    """The tags as a Lark grammar writes them for ``compiler``'s tokenizer: as the tokens they are where the
    tokenizer has them as tokens, else as quoted text."""
    try:
        compiler.lark(f"start: {OPEN} {CLOSE}")
    except GrammarError:
        return json.dumps(OPEN), json.dumps(CLOSE)
    return OPEN, CLOSE


def calls_grammar(tools: list[ToolDefinition], parallel: bool, tags: tuple[str, str]) -> str:
    """A Lark grammar (llguidance's dialect) for one call of any of ``tools``, or several, one per line."""
    rules = [f"call_{i}: {_call_body(tool, tags)}" for i, tool in enumerate(tools)]
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([start, f"call: {calls}", *rules]) + "\n"


def _call_body(tool: ToolDefinition, tags: tuple[str, str]) -> str:
    head = json.dumps(CALL_START.format(name=json.dumps(tool.function.name)))
    schema = {**(tool.function.parameters or ANY_OBJECT), "x-guidance": JSON_STYLE}
    return f"{tags[0]} {head} %json {json.dumps(schema)} {json.dumps(CALL_END)} {tags[1]}"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(block: str) -> ToolCall | None:
    """The call written between the tags of ``block``; None unless it is a JSON object with a string ``name`` and
    an object of ``arguments``."""
    try:
        data = json.loads(block[len(OPEN) : -len(CLOSE)])
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(id=new_call_id(), function=FunctionCall(name=data["name"],
                                                            arguments=json.dumps(arguments, ensure_ascii=False)))


@dataclass
class CallReader:
    """Splits generated text, as it arrives, into content and calls.

    Text outside the tags is content, less the whitespace right before and after a call (the line breaks between
    calls); a complete block that does not parse as a call stays content. Text that may still turn out to open a
    call (a tail such as ``<tool``, or whitespace) is held back until it is known.
    """

    pending: str = ""
    after_call: bool = False
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content that ``text`` completes, and the calls it closes."""
        self.pending += text
        content: list[str] = []
        found: list[ToolCall] = []
        while (start := self.pending.find(OPEN)) >= 0 and (end := self.pending.find(CLOSE, start)) >= 0:
            end += len(CLOSE)
            call = parse_call(self.pending[start:end])
            if call is None:
                content.append(self._content(self.pending[:end]))
            else:
                content.append(self._content(self.pending[:start].rstrip()))
                found.append(call)
                self.after_call = True
            self.pending = self.pending[end:]
        held = _undecided(self.pending)
        content.append(self._content(self.pending[:held]))
        self.pending = self.pending[held:]
        self.calls.extend(found)
        return "".join(content), found

    def flush(self) -> str:
        """The content held back when the output ends."""
        rest, self.pending = self.pending, ""
        return self._content(rest)

    def _content(self, text: str) -> str:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        return text


def _undecided(text: str) -> int:
    """Where the tail of ``text`` that could still precede or begin a call starts: whitespace, then an opening tag
    not closed yet or a prefix of one."""
    cut = text.find(OPEN)
    if cut < 0:
        cut = len(text)
        for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
            if text.endswith(OPEN[:size]):
                cut = len(text) - size
                break
    return len(text[:cut].rstrip())


def split_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """The whole output's content (None when only calls remain) and its calls."""
    reader = CallReader()
    content, _ = reader.feed(text)
    content += reader.flush()
    return (content or None) if reader.calls else content, reader.calls


def call_finish_reason(reason: str, calls: list[ToolCall]) -> str:
    """"tool_calls" for an output that ended on its own after calling tools."""
    return "tool_calls" if calls and reason == "stop" else reason


def template_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """An assistant message's calls as templates read them: the arguments as an object, not as JSON text."""
    return [{"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _arguments(c)}}
            for c in calls]


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        raise bad_request(f"the arguments of tool call {call.id!r} are not valid JSON",
                          param="messages") from None

