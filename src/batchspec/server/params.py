"""From a request body to :class:`~batchspec.engine.GenerationParams`: parsing and validation, the checks
against the model's context length and vocabulary (each a 400 naming the field), the chat template and
tokenization, the penalties and logit bias, and the grammar of a ``response_format``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from batchspec.config import SamplingParams
from batchspec.engine import GenerationParams, Grammar, GrammarCompiler, GrammarError, Penalties
from batchspec.server.bodies import BodyBounds
from batchspec.server.chat import ChatEncoder, MessageCost, template_messages
from batchspec.server.errors import bad_request
from batchspec.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    ResponseFormat,
    SamplingFields,
)
from batchspec.server.tools import ToolUse

logger = logging.getLogger(__name__)

CONTEXT_CODE = "context_length_exceeded"

Request = TypeVar("Request", CompletionRequest, ChatCompletionRequest)


@dataclass(frozen=True)
class ModelLimits:
    """What a request must fit: ``context_length`` positions (prompt + output) and ``vocab_size`` token ids."""

    context_length: int
    vocab_size: int

    def __post_init__(self) -> None:
        if self.context_length < 2:
            raise ValueError(f"context_length must be >= 2; got {self.context_length}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1; got {self.vocab_size}")


@dataclass(frozen=True)
class StructuredOutputs:
    """The server's one grammar compiler (built at startup: reading a tokenizer takes about a second), or, when
    llguidance cannot read the tokenizer, why structured outputs are unavailable."""

    compiler: GrammarCompiler | None
    unavailable: str = ""

    @classmethod
    def of(cls, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> StructuredOutputs:
        """``eos_token_ids``: the ids the engine stops at, what a complete output allows next."""
        try:
            return cls(GrammarCompiler(tokenizer, vocab_size, eos_token_ids))
        except ValueError as error:
            logger.warning("structured outputs are unavailable: llguidance cannot read the tokenizer: %s", error)
            return cls(None, f"llguidance cannot read this model's tokenizer ({error})")

    def require(self, param: str) -> GrammarCompiler:
        """The compiler; a 400 naming ``param`` when there is none."""
        if self.compiler is None:
            raise bad_request(f"{param} is not available on this server: {self.unavailable}", param=param)
        return self.compiler

    def response_format(self, fmt: ResponseFormat | None) -> Grammar | None:
        """The grammar of a ``response_format`` (None for plain text); a 400 with llguidance's reason for a schema
        it cannot compile."""
        if not isinstance(fmt, JsonObjectFormat | JsonSchemaFormat):
            return None
        schema = fmt.json_schema.schema_ if isinstance(fmt, JsonSchemaFormat) else None
        try:
            return self.require("response_format").json_schema(schema)
        except GrammarError as error:
            raise bad_request(f"response_format: {error}", param="response_format") from None


@dataclass(frozen=True)
class PromptSize:
    """A lower bound on a prompt's tokens, checked before tokenizing: no token covers more characters than the
    vocabulary's longest entry, ``longest`` (this assumes a tokenizer that keeps every character, as the
    byte-level BPE and SentencePiece tokenizers of causal LMs do), and the chat template adds at least
    ``message_cost`` to every message but the first (the first may be rendered in a way of its own).
    """

    longest: int
    context_length: int
    message_cost: MessageCost = MessageCost()

    @classmethod
    def of(cls, tokenizer: Any, context_length: int, message_cost: MessageCost | None = None) -> PromptSize:
        longest = max([1, *(len(token) for token in tokenizer.get_vocab())])
        return cls(longest, context_length, message_cost or MessageCost())

    @property
    def max_chars(self) -> int:
        """Characters of text beyond which a completion prompt cannot fit the context."""
        return self.context_length * self.longest

    def least_tokens(self, chars: int, messages: int = 0) -> int:
        """The fewest tokens ``chars`` characters of text in ``messages`` chat messages can take."""
        templated = max(0, messages - 1)
        text = chars + templated * self.message_cost.chars
        return -(-text // self.longest) + templated * self.message_cost.special_tokens

    def check(self, request: CompletionRequest | ChatCompletionRequest) -> None:
        """A 400 (``context_length_exceeded``) for text that cannot fit; token-id prompts are checked later."""
        if isinstance(request, ChatCompletionRequest):
            chars, messages, param = sum(len(m.text()) for m in request.messages), len(request.messages), "messages"
        else:
            chars, messages, param = (len(request.prompt) if isinstance(request.prompt, str) else 0), 0, "prompt"
        least = self.least_tokens(chars, messages)
        if least >= self.context_length:
            template = (f" and {max(0, messages - 1)} messages that the chat template gives at least "
                        f"{self.message_cost.special_tokens} tokens each" if messages else "")
            raise bad_request(
                f"the prompt has at least {least} tokens ({chars} characters, none longer than {self.longest} "
                f"per token{template}); the model's context is {self.context_length} tokens",
                param=param, code=CONTEXT_CODE,
            )


@dataclass(frozen=True)
class PromptReader:
    """A request from its body to :class:`GenerationParams`, all of it in the prompt pool, off the event loop:
    the body parsed and validated within ``bounds``, the model checked (``check_model``), the prompt's size
    bounded before it is tokenized, the prompt tokenized (chat: by ``chat``, content as text), and a
    ``response_format`` compiled by ``structured``."""

    bounds: BodyBounds
    size: PromptSize
    tokenizer: Any
    chat: ChatEncoder
    limits: ModelLimits
    default_max_tokens: int
    check_model: Callable[[str | None], None]
    structured: StructuredOutputs

    def completion(self, raw: bytes) -> tuple[CompletionRequest, GenerationParams]:
        request = self._request(raw, CompletionRequest)
        params = completion_params(request, self.tokenizer, self.limits, self.default_max_tokens)
        return request, self._shaped(request, params)

    def chat_completion(self, raw: bytes) -> tuple[ChatCompletionRequest, GenerationParams]:
        request = self._request(raw, ChatCompletionRequest)
        return request, self.chat_request(request)

    def chat_request(self, request: ChatCompletionRequest) -> GenerationParams:
        """A validated chat request's params (a ``/v1/responses`` request's too, once translated), with the
        grammar that forces a tool call where ``tool_choice`` asks for one."""
        tools = ToolUse.of(request)
        params = self._shaped(request, chat_params(request, self.chat, self.limits, self.default_max_tokens, tools))
        if tools.forced is None:
            return params
        if params.grammar is not None:
            raise bad_request("a tool_choice that forces a tool call cannot be combined with a JSON response_format",
                              param="tool_choice")
        return replace(params, grammar=tools.compile(self.structured.require("tools")))

    def _shaped(self, request: CompletionRequest | ChatCompletionRequest, params: GenerationParams) -> GenerationParams:
        """``params`` with the logprobs asked for and the grammar of the request's ``response_format``."""
        grammar = self.structured.response_format(request.response_format)
        return replace(params, grammar=grammar, logprobs=request.logprob_alternatives,
                       prompt_logprobs=request.prompt_logprob_alternatives)

    def _request(self, raw: bytes, model: type[Request]) -> Request:
        request = self.bounds.parse(raw, model)
        self.check_model(request.model)
        self.size.check(request)
        return request


