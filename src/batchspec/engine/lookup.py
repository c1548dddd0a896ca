"""Prompt lookup: drafts copied from earlier in a row's own text (prompt and output), with no draft model.

The draft for the next position is found by the row's longest suffix n-gram (``n_max`` down to ``n_min`` tokens)
that occurred before: the token that followed its earliest occurrence. Each further draft is looked up
again with the drafts so far appended, so that the draft at an output position depends only on the text before
it (within a repeated span this continues the copy). That makes a lookup the same function of the prefix whether
a position is drafted early or late in a round, which keeps a seeded sample independent of the draft length and
the batch (see :mod:`batchspec.engine.verifier`).

Example (``n_max = 3``): the text ``a b c d x a b c`` ends in ``a b c``, which occurred at positions 0–2, followed
by ``d``: the draft is ``d``; with it appended the text ends in ``b c d``, followed earlier by ``x``: the next draft
is ``x``; then ``c d x`` → ``a``, and so on. In ``a b x a b y a b`` the suffix ``a b`` occurred twice: the draft is
``x``, from the earliest.

Why the earliest: what a row repeats is mostly its prompt (an answer restating a signature and docstring, a summary
quoting its article), and the earliest occurrence of an n-gram is where that source text is; a later occurrence is
more often a short phrase the output happened to share, which breaks the copy. On the first 8 HumanEval answers
of ``qwen2.5-coder`` (replayed on the reference outputs, up to 10 drafts a round) the earliest occurrence with
``n_max = 5`` needs 62 rounds for 512 tokens, the most recent occurrence with ``n_max = 3`` 80.

:class:`NgramIndex` keeps, per row, the first end of every n-gram whose next token is known, updated as the row's
text grows (``O(n_max)`` per token, indexing only the tokens it gained), so a lookup is a few dictionary reads
whatever the context length.
:func:`lookup_on_device` is the same lookup as tensor code over a batch's token matrix, for drafts the host has not
read (the hybrid proposer's lookups after a model-drafted token): it scans every row, ``O(n_max * width)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class NgramIndex:
    """The n-grams of one row's text (``n_min .. n_max`` tokens) and where each last ended with a known successor.

    Attributes:
        tokens: the text indexed so far (the row's prompt, then its output).
        ends: n-gram → index of its last token in its earliest occurrence that has a next token.
    """

    n_min: int
    n_max: int
    tokens: list[int] = field(default_factory=list)
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    _last: tuple[int, int, list[int]] | None = field(default=None, repr=False)  # text length, limit, its chain

    def extend(self, new: list[int]) -> None:
        """Index ``new``, the tokens the row's text gained since it was last indexed (the whole text the first time):
        every n-gram that ends where the next token is now known."""
        first = max(len(self.tokens) - 1, 0)  # the end whose next token ``new`` makes known
        self.tokens.extend(new)
        for end in range(first, len(self.tokens) - 1):
            _record(self.ends, tuple(self.tokens[max(end + 1 - self.n_max, 0) : end + 1]), end, self.n_min)

    def chain(self, limit: int) -> list[int]:
        """Up to ``limit`` drafts, each looked up with the ones before it appended (see the module docstring). A round
        asks for a row's chain twice (its reach, then its plan, for as many or fewer): the last chain of this text
        is kept, and a shorter one is its start."""
        last = self._last
        if last is not None and last[0] == len(self.tokens) and (limit <= last[1] or len(last[2]) < last[1]):
            return last[2][:limit]
        drafts: list[int] = []
        recent: dict[tuple[int, ...], int] = {}  # n-grams that end inside the drafts
        tail = tuple(self.tokens[-self.n_max :])  # the last n_max tokens of the text and the drafts so far
        while len(drafts) < limit and (token := self._next(tail, drafts, recent)) is not None:
            _record(recent, tail, len(self.tokens) + len(drafts) - 1, self.n_min)
            drafts.append(token)
            tail = (*tail, token)[-self.n_max :]
        self._last = (len(self.tokens), limit, drafts)
        return drafts[:]

    def _next(self, tail: tuple[int, ...], drafts: list[int], recent: dict[tuple[int, ...], int]) -> int | None:
        """The lookup draft for the position after the text and ``drafts`` (whose last tokens are ``tail``), or None
        when no suffix of ``n_min .. n_max`` tokens occurred before.

        Suffixes are read shortest first, and the reading stops at the first that never occurred: every longer one
        ends in it, so none of them occurred either. Text that is not being copied (prose, where drafts are rejected)
        matches a token or two, and its lookup then reads two or three n-grams, not ``n_max``."""
        end = None
        for n in range(self.n_min, min(self.n_max, len(self.tokens) + len(drafts) - 1) + 1):
            suffix = tail[len(tail) - n :]
            found = self.ends.get(suffix)
            if found is None:
                found = recent.get(suffix)
            if found is None:
                break
            end = found
        if end is None:
            return None
        after = end + 1 - len(self.tokens)
        return self.tokens[end + 1] if after < 0 else drafts[after]


def _record(ends: dict[tuple[int, ...], int], tail: tuple[int, ...], end: int, n_min: int) -> None:
    """Note every n-gram ending at index ``end`` of the text (whose next token is known, or about to be; ``tail``: the
    text's tokens up to ``end``, ``n_max`` of them or fewer), unless it occurred before: an n-gram keeps its earliest
    end."""
    for n in range(n_min, len(tail) + 1):
        ends.setdefault(tail[len(tail) - n :], end)


def lookup_on_device(
    text: torch.Tensor, start: torch.Tensor, n_min: int | torch.Tensor, n_max: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lookup of :meth:`NgramIndex.chain` (its first draft) for every row at once, on the device (no read back).

    ``text`` ``[B, T]`` holds row ``i``'s text in columns ``start[i] .. T-1`` (``start`` ``[B]``: its left padding);
    returns the draft for position ``T`` ``[B]`` and whether a suffix of ``n_min .. n_max`` tokens occurred before
    ``[B]`` (bool; where it did not, the draft is filler; ``n_min`` may be ``[B]``, each row's own). As on the host:
    the longest such suffix, at its earliest occurrence with a next token.

    Worked example, one row ``a b x a b y a b`` (``start = 0``, ``n_max = 3``): a candidate end ``e`` (0 .. 6, each
    has a next token) matches the suffix for ``run[e]`` tokens back: ``run = [0, 2, 0, 0, 2, 0, 0]`` (``e = 1``:
    ``a b`` = ``a b``; ``e = 4``: ``x a b`` ≠ ``y a b``, two tokens). The longest is 2, first at ``e = 1``: the draft
    is ``text[2] = x``.
    """
    size, width = text.shape
    ends = torch.arange(width - 1, device=text.device)  # [T-1]: candidate ends; each has a next token
    matching = torch.ones((size, width - 1), dtype=torch.bool, device=text.device)  # [B, T-1]
    run = torch.zeros((size, width - 1), dtype=torch.long, device=text.device)  # [B, T-1]
    for back in range(min(n_max, width - 1)):  # a match ends before the last column: at most width - 1 long
        columns = ends - back  # [T-1]
        inside = columns[None, :] >= start[:, None]  # [B, T-1]: the token is the row's own
        same = text[:, columns.clamp(min=0)] == text[:, width - 1 - back, None]  # [B, T-1]
        matching &= inside & same
        run += matching
    longest = run.amax(dim=1)  # [B]
    earliest = (run >= longest[:, None]).int().argmax(dim=1)  # [B]: the first end of a longest match
    draft = text.gather(1, (earliest + 1)[:, None])[:, 0]  # [B]
    return draft, longest >= n_min
