"""Per-row and per-batch state, with the synchronisation invariants made checkable.

Layout: a batch is a left-padded, right-aligned token matrix ``tokens`` of shape ``[B, L]``. Row ``i`` has
``pad[i]`` padding columns followed by ``content[i]`` real tokens (its prompt, then what it generated).

- (I1) rectangular alignment: ``pad[i] + content[i] == L`` for every row.
- (I2) position ids: ``pos[i, j] = max(0, #real tokens in columns 0..j of row i - 1) = max(0, j - pad[i])``.

Padding is known only from ``pad``; the value written into padding columns (``pad_token_id``) is a filler
and is never compared against, so prompts may contain the pad or EOS id as real tokens.

The last real token of every row sits in column ``L - 1``. It is *pending*: the target KV cache holds
columns ``0 .. L-2`` (``target_len == L - 1``) and the pending token is the first input of the next
verification. The draft cache may lag further (``draft_len <= L - 1``); the draft re-reads the columns it
lacks from ``tokens`` at the start of its next proposal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FINISH_EOS = "eos"
FINISH_LENGTH = "length"


@dataclass
class Sequence:
    """One prompt's life: its tokens, its budget, and why it stopped."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def content_len(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, tokens: list[int], eos_token_ids: frozenset[int]) -> int:
        """Append accepted tokens, stopping after the first EOS or at the budget.

        Returns how many of ``tokens`` were kept; the rest (past EOS or budget) are dropped.
        """
        kept = tokens[: self.remaining]
        for j, token in enumerate(kept):
            if token in eos_token_ids:
                kept = kept[: j + 1]
                self.finish_reason = FINISH_EOS
                break
        self.output.extend(kept)
        if self.finish_reason is None and self.remaining == 0:
            self.finish_reason = FINISH_LENGTH
        return len(kept)


@dataclass
class BatchState:
    """The rows decoded together and their padded token matrix.

    Attributes:
        rows: the sequences, in batch order.
        tokens: ``[B, L]`` left-padded token ids; row ``i``'s real tokens are ``tokens[i, pad[i]:]``.
        pad: ``[B]`` padding length of each row.
        content: ``[B]`` number of real tokens of each row.
        target_len: columns held by the target KV cache (``L - 1`` between rounds).
        draft_len: columns held by the draft KV cache (``<= L - 1``; 0 when there is no draft).
    """

    rows: list[Sequence]
    tokens: torch.Tensor  # [B, L]
    pad: torch.Tensor  # [B]
    content: torch.Tensor  # [B]
    target_len: int = 0
    draft_len: int = 0

    @classmethod
    def from_sequences(cls, rows: list[Sequence], *, pad_token_id: int, device: torch.device) -> BatchState:
        """Left-pad the rows' prompts into a fresh batch with empty caches."""
        content = torch.tensor([row.content_len for row in rows], dtype=torch.long)
        width = int(content.max())
        tokens = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, width - row.content_len :] = torch.tensor(row.prompt + row.output, dtype=torch.long)
        return cls(rows=rows, tokens=tokens.to(device), pad=(width - content).to(device), content=content.to(device))

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def attention_mask(self, width: int) -> torch.Tensor:
        """``[B, width]`` mask over columns ``0 .. width-1``: real tokens and any drafted columns are 1."""
        cols = torch.arange(width, device=self.device)
        return (cols[None, :] >= self.pad[:, None]).long()

    def position_ids(self, start: int, end: int) -> torch.Tensor:
        """``[B, end - start]`` position ids of columns ``start .. end-1`` by invariant I2."""
        cols = torch.arange(start, end, device=self.device)
        return (cols[None, :] - self.pad[:, None]).clamp(min=0)

    def check(self, *, target_cache_len: int | None = None, draft_cache_len: int | None = None) -> None:
        """Raise ``AssertionError`` unless I1, I2, the token stream and the cache lengths are consistent."""
        width = self.width
        assert self.tokens.shape == (self.size, width), "tokens shape does not match the rows"
        assert bool((self.pad >= 0).all()), f"negative padding: {self.pad.tolist()}"
        assert bool((self.pad + self.content == width).all()), (
            f"I1 broken: pad {self.pad.tolist()} + content {self.content.tolist()} != {width}"
        )
        mask = self.attention_mask(width)
        from_mask = (mask.cumsum(dim=1) - 1).clamp(min=0)
        assert torch.equal(self.position_ids(0, width), from_mask), "I2 broken: position ids != mask cumsum - 1"
        for i, row in enumerate(self.rows):
            assert int(self.content[i]) == row.content_len, f"row {row.index}: content length out of sync"
            real = self.tokens[i, int(self.pad[i]) :].tolist()
            assert real == row.prompt + row.output, f"row {row.index}: token stream out of sync"
        assert self.target_len == width - 1, f"target cache covers {self.target_len} columns, expected {width - 1}"
        assert 0 <= self.draft_len <= width - 1, f"draft cache covers {self.draft_len} of {width - 1} columns"
        if target_cache_len is not None:
            assert target_cache_len == self.target_len, f"target KV holds {target_cache_len} != {self.target_len}"
        if draft_cache_len is not None:
            assert draft_cache_len == self.draft_len, f"draft KV holds {draft_cache_len} != {self.draft_len}"
