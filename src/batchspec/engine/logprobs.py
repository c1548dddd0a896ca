"""Log-probabilities of the tokens a row gains, from the target's verification forward.

They are the target model's own: ``log_softmax`` of its logits in float64, before penalties, bias, grammar or
temperature (vLLM's default, "raw" logprobs), at the position that chose the token. With the int8 forward a row's
logits are the same bits whatever the batch, method or ``k``, and so are its logprobs (``log_softmax`` reduces each
row's vocabulary on its own).

They come back with the round's one read: :func:`scored` packs, per row, the chosen token's logprob and the top
``n`` ids and logprobs of every position into one int64 tensor (float64 bits), :func:`unpacked` reads them on the
host.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

MAX_TOP = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One output token: its id, its logprob and the ``top`` most probable ``(id, logprob)`` at its position
    (most probable first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def scored(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> torch.Tensor:
    """``[r, k+1, 1 + 2·top]`` int64: for each position, the logprob of ``tokens`` ``[r, k+1]`` under ``logits``
    ``[r, k+1, V]``, then ``top`` ids, then their logprobs (logprobs as float64 bits).

    Example (``top = 1``): a position whose chosen token has logprob -0.5 and whose best token, 7, has -0.1 holds
    ``[bits(-0.5), 7, bits(-0.1)]``.
    """
    logprobs = torch.log_softmax(logits.to(torch.float64), dim=-1)  # [r, k+1, V]
    chosen = logprobs.gather(-1, tokens[..., None])  # [r, k+1, 1]
    best = logprobs.topk(top, dim=-1)  # [r, k+1, top] each
    return torch.cat([chosen.view(torch.int64), best.indices, best.values.view(torch.int64)], dim=-1)


def unpacked(values: list[int], top: int, keep: int) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """The first ``keep`` positions of one row of :func:`scored` (flattened to ``values``): per position, the chosen
    token's logprob and the ``top`` ``(id, logprob)`` pairs."""
    width = 1 + 2 * top
    out = []
    for j in range(keep):
        cell = values[j * width : (j + 1) * width]
        ids, floats = cell[1 : 1 + top], [_float(v) for v in cell[1 + top :]]
        out.append((_float(cell[0]), tuple(zip(ids, floats, strict=True))))
    return out


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]
