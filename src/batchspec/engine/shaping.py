"""Per-row changes to the target's next-token distribution: repetition, frequency and presence penalties, a logit
bias, and a grammar's allowed tokens. They are part of the distribution a request asks for, so verification
applies them to the target's logits at every verified position, each with the history that position has in plain
decoding (the row's output so far, then the drafts before it); speculation stays lossless against the shaped
distribution, and greedy output is the shaped greedy output, token for token.

Order, as in vLLM: the repetition penalty (a seen token's logit is divided by ``r`` if positive, multiplied by it
otherwise; "seen" is in the prompt or the output), then ``frequency × count`` and ``presence × (count > 0)`` are
subtracted (counts over the output only), then the bias is added, then the grammar's refused tokens are set to
``-inf``. Every operation is elementwise in a row, so a row's shaped logits do not depend on the batch. What a row
asks for is its :class:`~batchspec.engine.penalties.Penalties` and its grammar; this module applies them.

Terms: ``k`` drafts per row, verified position ``j = 0 .. k`` (it scores the ``j+1``-th new token, after the drafts
``d_1 .. d_j``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from batchspec.engine.state import Sequence


def shaped_rows(rows: list[Sequence]) -> list[int]:
    """The rows (indices in the round) whose distribution is shaped: penalties, a bias or a grammar."""
    return [i for i, row in enumerate(rows) if not row.penalties.neutral or row.grammar is not None]


def shape(logits: torch.Tensor, rows: list[Sequence], drafts: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """``[r, k+1, V]`` shaped logits of ``rows`` from their target ``logits`` ``[r, k+1, V]``, with the rows'
    ``drafts`` ``[r, k]`` (row ``i`` proposed its first ``lengths[i]``)."""
    vocab = logits.shape[-1]
    shaped = logits
    if not all(row.penalties.neutral for row in rows):
        shaped = _penalised(logits, rows, *_histories(rows, drafts, vocab))
    if any(row.grammar is not None for row in rows):
        host_drafts = drafts.tolist()
        allowed = torch.stack([
            _allowed(row, draft[:n], logits.shape[1], vocab) for row, draft, n in zip(rows, host_drafts, lengths,
                                                                                       strict=True)
        ]).to(logits.device)  # [r, k+1, V]
        shaped = shaped.masked_fill(~allowed, -math.inf)
    return shaped


def _allowed(row: Sequence, drafts: list[int], positions: int, vocab: int) -> torch.Tensor:
    if row.grammar is None:
        return torch.ones(positions, vocab, dtype=torch.bool)
    return row.grammar_state().masks(drafts, positions)


def _histories(rows: list[Sequence], drafts: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[r, k+1, V]`` per verified position: how often each token is in the output (the drafts before the position
    included), and whether it is in the prompt or that output."""
    device = drafts.device
    positions = drafts.shape[1] + 1
    output = _counts([row.output for row in rows], vocab).to(device)  # [r, V]
    prompt = _counts([row.prompt for row in rows], vocab).to(device) > 0  # [r, V]
    step = torch.zeros(len(rows), positions, vocab, dtype=output.dtype, device=device)  # [r, k+1, V]
    step[:, 1:].scatter_add_(-1, drafts[..., None], torch.ones_like(drafts[..., None], dtype=output.dtype))
    counts = output[:, None, :] + step.cumsum(dim=1)  # [r, k+1, V]
    return counts, (counts > 0) | prompt[:, None, :]


def _counts(tokens: list[list[int]], vocab: int) -> torch.Tensor:
    """``[r, V]`` float32 occurrences of each token id in each row's ``tokens``, by one count over ``row · V + id``.

    Example: ``_counts([[1, 1], [0]], 2)`` → ``[[0, 2], [1, 0]]``.
    """
    flat = torch.tensor([i * vocab + t for i, row in enumerate(tokens) for t in row], dtype=torch.long)
    return torch.bincount(flat, minlength=len(tokens) * vocab).view(len(tokens), vocab).float()


def _penalised(logits: torch.Tensor, rows: list[Sequence], counts: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[r, k+1, V]`` with each row's repetition, frequency and presence penalties and bias."""
    penalties = [row.penalties for row in rows]
    settings = torch.tensor([[p.repetition, p.frequency, p.presence] for p in penalties], dtype=logits.dtype)
    repetition, frequency, presence = settings.to(logits.device).T[..., None, None]  # [r, 1, 1] each
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)  # [r, k+1, V]
    shaped = torch.where(seen, repeated, logits)
    shaped = shaped - frequency * counts.to(logits.dtype)
    shaped = shaped - presence * (counts > 0).to(logits.dtype)
    biased = [(i, token, value) for i, p in enumerate(penalties) for token, value in p.logit_bias
              if token < logits.shape[-1]]
    bias = torch.zeros(len(rows), logits.shape[-1], dtype=logits.dtype)  # [r, V]
    if biased:
        row, token, value = zip(*biased, strict=True)
        bias.index_put_((torch.tensor(row), torch.tensor(token)), torch.tensor(value, dtype=logits.dtype),
                        accumulate=True)
    return shaped + bias.to(logits.device)[:, None, :]
