"""Text between two tokenizers: what lets a draft of another tokenizer than its target's draft for it (universal
assisted generation, the idea of transformers' ``AssistedCandidateGeneratorDifferentTokenizers``).

The draft reads each row's text in its own tokens and drafts in them; its drafts reach the target as text, encoded
in the target's tokens, and the target verifies them over its whole vocabulary like any other proposal: the output is
the target's own whatever the draft's tokens were, so nothing here bears on exactness, only on how much is accepted.

A row's text grows at its end a few target tokens a round, and its last word may still change. Re-encoding the whole
text every round would cost the draft tokenizer a pass over the prompt (thousands of tokens) each round, so a row keeps
a **commit point**: a prefix of its target tokens and a prefix of the draft's tokens whose texts are the same string,
behind which neither changes again. Each round only the text after it (a few words) is encoded again, and the draft's
KV cache keeps the columns its tokens still agree on (:meth:`DraftText.sync`). The commit point moves up to
:data:`HOLD` target tokens behind the end, to a place where a target token and a draft token end at one character:
the draft's tokens before it are then those of the text in two pieces, which can differ from those of the whole only
in the tokens that meet at the seam (the draft sees a slightly unusual tokenization there; it still reads the text).

Example: the target's tokens ``["def", " add", "(a"]`` and the draft's of the same text ``["def", " ad", "d(", "a"]``
end together after ``"def"`` (3 characters) and after ``"(a"``, not after ``" add"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchspec.engine.kv_cache import BatchKVCache

BRIDGE_ATTRIBUTE = "batchspec_text_bridge"  # where a draft of another tokenizer carries its bridge (:func:`bridged`)
HOLD = 8  # target tokens a row's commit point stays behind its end: the words that may still be encoded anew
CONTEXT = 4  # tokens decoded before a text's start, so that the first one decodes as it does mid-text


@dataclass(frozen=True)
class TextBridge:
    """The target's and the draft's tokenizers (Hugging Face fast tokenizers: the draft's must give offsets).

    Attributes:
        target, draft: the two tokenizers.
        head: the ids the draft's text starts with: its BOS where its tokenizer puts one before a text.
        skipped: target ids left out of the text handed over (the target's BOS: the draft has its own ``head``).
    """

    target: Any
    draft: Any
    head: tuple[int, ...]
    skipped: frozenset[int]

    @classmethod
    def of(cls, target: Any, draft: Any) -> TextBridge:
        """The bridge between ``target`` and ``draft`` (ValueError where the draft's tokenizer gives no offsets)."""
        if not getattr(draft, "is_fast", False):
            raise ValueError("a draft of another tokenizer needs a fast (Rust) tokenizer: its offsets place the seams")
        bos = draft.bos_token_id
        head = (bos,) if bos is not None and draft("a", add_special_tokens=True).input_ids[:1] == [bos] else ()
        skipped = frozenset(() if target.bos_token_id is None else (target.bos_token_id,))
        return cls(target, draft, head, skipped)

    def target_text(self, ids: list[int], start: int, end: int | None = None) -> str:
        """The text of the target's ``ids[start:end]``, decoded as it reads after ``ids[:start]``."""
        kept = [t for t in ids[:end] if t not in self.skipped]
        return _decoded(self.target, kept, start - sum(t in self.skipped for t in ids[:start]))

    def draft_text(self, ids: list[int], start: int) -> str:
        """The text of the draft's ``ids[start:]``, decoded as it reads after ``ids[:start]``."""
        return _decoded(self.draft, ids, start)

    def to_draft(self, text: str) -> tuple[list[int], dict[int, int]]:
        """``text`` in the draft's tokens, and where they end: ``{character: tokens that end at or before it}`` for
        every character offset a token ends at."""
        encoded = self.draft(text, add_special_tokens=False, return_offsets_mapping=True)
        ends = {end: i + 1 for i, (_, end) in enumerate(encoded["offset_mapping"])}
        return list(encoded["input_ids"]), ends

    def to_target(self, text: str) -> list[int]:
        """``text`` in the target's tokens."""
        return list(self.target(text, add_special_tokens=False).input_ids)


def bridged(draft: Any, bridge: TextBridge) -> Any:
    """``draft`` marked as a draft of another tokenizer: the engine then drafts with it through ``bridge``."""
    setattr(draft, BRIDGE_ATTRIBUTE, bridge)
    return draft


def bridge_of(draft: Any) -> TextBridge | None:
    """The bridge of a draft of another tokenizer (:func:`bridged`), None for a draft of the target's own."""
    return getattr(draft, BRIDGE_ATTRIBUTE, None)


def _decoded(tokenizer: Any, ids: list[int], start: int) -> str:
    """The text of ``ids[start:]`` as it reads after the :data:`CONTEXT` tokens before it (a tokenizer that drops a
    text's leading space decodes a token apart otherwise than within a text)."""
    context = max(0, start - CONTEXT)
    options = dict(skip_special_tokens=False, clean_up_tokenization_spaces=False)
    before = tokenizer.decode(ids[context:start], **options)
    whole = tokenizer.decode(ids[context:], **options)
    return whole[len(before) :] if whole.startswith(before) else tokenizer.decode(ids[start:], **options)


@dataclass(frozen=True)
class Window:
    """The end of a row's target tokens: ``tokens`` are its tokens from ``offset`` on (a row's text is read from a
    little before its commit point only, not copied whole every round)."""

    tokens: list[int]
    offset: int

    @property
    def end(self) -> int:
        """The row's target tokens in all."""
        return self.offset + len(self.tokens)

    @classmethod
    def of(cls, prompt: list[int], output: list[int], start: int) -> Window:
        """``prompt + output`` from ``start - CONTEXT`` on (the tokens a text from ``start`` is decoded after)."""
        offset = max(0, start - CONTEXT)
        if offset >= len(prompt):
            return cls(output[offset - len(prompt) :], offset)
        return cls(prompt[offset:] + output, offset)


@dataclass
class DraftText:
    """One row's text in the draft's tokens, and the draft's KV cache of it.

    Attributes:
        ids: the draft's tokens of the row's text as last synced (:meth:`sync`), then what it drafted after them.
        cached: the tokens whose KV ``cache`` holds, in order (a prefix of some earlier ``ids``).
        cache: the draft's KV cache of this row (one row).
        commit: ``(target tokens, draft tokens)``: prefixes of the row's target tokens and of ``ids`` with one text.
        synced: the row's target tokens when it last synced: those whose text the draft has read or will read first.
    """

    ids: list[int]
    cache: BatchKVCache
    cached: list[int] = field(default_factory=list)
    commit: tuple[int, int] = (0, 0)
    synced: int = 0

    @classmethod
    def start(cls, bridge: TextBridge, cache: BatchKVCache) -> DraftText:
        return cls(ids=list(bridge.head), cache=cache, commit=(0, len(bridge.head)))

    def sync(self, bridge: TextBridge, text: Window, extra: list[int]) -> list[int]:
        """The draft's tokens of the row's target tokens (``text``) followed by ``extra`` (lookup drafts, which the
        commit point never passes); the commit point moves up behind ``text``'s end, and the cache forgets the
        columns past what its tokens share with these. Returns the tokens the draft must read next (at least one)."""
        at, held = self.commit
        tail = bridge.target_text(text.tokens + extra, at - text.offset)
        encoded, ends = bridge.to_draft(tail)
        self.ids = self.ids[:held] + encoded
        self._advance(bridge, text, tail, ends)
        keep = min(_common(self.cached, self.ids), len(self.ids) - 1)
        self.cache.crop(keep)
        self.cached = self.cached[:keep]
        self.synced = text.end
        return self.ids[keep:]

    def _advance(self, bridge: TextBridge, text: Window, tail: str, ends: dict[int, int]) -> None:
        """Move the commit point up to :data:`HOLD` target tokens behind ``text``'s end, to the latest target token
        that ends where a draft token of ``tail`` (the text after the commit point) ends, and whose text the draft's
        tokens before it decode to (a tokenizer may trim spaces off a token's offsets)."""
        at, held = self.commit
        for end in range(text.end - HOLD, max(at, text.end - 2 * HOLD), -1):
            piece = bridge.target_text(text.tokens, at - text.offset, end - text.offset)
            if not piece or len(piece) not in ends or not tail.startswith(piece):
                continue
            tokens = held + ends[len(piece)]
            if bridge.draft_text(self.ids[:tokens], held) == piece:
                self.commit = (end, tokens)
                return

    def fed(self, tokens: list[int]) -> None:
        """The draft read ``tokens`` after :attr:`cached` (its cache holds their KV now)."""
        self.cached = self.cached + tokens

    def continuation(self, bridge: TextBridge, drafted: list[int]) -> str:
        """The text ``drafted`` (the draft's tokens after :attr:`ids`) adds to the row's; "" where it does not
        extend it as a string (a character split across tokens), and without a last character left incomplete."""
        held = self.commit[1]
        before = bridge.draft_text(self.ids, held)
        after = bridge.draft_text(self.ids + drafted, held)
        if not after.startswith(before):
            return ""
        return after[len(before) :].rstrip("\ufffd")


def _common(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
