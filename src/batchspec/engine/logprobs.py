"""Log-probabilities of the tokens a row gains, from the target's verification forward.

They are the target model's own: the log-softmax of its logits in float64, before penalties, bias, grammar or
temperature (vLLM's default, "raw" logprobs), at the position that chose the token. With the int8 forward a row's
logits are the same bits whatever the batch, method or ``k``, and so are its logprobs (the log-softmax reduces each
row's vocabulary on its own).

On the CPU they are also the same bits on every instruction set torch dispatches to (AVX-512, AVX2, its scalar
``default``) and every thread count, where torch's ``log_softmax`` is not: a token's logprob is
``(x - max) - log(total)`` with ``total`` the sum of ``exp(x - max)`` over the vocabulary, added left to right
(:func:`~batchspec.engine.exactmath.exp_sum`), and :func:`~batchspec.engine.exactmath.log`, both built from
correctly rounded operations (``tests/test_sampling.py`` computes them in processes under each dispatch and thread
count and compares their hashes).

They come back with the round's one read: :func:`scored` packs, per row, the chosen token's logprob and the top
``n`` ids and logprobs of every position into one int64 tensor (float64 bits), :func:`unpacked` reads them on the
host.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from batchspec.engine.exactmath import exp_sum, log

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

    The logprob of a token with logit ``x`` is ``(x - max) - log(total)`` (the module's docstring), computed for the
    chosen and the top tokens alone; the top ids are those of the largest logits (a logprob never falls as its logit
    rises, so they are the largest logprobs too; torch's ``topk`` orders ties among the logits).
    """
    largest = logits.amax(dim=-1, keepdim=True).to(torch.float64)  # [r, k+1, 1]
    log_total = log(exp_sum(logits, largest))  # [r, k+1, 1]; the total is at least 1 (the maximum's term)

    def logprob(values: torch.Tensor) -> torch.Tensor:  # [r, k+1, n] logits -> their float64 logprobs
        return (values.to(torch.float64) - largest) - log_total

    chosen = logprob(logits.gather(-1, tokens[..., None]))  # [r, k+1, 1]
    best = logits.topk(top, dim=-1)  # [r, k+1, top] each
    return torch.cat([chosen.view(torch.int64), best.indices, logprob(best.values).view(torch.int64)], dim=-1)


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
