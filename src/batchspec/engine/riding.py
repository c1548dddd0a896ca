"""Prompts read inside the round: a row whose prompt is still being read feeds its next prompt tokens as drafts
that the target accepts by fiat, in the verification forward of the rows that decode.

Read apart (:mod:`batchspec.engine.prefill`), a chunk of a new prompt is a forward of its own beside the round's:
the target's weights are read once more for a few columns. On the fused integer forward a round's verification is
ragged already (each row feeds its own columns: ``fed``), so a prompt's chunk can ride in it instead, at the price
of its columns' arithmetic alone: on SpecBench's served chats at 8 clients (the 1.5B target, int8, 2 vCPUs) a chunk
forward cost 36 ms + 2.9 ms a column, 54% of it the weights read again.

A riding row lays out what it has read and its pending token, ``prompt[:reading]`` (:attr:`Sequence.reading`), so to
the layout it is a row like the others (realign.py). It proposes nothing (:meth:`Ride.closed`); in the verification
it feeds its pending token and its next ``columns - 1`` prompt tokens, of which the output layer scores none. The
verdict is not asked: it keeps them all, as if ``columns - 1`` drafts were accepted, and its next prompt token
becomes its pending one (the bonus by fiat); it appends nothing to its output. Once its pending token is its
prompt's last it decodes like any other row, from the next round. Where no row decodes, a riding row reads the rest
of its prompt in one round (as a prompt read apart would be). Its KV is the same bits
as a read apart, since the fused forward's rows do not depend on the batch: ``tests/test_riding.py`` holds the
served tokens to the model's own greedy decoding.

Example: prompt ``[5, 9, 2, 7, 4]``, ``reading = 2`` (content ``[5, 9]``, 9 pending), 2 columns: the row feeds
``[9, 2]``, gains ``[2, 7]`` (2 kept by fiat, 7 its new pending token), and reads on to 4: ``[5, 9, 2, 7]``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from batchspec.engine.draft_length import Reach
from batchspec.engine.state import Sequence
from batchspec.engine.verifier import Verdict


@dataclass(frozen=True)
class Ride:
    """The prompt columns a round's riding rows feed.

    Attributes:
        columns: per row, the prompt tokens it reads this round (0: a row that decodes).
        tokens: per row, the tokens it gains: its next ``columns[i]`` prompt tokens (none for a decoding row).
        staged: :meth:`host_columns` on the device (the mask ``[B]``, the tokens ``[B, m]``, the columns ``[B]``),
            once the round's copy is made.
    """

    columns: list[int]
    tokens: list[list[int]]
    staged: tuple[torch.Tensor, ...] = ()

    @classmethod
    def of(cls, rows: list[Sequence], budget: int | None) -> Ride:
        """The round's ride: ``budget`` columns (None: all) over the rows that read their prompts, first come first
        served (by :attr:`Sequence.index`), each at least its pending token, none past its prompt's last token (that
        one it decodes from). A prompt read first is answered first; read side by side, every newcomer would wait for
        all of them.

        Example: riders of 30 and 5 prompt tokens left, in that order, a budget of 12: 11 and 1 columns; of 6 and 5
        left: 6 and 5 (their prompts' ends), of 4 and 3 left with no budget: 4 and 3."""
        columns = [0] * len(rows)
        riders = sorted((i for i, row in enumerate(rows) if row.reading is not None), key=lambda i: rows[i].index)
        spare = None if budget is None else max(budget - len(riders), 0)  # columns past each rider's pending one
        for i in riders:
            more = len(rows[i].prompt) - rows[i].reading - 1
            more = more if spare is None else min(more, spare)
            columns[i] = 1 + more
            spare = None if spare is None else spare - more
        tokens = [row.prompt[row.reading : row.reading + c] if c else [] for row, c in zip(rows, columns, strict=True)]
        return cls(columns, tokens)

    @property
    def riding(self) -> list[int]:
        """The rows that read their prompts this round."""
        return [i for i, c in enumerate(self.columns) if c]

    @property
    def extra(self) -> int:
        """The columns the riding rows add to a verification that feeds one column a row (their pending tokens)."""
        return sum(max(c - 1, 0) for c in self.columns)

    def closed(self, reach: Reach) -> Reach:
        """``reach`` with the riding rows proposing nothing: they have no text of their own to look up yet."""
        if not self.riding:
            return reach
        first = None if reach.first is None else [None if c else f for c, f in zip(self.columns, reach.first,
                                                                                      strict=True)]
        lookups = [0 if c else n for c, n in zip(self.columns, reach.lookups, strict=True)]
        return replace(reach, lookups=lookups, first=first, closed=frozenset(self.riding))

    def host_columns(self) -> tuple:
        """What the round's copy stages: which rows ride ``[B]``, the tokens they gain ``[B, m]`` (0 past a row's
        columns) and their columns ``[B]``. Nothing when no row rides."""
        if not self.riding:
            return ()
        width = max(self.columns)
        matrix = [row + [0] * (width - len(row)) for row in self.tokens]  # [B, m]
        return [int(c > 0) for c in self.columns], matrix, self.columns

    def staged_as(self, tensors: tuple[torch.Tensor, ...]) -> Ride:
        """This ride with its columns on the device."""
        return replace(self, staged=tuple(tensors))

    def inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        """The verification's inputs ``[B, 1+k]`` (each row's pending token and drafts) with each riding row's
        pending token and next ``columns - 1`` prompt tokens instead: ``[B, max(1+k, m)]``."""
        if not self.riding:
            return inputs
        mask, tokens, _ = self.staged  # [B], [B, m], [B]
        width = max(inputs.shape[1], tokens.shape[1])
        riding = torch.cat([inputs[:, :1], tokens[:, :-1]], dim=1)  # [B, m]: pending, then the prompt's next
        return torch.where(mask.bool()[:, None], _columns(riding, width), _columns(inputs, width))

    def fed(self, fed: torch.Tensor) -> torch.Tensor:
        """The inputs each row feeds ``[B]``: a riding row its columns, the others ``fed`` (pending and drafts)."""
        if not self.riding:
            return fed
        mask, _, columns = self.staged
        return torch.where(mask.bool(), columns, fed)

    def scored(self, fed: torch.Tensor) -> torch.Tensor | None:
        """The inputs whose logits each row needs ``[B]``: none of a riding row's (its verdict is by fiat), all that
        the others feed (``fed``). None where no row rides (every fed input is scored)."""
        if not self.riding:
            return None
        mask, _, _ = self.staged
        return torch.where(mask.bool(), torch.zeros_like(fed), fed)

    def decided(self, verdict: Verdict) -> Verdict:
        """``verdict`` with each riding row keeping its prompt tokens by fiat: ``columns - 1`` accepted and its next
        prompt token the last, its tokens as wide as the longest ride."""
        if not self.riding:
            return verdict
        mask, tokens, columns = self.staged  # [B], [B, m], [B]
        width = max(verdict.tokens.shape[1], tokens.shape[1])
        riding = mask.bool()
        return Verdict(accepted=torch.where(riding, columns - 1, verdict.accepted),
                       tokens=torch.where(riding[:, None], _columns(tokens, width), _columns(verdict.tokens, width)))


def _columns(tokens: torch.Tensor, width: int) -> torch.Tensor:
    """``tokens`` ``[B, m]`` as ``[B, width]``: cut, or padded with zeros."""
    if tokens.shape[1] >= width:
        return tokens[:, :width]
    return F.pad(tokens, (0, width - tokens.shape[1]))
