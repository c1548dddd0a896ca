"""Unpad → append → repad as index arithmetic: where every row's columns move after a round.

After verification row ``i`` gains ``n[i]`` tokens (its accepted drafts plus the bonus token), so the batch
is ragged. The new width is ``L' = max_i(content[i] + n[i])`` over the rows that stay, and each row moves
right by ``delta[i] = (L' - L) - n[i]`` columns (left when negative), which restores I1 with
``pad'[i] = pad[i] + delta[i]``. One shift vector serves the token matrix, the target KV cache and the
draft KV cache, because all three hold row ``i``'s columns at the same offsets.

Worked example, ``k = 2`` and ``L = 5`` (``_`` is padding; ``x y`` drafts, ``z``/``w`` bonus tokens)::

    row 0  pad 2  [_ _ a b c] + [x y z]  accepts both drafts: n = 3
    row 1  pad 0  [d e f g h] + [w]      rejects the first draft: n = 1
    L' = max(3 + 3, 5 + 1) = 6
    delta[0] = (6 - 5) - 3 = -2   →  [a b c x y z]   pad' = 0
    delta[1] = (6 - 5) - 1 =  0   →  [d e f g h w]   pad' = 0

New column ``j`` of a kept row reads old column ``j - delta[i]`` (``source_columns``); columns that map
before the old start are padding and may hold anything, since the attention mask hides them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RealignPlan:
    """Where the kept rows go. Shapes use ``B'`` for the number of kept rows.

    Attributes:
        rows: ``[B']`` indices of the kept rows in the old batch, in order.
        shift: ``[B']`` column offset ``delta`` of each kept row (new column = old column + delta).
        pad: ``[B']`` new padding lengths.
        content: ``[B']`` new content lengths.
        width: new padded width ``L'``.
        draft_len: draft KV columns still valid in every kept row after the move.
        identity: every row kept and every shift zero: caches only need cropping.
    """

    rows: torch.Tensor
    shift: torch.Tensor
    pad: torch.Tensor
    content: torch.Tensor
    width: int
    draft_len: int
    identity: bool

    @property
    def size(self) -> int:
        return int(self.rows.numel())

    def source_columns(self, num_columns: int) -> torch.Tensor:
        """``[B', num_columns]`` old column read by each new column ``0 .. num_columns-1`` of each kept row."""
        cols = torch.arange(num_columns, device=self.shift.device)
        return (cols[None, :] - self.shift[:, None]).clamp(min=0)


def plan_realign(
    pad: torch.Tensor,  # [B]
    content: torch.Tensor,  # [B]
    gained: torch.Tensor,  # [B] tokens appended to each row this round (n_i >= 1 for kept rows)
    keep: torch.Tensor,  # [B] bool, False for rows that leave the batch
    draft_valid: torch.Tensor,  # [B] draft KV columns valid for each row, in the old layout
) -> RealignPlan:
    """Compute the unpad–append–repad move for the rows in ``keep``."""
    width = int((pad + content)[0]) if pad.numel() else 0
    rows = keep.nonzero().flatten()
    new_content = (content + gained)[rows]
    if rows.numel() == 0:
        empty = rows.new_zeros(0)
        return RealignPlan(rows, empty, empty, empty, width=0, draft_len=0, identity=False)
    new_width = int(new_content.max())
    shift = (new_width - width) - gained[rows]
    draft_len = int((draft_valid[rows] + shift).min().clamp(0, new_width - 1))
    identity = rows.numel() == pad.numel() and not bool(shift.any())
    return RealignPlan(
        rows=rows,
        shift=shift,
        pad=new_width - new_content,
        content=new_content,
        width=new_width,
        draft_len=draft_len,
        identity=identity,
    )
