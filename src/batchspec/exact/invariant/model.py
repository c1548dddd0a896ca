"""Making a model batch-invariant: every linear layer, RMSNorm and the attention run on the kernels of
:mod:`batchspec.exact.invariant.kernels`, so each row's logits are the same bits whether it runs alone, one token at a
time, or padded among other rows with ``k + 1`` tokens a forward (the verification of speculative decoding).

Elementwise work (embeddings, rotary, SiLU, residual additions) is computed per element and needs nothing. The
kernels are Triton's: the mode runs where Triton does (CUDA; tests run them on the CPU in Triton's interpreter).

This module imports Triton only when a model is made batch-invariant.
"""

from __future__ import annotations

from typing import Any

import torch

from batchspec.exact.swap import RMSNormSwap, is_rms_norm, register_attention, swap_layers

NAME = "batchspec_invariant"
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")  # RMSNorm as ``weight * normalised.to(dtype)``


class InvariantLinear(torch.nn.Module):
    """A linear layer on :func:`~batchspec.exact.invariant.kernels.matmul` (its weight and bias kept as they were)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight  # [out, in]
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        from batchspec.exact.invariant.kernels import matmul

        return matmul(x, self.weight, self.bias)


class InvariantRMSNorm(RMSNormSwap):
    """An RMSNorm on :func:`~batchspec.exact.invariant.kernels.rms_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        from batchspec.exact.invariant.kernels import rms_norm

        return rms_norm(x, self.weight, self.eps)


def invariant_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """The attention kernel of :data:`NAME` (see :mod:`batchspec.exact.swap`): ``query`` ``[B, H, q, D]``,
    ``key``/``value`` ``[B, Hk, L, D]``, ``visible`` boolean ``[B, 1, q, L]``; returns ``[B, q, H, D]``. Scores are
    not soft-capped here: a ``softcap`` is refused."""
    from batchspec.exact.invariant.kernels import attention

    if softcap is not None:
        raise ValueError(f"the batch-invariant attention does not soft-cap scores (softcap={softcap})")

    return attention(query, key.contiguous(), value.contiguous(), visible, scaling)


def check_batch_invariant(model: Any) -> None:
    """Raise ValueError unless :func:`make_batch_invariant` can make ``model`` batch-invariant."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in ARCHITECTURES:
        raise ValueError(
            f"the batch-invariant mode supports {', '.join(ARCHITECTURES)} models; got model_type {kind!r}"
        )


def make_batch_invariant(model: Any) -> Any:
    """Swap ``model``'s linear layers, RMSNorms and attention for the batch-invariant kernels, in place; returns it."""
    check_batch_invariant(model)
    register_attention(NAME, invariant_attention)
    swap_layers(model, _replacement)
    model.config._attn_implementation = NAME
    return model


def _replacement(name: str, child: torch.nn.Module) -> torch.nn.Module | None:
    if isinstance(child, torch.nn.Linear):
        return InvariantLinear(child)
    if is_rms_norm(child):
        return InvariantRMSNorm(child)
    return None


def batch_invariant(model: Any) -> bool:
    """Whether :func:`make_batch_invariant` made ``model``."""
    return any(isinstance(m, InvariantLinear) for m in model.modules())
