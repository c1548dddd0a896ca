"""Grammars that constrain a row's output (structured outputs, tool calls), run by llguidance.

A :class:`GrammarCompiler` wraps one tokenizer (building llguidance's view of it takes about a second, so a server
builds it once); it turns a JSON schema, "any JSON object" or a Lark grammar into a :class:`Grammar`, checked at
once, so that a grammar llguidance cannot compile is refused before the request reaches the engine
(:class:`GrammarError` carries llguidance's reason). Each row that uses a grammar holds its own
:class:`GrammarState`: the matcher that has consumed the row's output so far.

Speculation: the allowed tokens at the ``j``-th verified position depend on the drafts ``d_1 .. d_{j-1}`` before it,
exactly as in plain decoding with that prefix. :meth:`GrammarState.masks` consumes the row's drafts one by one,
filling the allowed set of every position it reaches, and rolls them back; a position past a draft the grammar
refuses is never reached (that draft is rejected: the target's constrained distribution gives it no mass), so it
allows every token. :meth:`GrammarState.advance` then consumes the tokens the row gained.

Worked example (``k = 2``, the grammar allows ``{a}`` first, then ``{b, c}``, then ``{EOS}``; drafts ``[a, x]``)::

    position 0: allowed {a}        (before any draft)
    position 1: allowed {b, c}     (after d_1 = a; d_2 = x is refused, so position 2 is unreachable)
    position 2: every token
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

BITS = 32  # tokens per word of llguidance's bitmask


class GrammarError(ValueError):
    """llguidance could not compile the grammar; the message is its reason."""


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar, shared by every row that uses it; :meth:`start` gives a row its own state."""

    compiler: GrammarCompiler
    source: str  # llguidance's grammar text (what ``LLMatcher.grammar_from_*`` returns)

    def start(self) -> GrammarState:
        return GrammarState(self.compiler.matcher(self.source), self.compiler.vocab_size)


class GrammarCompiler:
    """Compiles grammars for one tokenizer. ``vocab_size`` is the width of the model's logits (it may exceed the
    tokenizer's vocabulary; the extra ids are never allowed); ``eos_token_ids``, the ids that end a row (default: the
    tokenizer's EOS), are what a complete output allows next."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] | None = None) -> None:
        import llguidance.hf

        self.vocab_size = vocab_size
        eos = list(eos_token_ids) if eos_token_ids else None
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=eos)
        self._llguidance = llguidance

    def json_schema(self, schema: dict | None) -> Grammar:
        """Output that is one JSON value valid under ``schema`` (None: any JSON object)."""
        schema = {"type": "object"} if schema is None else schema
        try:
            source = self._llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults={"whitespace_flexible": False}
            )
        except ValueError as error:
            raise GrammarError(f"the JSON schema could not be compiled: {error}") from None
        return self._checked(source)

    def lark(self, text: str) -> Grammar:
        """Output in the language of the Lark grammar ``text`` (llguidance's dialect, ``%json{...}`` included)."""
        return self._checked(self._llguidance.LLMatcher.grammar_from_lark(text))

    def matcher(self, source: str) -> Any:
        return self._llguidance.LLMatcher(self.tokenizer, source, log_level=0)

    def _checked(self, source: str) -> Grammar:
        error = self._llguidance.LLMatcher.validate_grammar(source, self.tokenizer)
        if error:
            raise GrammarError(error)
        return Grammar(self, source)


class GrammarState:
    """One row's matcher: it has consumed the row's output so far (and, within a round, the drafts it was
    :meth:`step`-ped through, until :meth:`rollback`)."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // BITS)

    def masks(self, drafts: list[int], positions: int) -> torch.Tensor:
        """``[positions, V]`` bool: the tokens allowed at each verified position after the row's ``drafts`` (see the
        module's worked example); the matcher ends where it began."""
        words = torch.full((positions, self.words), -1, dtype=torch.int32)  # [positions, W]: every token
        stepped = 0
        for j in range(positions):
            words[j] = self.allowed_words()
            if j == len(drafts) or not self.step(drafts[j], words[j]):
                break  # past a refused draft, or past the end (only EOS is allowed), nothing is reached
            stepped += 1
        self.rollback(stepped)
        return unpack(words, self.vocab_size)

    def allowed_words(self) -> torch.Tensor:
        """``[W]`` int32 bitmask of the tokens allowed next."""
        allowed = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)  # [W']
        words = torch.zeros(self.words, dtype=torch.int32)  # [W]
        words[: min(allowed.numel(), self.words)] = allowed[: self.words]
        return words

    def step(self, token: int, allowed: torch.Tensor) -> bool:
        """Consume the draft ``token`` if ``allowed`` (the :meth:`allowed_words` of this state) allows it and the
        grammar is not complete; whether it did."""
        if self.matcher.is_stopped() or not _allows(allowed, token):
            return False
        if not self.matcher.consume_token(token):
            raise GrammarError(f"the grammar refused an allowed token: {self.matcher.get_error()}")
        return True

    def rollback(self, steps: int) -> None:
        if steps and not self.matcher.rollback(steps):
            raise GrammarError(f"the grammar could not roll back {steps} drafts: {self.matcher.get_error()}")

    def advance(self, tokens: list[int]) -> None:
        """Consume the tokens the row gained (each was allowed where it was verified). Once the grammar is complete
        only EOS is allowed, and the row ends on it: that token is not fed to the finished matcher."""
        for token in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(token):
                raise GrammarError(f"the grammar refused a verified token: {self.matcher.get_error()}")


