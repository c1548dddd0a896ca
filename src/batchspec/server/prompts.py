"""From a validated request body to :class:`~batchspec.server.events.GenerationParams`: tokenization, the chat
template, and the checks against the model's context length and vocabulary (each a 400 naming the field)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchspec.sampling import SamplingParams
from batchspec.server.errors import bad_request
from batchspec.server.events import GenerationParams
from batchspec.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

CONTEXT_CODE = "context_length_exceeded"


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
class PromptSize:
    """A bound on a prompt's characters checked before tokenizing: no text longer than ``max_chars`` can fit
    the context, because no token covers more characters than the vocabulary's longest entry (this assumes a
    tokenizer that keeps every character, as the byte-level BPE and SentencePiece tokenizers of causal LMs do).
    """

    max_chars: int
    context_length: int

    @classmethod
    def of(cls, tokenizer: Any, context_length: int) -> PromptSize:
        longest = max([1, *(len(token) for token in tokenizer.get_vocab())])
        return cls(context_length * longest, context_length)

    def check(self, request: CompletionRequest | ChatCompletionRequest) -> None:
        """A 400 (``context_length_exceeded``) for text that cannot fit; token-id prompts are checked later."""
        if isinstance(request, ChatCompletionRequest):
            chars, param = sum(len(m.text()) for m in request.messages), "messages"
        else:
            chars, param = (len(request.prompt) if isinstance(request.prompt, str) else 0), "prompt"
        if chars > self.max_chars:
            raise bad_request(
                f"the prompt has {chars} characters, more than the {self.max_chars} that could fit the model's "
                f"context of {self.context_length} tokens", param=param, code=CONTEXT_CODE,
            )


def completion_params(
    request: CompletionRequest, tokenizer: Any, limits: ModelLimits, default_max_tokens: int
) -> GenerationParams:
    if isinstance(request.prompt, str):
        ids = [int(t) for t in tokenizer(request.prompt, add_special_tokens=True)["input_ids"]]
    else:
        ids = list(request.prompt)
    return _params(ids, Budget(request.max_tokens, default_max_tokens), request, limits, "prompt")


def chat_params(
    request: ChatCompletionRequest, tokenizer: Any, limits: ModelLimits, default_max_tokens: int
) -> GenerationParams:
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model's tokenizer has no chat template; use /v1/completions", param="messages")
    messages = [{"role": _role(m.role), "content": m.text()} for m in request.messages]
    try:
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as error:
        raise bad_request(f"the chat template rejected the messages: {error}", param="messages") from error
    return _params(_as_ids(encoded), Budget(request.token_budget, default_max_tokens), request, limits, "messages")


def _role(role: str) -> str:
    return "system" if role == "developer" else role


def _as_ids(encoded: Any) -> list[int]:
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return [int(token) for token in encoded]


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