def completion_params(
    request: CompletionRequest, tokenizer: Any, limits: ModelLimits, default_max_tokens: int
) -> GenerationParams:
    """Special-token strings in a text prompt are parsed as special tokens (the client writes the whole prompt,
    and could send the same ids as a token-id prompt)."""
    if isinstance(request.prompt, str):
        ids = [int(t) for t in tokenizer(request.prompt, add_special_tokens=True)["input_ids"]]
    else:
        ids = list(request.prompt)
    return _params(ids, Budget(request.max_tokens, default_max_tokens), request, limits, "prompt")


def chat_params(
    request: ChatCompletionRequest, chat: ChatEncoder, limits: ModelLimits, default_max_tokens: int,
    tools: ToolUse | None = None,
) -> GenerationParams:
    ids = chat.encode(template_messages(request.messages), (tools or ToolUse()).template_tools)
    return _params(ids, Budget(request.token_budget, default_max_tokens), request, limits, "messages")


@dataclass(frozen=True)
class Budget:
    """A request's ``max_tokens`` (None if it sent none) and the server's default for that case."""

    requested: int | None
    default: int


def _params(
    ids: list[int], budget: Budget, request: SamplingFields, limits: ModelLimits, prompt_param: str
) -> GenerationParams:
    _check_prompt(ids, limits, prompt_param)
    room = limits.context_length - len(ids)
    if budget.requested is not None and budget.requested > room:
        raise bad_request(
            f"max_tokens {budget.requested} and the {len(ids)}-token prompt exceed the model's context of "
            f"{limits.context_length} tokens; at most {room} new tokens fit",
            param="max_tokens", code=CONTEXT_CODE,
        )
    return GenerationParams(
        prompt=ids,
        max_tokens=min(room, budget.default) if budget.requested is None else budget.requested,
        stop=request.stop_strings,
        sampling=sampling_params(request),
        seed=request.seed,
        penalties=penalties(request, limits),
        n=request.n,
    )


def penalties(request: SamplingFields, limits: ModelLimits) -> Penalties:
    """The request's penalties and logit bias; a 400 for a biased token id outside the vocabulary."""
    bad = next((token for token, _ in request.bias if token >= limits.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})", param="logit_bias")
    return Penalties(
        presence=request.presence_penalty, frequency=request.frequency_penalty,
        repetition=request.repetition_penalty, logit_bias=request.bias,
    )


def sampling_params(request: SamplingFields) -> SamplingParams:
    """The request's sampling settings, normalised so that equal settings compare equal (rows of one round must
    share them): greedy ignores top-k and top-p, and ``top_p = 1`` keeps every token, as None does."""
    if request.temperature == 0:
        return SamplingParams()
    top_p = None if request.top_p == 1 else request.top_p
    return SamplingParams(temperature=request.temperature, top_k=request.top_k, top_p=top_p)


def _check_prompt(ids: list[int], limits: ModelLimits, param: str) -> None:
    if not ids:
        raise bad_request("the prompt encodes to no tokens", param=param)
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})", param=param)
    if len(ids) >= limits.context_length:
        raise bad_request(
            f"the prompt has {len(ids)} tokens; the model's context is {limits.context_length} tokens, "
            "which leaves no room for output",
            param=param, code=CONTEXT_CODE,
        )