class DraftGuide:
    """The grammar rows of a round, walked along their drafts as the draft model makes them, so that it proposes only
    tokens their grammars allow (any other would be rejected); rolled back by :meth:`finish`. A row whose draft the
    grammar refuses (a lookup's, or filler past the row's length) is left unguided for the rest of the round.

    Example: a row whose grammar allows ``{"`` first: the draft's logits at position 0 keep only ``{"``; after it is
    drafted, :meth:`follow` steps the matcher, and position 1 keeps what may follow ``{"``."""

    def __init__(self, states: dict[int, GrammarState]) -> None:
        self.rows = dict(states)  # batch row → its grammar state
        self.states = states  # the rows still guided
        self.steps = dict.fromkeys(states, 0)
        self.allowed: dict[int, torch.Tensor] = {}  # batch row → [W] at the current position

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[B, V]`` with each guided row's refused tokens at ``-inf``."""
        self.allowed = {i: state.allowed_words() for i, state in self.states.items()}
        if not self.allowed:
            return logits
        index = torch.tensor(list(self.allowed), device=logits.device)  # [g]
        allowed = unpack(torch.stack(list(self.allowed.values())), logits.shape[-1]).to(logits.device)  # [g, V]
        return logits.index_copy(0, index, logits[index].masked_fill(~allowed, float("-inf")))

    def follow(self, tokens: list[int]) -> None:
        """Step every guided row's matcher past its draft ``tokens[i]`` at the position just decided."""
        for i, state in list(self.states.items()):
            allowed = self.allowed.get(i)
            if allowed is None:
                allowed = state.allowed_words()
            if state.step(tokens[i], allowed):
                self.steps[i] += 1
            else:
                del self.states[i]
        self.allowed = {}

    def finish(self) -> None:
        """Roll every matcher back to the row's output."""
        for i, steps in self.steps.items():
            self.rows[i].rollback(steps)


def _allows(words: torch.Tensor, token: int) -> bool:
    """Whether bitmask ``words`` ``[W]`` allows ``token`` (a consumed refused token would end the matcher in error)."""
    return token < words.numel() * BITS and bool((int(words[token // BITS]) >> (token % BITS)) & 1)


def unpack(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[..., V]`` bool from a ``[..., W]`` int32 bitmask (bit ``t % 32`` of word ``t // 32`` is token ``t``).

    Example: ``unpack(tensor([5]), 4)`` → ``[True, False, True, False]``.
    """
    bits = torch.arange(BITS, dtype=torch.int32)  # [32]
    flags = (words[..., None] >> bits) & 1  # [..., W, 32]
    return flags.reshape(*words.shape[:-1], -1)[..., :vocab_size].bool()
