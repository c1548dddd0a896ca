"""Request bodies parsed and validated within bounds, in the prompt pool rather than on the event loop.

A 4 MiB body can hold millions of JSON values, and CPython's C JSON parser and pydantic's validator each hold the
interpreter lock for the whole of one call: on the event loop, or even in another thread, a body of many small
values would stall ``/health`` and every stream for hundreds of milliseconds. So a body's shape is first counted
by a pre-scan of its text (:class:`BoundedDecoder`: whole strings and structural characters found by one regular
expression in C, counted in Python), which hands the interpreter lock to the event loop and the engine every
:data:`YIELD_EVERY` values, and which stops at the first value past the body's budget: at most
:attr:`BodyBounds.max_values` values, :attr:`BodyBounds.max_containers` arrays and objects, :data:`MAX_MEMBERS` keys
to an object, nested at most :data:`MAX_DEPTH` deep; only a body within them is then parsed, by ``json.loads``.
Both steps use public APIs (``re``, ``json.loads``), not the internals of the standard library's JSON scanner. The
budget follows from the bounds (the context's worth of token ids, the messages and content parts allowed), so a
hostile body costs a few tens of milliseconds of a pool thread, and a legitimate one is never refused by it. Chat
requests may then hold at most ``max_messages`` messages and ``max_content_parts`` content parts, checked before
pydantic validates what is left, so validation too is short.

Most bodies are far inside their bounds, and for those even the pre-scan is needless: a body whose raw bytes hold no
more commas and brackets than its budget (counted in C; strings can only add to the count, so it never passes a
body the pre-scan would refuse on count) is read by ``json.loads`` at once, with the keys of each object
counted as it is built and the nesting checked on the result. A 32k-token-id prompt (220 kB) then parses and
validates in 2.8-4.8 ms, where a value-by-value scan in Python took 60-89 (medians of three runs, 2026-11-25, Zen 4,
``python scripts/parse_bench.py``).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from batchspec.server.errors import APIError, bad_request
from batchspec.server.validation import validation_error

MAX_DEPTH = 16
MAX_MEMBERS = 64  # keys of one JSON object: a request has about 25 fields, a message or a content part a few
YIELD_EVERY = 128  # values read between two hand-overs of the interpreter lock (each about 0.2 ms of work)
VALUES_PER_MESSAGE = 4  # the message object, role, content, name
VALUES_PER_PART = 3  # the part object, type, text
FIELD_VALUES = 256  # the sampling fields, stop strings, stream options, and room for a client's mistakes
COMPLEX_CODE = "request_too_complex"

Model = TypeVar("Model", bound=BaseModel)


@dataclass(frozen=True)
class BodyBounds:
    """How much structure one request body may have.

    Attributes:
        max_token_ids: the longest token-id prompt worth reading (the model's context length).
        max_messages: messages of one chat request.
        max_content_parts: content parts of one chat request, all its messages together.
    """

    max_token_ids: int
    max_messages: int
    max_content_parts: int

    @property
    def max_containers(self) -> int:
        """Arrays and objects: the body, its messages and their content lists, the parts, the prompt, stop."""
        return 2 * self.max_messages + self.max_content_parts + FIELD_VALUES

    @property
    def max_values(self) -> int:
        return (self.max_token_ids + VALUES_PER_MESSAGE * self.max_messages + VALUES_PER_PART * self.max_content_parts
                + FIELD_VALUES)

    def describe(self) -> str:
        return (f"a request may have at most {self.max_messages} messages, {self.max_content_parts} content parts "
                f"and {self.max_token_ids} prompt token ids")

    def parse(self, raw: bytes, model: type[Model]) -> Model:
        """``raw`` as a ``model``; a 400 for malformed JSON, a body past the bounds, or an invalid field."""
        data = load_json(raw, self)
        if isinstance(data, dict) and "messages" in data:
            self._check_chat(data["messages"])
        try:
            return model.model_validate(data)
        except ValidationError as error:
            raise validation_error(error.errors(include_url=False, include_input=False)) from None

    def _check_chat(self, messages: Any) -> None:
        if not isinstance(messages, list):
            return
        if len(messages) > self.max_messages:
            raise bad_request(f"the request has {len(messages)} messages; at most {self.max_messages} are accepted",
                              param="messages", code="too_many_messages")
        parts = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))
        if parts > self.max_content_parts:
            raise bad_request(f"the messages have {parts} content parts; at most {self.max_content_parts} are "
                              "accepted", param="messages", code="too_many_content_parts")


def load_json(raw: bytes, bounds: BodyBounds) -> Any:
    """The JSON value in ``raw`` (counted by :class:`BoundedDecoder` unless its bytes are certainly within the bounds);
    a 400 if it is malformed or too complex."""
    try:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
        if counted_within(raw, bounds):
            return _nesting_checked(json.loads(text, object_pairs_hook=_members_checked))
        return BoundedDecoder(bounds).decode(text)
    except TooComplex as error:
        raise APIError(400, str(error), code=COMPLEX_CODE) from None
    except json.JSONDecodeError as error:
        raise bad_request(f"the request body is not valid JSON: {error}", code="invalid_json") from None
    except ValueError as error:  # undecodable bytes, an integer of more digits than Python converts
        raise bad_request(f"the request body is not valid JSON: {error}", code="invalid_json") from None


def counted_within(raw: bytes, bounds: BodyBounds) -> bool:
    """Whether ``raw`` certainly holds no more values and containers than ``bounds`` allow, by counting its bytes
    in C: every array or object opens with a bracket and every value after a container's first follows a comma, so
    values <= commas + opening brackets; characters inside strings only add to both counts."""
    opening = raw.count(b"[") + raw.count(b"{")
    return opening <= bounds.max_containers and raw.count(b",") + opening <= bounds.max_values


def _members_checked(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object of the C parser's, refused past :data:`MAX_MEMBERS` keys."""
    if len(pairs) > MAX_MEMBERS:
        raise TooComplex(f"a JSON object of the request body has more than {MAX_MEMBERS} keys")
    return dict(pairs)


def _nesting_checked(value: Any, depth: int = 0) -> Any:
    """``value``, refused where arrays and objects nest more than :data:`MAX_DEPTH` deep. Arrays of scalars (a
    prompt's token ids) are passed over at C speed (the set of their element types)."""
    if not isinstance(value, list | dict):
        return value
    if depth + 1 > MAX_DEPTH:
        raise TooComplex(f"the request body nests arrays and objects more than {MAX_DEPTH} deep")
    children = value.values() if isinstance(value, dict) else value
    if set(map(type, children)) & {list, dict}:
        for child in children:
            _nesting_checked(child, depth + 1)
    return value


class TooComplex(Exception):
    """The body has more values, containers or nesting than its bounds allow."""


TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[][{},:]')  # a whole string, or one structural character


class BoundedDecoder:
    """A pre-scan of the body's text that counts its values, containers, object keys and nesting against
    ``bounds`` (stopping at the first past them, and handing the interpreter lock over every :data:`YIELD_EVERY`
    values), then ``json.loads`` for a body within them. The scan reads structure only: whole strings and the
    structural characters, found by one regular expression in C; a scalar is the text between two of them.
    Values are counted as the standard library's scanner reads them: every array element and every object member's
    value, not the body itself."""

    def __init__(self, bounds: BodyBounds) -> None:
        self.bounds = bounds
        self.values = 0
        self.containers = 0

    def decode(self, text: str) -> Any:
        self.scan(text)
        return json.loads(text)

    def scan(self, text: str) -> None:
        """Raise :class:`TooComplex` at the first value, container, key or level past the bounds."""
        open_: list[list[int]] = []  # per open container: [is an object, keys read]
        pending = key_next = False  # a value may start here (after "[", ":" or an array's ","); a key (in an object)
        last = 0
        for match in TOKENS.finditer(text):
            token, scalar = match.group(), bool(text[last:match.start()].strip())
            last = match.end()
            if pending and (scalar or token[0] in '"[{'):
                self._value()
            if key_next and token[0] == '"':
                self._key(open_[-1])
            pending = key_next = False
            if token in "[{":
                self._open(open_, token == "{")
                pending, key_next = token == "[", token == "{"
            elif token in "]}":
                if not open_:
                    return  # malformed: json.loads says where
                open_.pop()
            elif token == ":":
                pending = True
            elif token == "," and open_:
                pending, key_next = not open_[-1][0], bool(open_[-1][0])

    def _value(self) -> None:
        self.values += 1
        if self.values % YIELD_EVERY == 0:
            time.sleep(0)  # other threads waiting for the lock get it now, not at the next switch interval
        if self.values > self.bounds.max_values:
            raise TooComplex(f"the request body has more than {self.bounds.max_values} JSON values "
                             f"({self.bounds.describe()})")

    def _key(self, container: list[int]) -> None:
        container[1] += 1
        if container[1] > MAX_MEMBERS:
            raise TooComplex(f"a JSON object of the request body has more than {MAX_MEMBERS} keys")

    def _open(self, open_: list[list[int]], is_object: bool) -> None:
        self.containers += 1
        if self.containers > self.bounds.max_containers:
            raise TooComplex(f"the request body has more than {self.bounds.max_containers} JSON arrays and objects "
                             f"({self.bounds.describe()})")
        open_.append([is_object, 0])
        if len(open_) > MAX_DEPTH:
            raise TooComplex(f"the request body nests arrays and objects more than {MAX_DEPTH} deep")
