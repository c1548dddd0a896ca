"""Chat prompts: the tokenizer's chat template, with message content always read as text.

Tokenizing a rendered chat template the usual way finds special-token strings wherever they are, in the content
too: a user who writes ``<|im_start|>system`` gets the real special token and can forge turns of the conversation
(a system turn, an assistant turn). Here only the template places special tokens. A prompt whose content holds no
special token's text is tokenized as ``apply_chat_template(..., tokenize=True)`` tokenizes it, token for token.
Otherwise every special-token string in the content is swapped for a placeholder before the template is rendered;
the rendered text is cut at the special tokens the template placed, the placeholders are put back, and the text
between is tokenized with ``split_special_tokens=True``, so that the content's ``<|im_start|>`` becomes ordinary
tokens (``<``, ``|``, ``im``, ...). A special token that strips the whitespace beside it (``lstrip``/``rstrip``)
strips it here too. The same holds for every string of the tools and of the history's tool calls (names,
descriptions, schemas, arguments), which the template writes into the prompt too.

:class:`MessageCost` is what the template adds for each message, measured once at startup: the prompt-size check
counts it before anything is tokenized.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from batchspec.server.errors import APIError, bad_request
from batchspec.server.protocol import ChatMessage
from batchspec.server.tools import template_tool_calls

PRIVATE_USE = range(0xE000, 0xF900)
PROBE_ROLES = ("user", "assistant", "system")
PROBE_TOOL = "batchspec_probe_tool"
Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]] | None


@dataclass(frozen=True)
class SpecialTokens:
    """A tokenizer's special added tokens (``<|im_start|>``, ``<|endoftext|>``, ...) by their text."""

    ids: dict[str, int]
    lstrip: frozenset[str] = frozenset()
    rstrip: frozenset[str] = frozenset()

    @classmethod
    def of(cls, tokenizer: Any) -> SpecialTokens:
        added = [(index, token) for index, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
                 if token.special and token.content]
        return cls(
            {token.content: int(index) for index, token in added},
            frozenset(token.content for _, token in added if token.lstrip),
            frozenset(token.content for _, token in added if token.rstrip),
        )

    @cached_property
    def ordered(self) -> tuple[str, ...]:
        """The special tokens' texts, the longest first (so that a longer one wins where two match)."""
        return tuple(sorted(self.ids, key=len, reverse=True))

    @cached_property
    def pattern(self) -> re.Pattern[str]:
        """Any special token's text as one captured group (for :func:`re.split`)."""
        return re.compile("(" + "|".join(map(re.escape, self.ordered)) + ")" if self.ordered else "(?!)")

    def found_in(self, text: str) -> bool:
        return any(special in text for special in self.ids)

    def split(self, text: str) -> list[str]:
        """``text`` cut at special tokens: text, special, text, ..., text (an odd number of pieces)."""
        return self.pattern.split(text)

    def count(self, text: str) -> tuple[int, int]:
        """How many special tokens ``text`` holds, and how many characters it has besides them."""
        pieces = self.split(text)
        return len(pieces) // 2, sum(len(piece) for piece in pieces[0::2])


@dataclass(frozen=True)
class MessageCost:
    """What the chat template adds for every message, at least: special tokens and other characters.

    Measured by :meth:`probe` as the least that appending one empty message of any role adds to a one-message
    conversation; roles the template refuses there are skipped.
    """

    special_tokens: int = 0
    chars: int = 0

    @classmethod
    def probe(cls, tokenizer: Any, specials: SpecialTokens) -> MessageCost:
        if not getattr(tokenizer, "chat_template", None):
            return cls()
        first = [{"role": "user", "content": "a"}]
        try:
            base = specials.count(_render(tokenizer, first, add_generation_prompt=False))
        except Exception:
            return cls()
        costs = []
        for role in PROBE_ROLES:
            try:
                longer = specials.count(_render(tokenizer, [*first, {"role": role, "content": ""}],
                                                add_generation_prompt=False))
            except Exception:
                continue
            costs.append((longer[0] - base[0], longer[1] - base[1]))
        if not costs:
            return cls()
        return cls(max(0, min(c[0] for c in costs)), max(0, min(c[1] for c in costs)))


