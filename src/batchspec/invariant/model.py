"""Making a model batch-invariant: every linear layer, RMSNorm and the attention run on the kernels of
:mod:`batchspec.invariant.kernels`, so each row's logits are the same bits whether it runs alone, one token at a time,
or padded among other rows with ``k + 1`` tokens a forward (the verification of speculative decoding).

Elementwise work (embeddings, rotary, SiLU, residual additions) is computed per element and needs nothing. The
kernels are Triton's: the mode runs where Triton does (CUDA; tests run them on the CPU in Triton's interpreter).

This module imports Triton only when a model is made batch-invariant.
"""

from __future__ import annotations

from typing import Any

import torch

from batchspec.int8.attention import mask_function, visible_or_causal

NAME = "batchspec_invariant"
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")  # RMSNorm as ``weight * normalised.to(dtype)``


class InvariantLinear(torch.nn.Module):
    """A linear layer on :func:`~batchspec.invariant.kernels.matmul` (its weight and bias kept as they were)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight  # [out, in]
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        from batchspec.invariant.kernels import matmul

        return matmul(x, self.weight, self.bias)


class InvariantRMSNorm(torch.nn.Module):
    """An RMSNorm on :func:`~batchspec.invariant.kernels.rms_norm`."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        from batchspec.invariant.kernels import rms_norm

        return rms_norm(x, self.weight, self.eps)


def invariant_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls for :data:`NAME`: ``query`` ``[B, H, q, D]``, ``key``/``value``
    ``[B, Hk, L, D]``, ``attention_mask`` boolean ``[B, 1, q, L]`` (None: causal, the queries last); returns
    ``[B, q, H, D]``."""
    from batchspec.invariant.kernels import attention

    visible = visible_or_causal(attention_mask, query.shape[0], query.shape[2], key.shape[2], query.device)
    return attention(query, key.contiguous(), value.contiguous(), visible, scaling), None


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
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, invariant_attention)
    AttentionMaskInterface.register(NAME, mask_function)  # sdpa's boolean 4D mask, as for the int8 attention
    _swap_children(model)
    model.config._attn_implementation = NAME
    return model


def _swap_children(parent: torch.nn.Module) -> None:
    for name, child in list(parent.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(parent, name, InvariantLinear(child))
        elif type(child).__name__.endswith("RMSNorm"):
            setattr(parent, name, InvariantRMSNorm(child))
        else:
            _swap_children(child)


def batch_invariant(model: Any) -> bool:
    """Whether :func:`make_batch_invariant` made ``model``."""
    return any(isinstance(m, InvariantLinear) for m in model.modules())