@dataclass(frozen=True)
class ChatEncoder:
    """Renders and tokenizes chat messages so that only the template places special tokens."""

    tokenizer: Any
    specials: SpecialTokens
    cost: MessageCost

    @classmethod
    def of(cls, tokenizer: Any) -> ChatEncoder:
        specials = SpecialTokens.of(tokenizer)
        return cls(tokenizer, specials, MessageCost.probe(tokenizer, specials))

    def encode(self, messages: Messages, tools: Tools = None) -> list[int]:
        """The prompt's token ids, with the generation prompt and the ``tools`` (function definitions, as
        ``apply_chat_template`` takes them); a 400 when the template cannot render them."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model's tokenizer has no chat template; use /v1/completions", param="messages")
        if tools is not None and not self.supports_tools:
            raise bad_request("this model's chat template does not render tools, so the model cannot be offered "
                              "any", param="tools")
        try:
            if any(self.specials.found_in(text) for text in strings_of([messages, tools])):
                return self.encode_guarded(messages, tools)
            return _as_ids(self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True))
        except APIError:
            raise
        except Exception as error:
            raise bad_request(f"the chat template rejected the messages: {error}", param="messages") from error

    @cached_property
    def supports_tools(self) -> bool:
        """Whether the template writes the tools it is given into the prompt (checked with a probe tool)."""
        tool = {"type": "function", "function": {"name": PROBE_TOOL, "description": "", "parameters": {}}}
        try:
            text = _render(self.tokenizer, [{"role": "user", "content": "a"}], add_generation_prompt=True, tools=[tool])
        except Exception:
            return False
        return PROBE_TOOL in text

    def encode_guarded(self, messages: Messages, tools: Tools = None) -> list[int]:
        """The prompt's token ids with every special-token string of the content (and of the tools and calls) read
        as text."""
        mask = Mask.free_of(self.specials, list(strings_of([messages, tools])), self.tokenizer.chat_template)
        rendered = _render(self.tokenizer, mask.hide(messages), add_generation_prompt=True, tools=mask.hide(tools))
        pieces = self.specials.split(rendered)
        texts = [mask.reveal(self._stripped(pieces, i)) for i in range(0, len(pieces), 2)]
        encoded = self.tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        ids = [int(t) for t in encoded[0]]
        for special, text_ids in zip(pieces[1::2], encoded[1:], strict=True):
            ids.append(self.specials.ids[special])
            ids.extend(int(t) for t in text_ids)
        return ids

    def _stripped(self, pieces: list[str], index: int) -> str:
        """Text piece ``index`` less the whitespace its neighbouring special tokens take (lstrip, rstrip)."""
        text = pieces[index]
        if index > 0 and pieces[index - 1] in self.specials.rstrip:
            text = text.lstrip()
        if index + 1 < len(pieces) and pieces[index + 1] in self.specials.lstrip:
            text = text.rstrip()
        return text


@dataclass(frozen=True)
class Mask:
    """Stands in for special-token strings in content while the template renders: special number ``i`` becomes
    ``marker + str(i) + marker``, with a private-use ``marker`` character found in no content nor the template."""

    specials: SpecialTokens
    marker: str

    @classmethod
    def free_of(cls, specials: SpecialTokens, contents: list[str], template: str) -> Mask:
        texts = [template, *contents]
        free = (chr(code) for code in PRIVATE_USE if not any(chr(code) in text for text in texts))
        marker = next(free, None)
        if marker is None:
            raise bad_request("the messages use every private-use character", param="messages")
        return cls(specials, marker)

    def hide(self, value: Any) -> Any:
        """``value`` with the special-token strings of its every string (keys too, at any depth) hidden."""
        if isinstance(value, str):
            index = {special: i for i, special in enumerate(self.specials.ordered)}
            return self.specials.pattern.sub(lambda m: f"{self.marker}{index[m.group()]}{self.marker}", value)
        if isinstance(value, dict):
            return {self.hide(k): self.hide(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.hide(v) for v in value]
        return value

    def reveal(self, text: str) -> str:
        marker = re.escape(self.marker)
        return re.sub(f"{marker}(\\d+){marker}", lambda m: self.specials.ordered[int(m.group(1))], text)


def strings_of(value: Any) -> Iterator[str]:
    """Every string in ``value`` (nested lists and dicts, keys included)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from strings_of(key)
            yield from strings_of(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings_of(item)


def template_messages(messages: list[ChatMessage]) -> Messages:
    """The request's messages as chat templates take them: ``developer`` as ``system``, content as one text (null
    in an assistant message that only calls tools), calls with their arguments as objects."""
    rendered = []
    for message in messages:
        item: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
        item["content"] = None if message.content is None else message.text()
        if message.tool_calls is not None:
            item["tool_calls"] = template_tool_calls(message.tool_calls)
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        rendered.append(item)
    return rendered


def _render(tokenizer: Any, messages: Messages, *, add_generation_prompt: bool, tools: Tools = None) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )


def _as_ids(encoded: Any) -> list[int]:
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return [int(token) for token in encoded]
