"""What the two exact modes (:mod:`batchspec.exact.integer` on the CPU, :mod:`batchspec.exact.invariant` on CUDA)
share in
how they enter a transformers model: an attention implementation registered by name, the boolean visibility its kernel
is given, and the swap of a model's layers for their own.

An attention *kernel* here takes ``query`` ``[B, H, q, D]``, ``key``/``value`` ``[B, Hk, L, D]`` (``H`` a multiple of
``Hk``), ``visible`` boolean ``[B, 1, q, L]`` (True: the query sees the key), the softmax's ``scaling`` and the
scores' ``softcap`` (None: not capped; Gemma 2's ``attn_logit_softcapping``, which transformers passes as
``softcap``), and returns ``[B, q, H, D]``, as transformers' attention functions do; :func:`register_attention` wraps
it in the function signature transformers calls. Each mode's ``model.py`` (``int8/model.py``,
``invariant/model.py``) says which of a model's layers it swaps for its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float | None], torch.Tensor]


def visible_or_causal(
    mask: torch.Tensor | None, batch: int, queries: int, keys: int, device: torch.device
) -> torch.Tensor:
    """The boolean visibility ``[B, 1, q, L]`` a kernel is given: the mask, or where transformers passes none,
    causal with the queries last.

    Example (no mask, 2 queries over 3 keys)::

        key          0 1 2
        query 1      1 1 0
        query 2      1 1 1
    """
    if mask is None:
        columns = torch.arange(keys, device=device)
        rows = torch.arange(keys - queries, keys, device=device)
        return (columns[None, :] <= rows[:, None]).expand(batch, 1, queries, keys)
    if mask.dtype != torch.bool:
        raise TypeError(f"batchspec's attention takes a boolean mask, not {mask.dtype}")
    return mask


def mask_function(*args: Any, **kwargs: Any):
    """The mask transformers builds for our implementations in its own forwards: sdpa's boolean 4D mask, never
    skipped (a kernel always gets a mask or builds the causal one)."""
    from transformers.masking_utils import sdpa_mask

    kwargs.pop("allow_is_causal_skip", None)
    return sdpa_mask(*args, allow_is_causal_skip=False, **kwargs)


def attention_function(kernel: AttentionKernel) -> Callable[..., tuple[torch.Tensor, None]]:
    """``kernel`` as the attention function transformers calls (its ``AttentionInterface`` signature):
    ``attention_mask`` boolean ``[B, 1, q, L]`` or None (causal), ``softcap`` (None: no soft-capping), no attention
    weights returned."""

    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
        dropout: float = 0.0,
        softcap: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        visible = visible_or_causal(attention_mask, query.shape[0], query.shape[2], key.shape[2], query.device)
        return kernel(query, key, value, visible, scaling, softcap), None

    return attention


def register_attention(name: str, kernel: AttentionKernel) -> None:
    """Make ``name`` an attention implementation transformers knows, running ``kernel`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_function(kernel))
    AttentionMaskInterface.register(name, mask_function)


def swap_layers(
    parent: torch.nn.Module, replacement: Callable[[str, torch.nn.Module], torch.nn.Module | None], prefix: str = ""
) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """Replace ``parent``'s descendants by ``replacement(qualified name, child)`` wherever it gives a module, depth
    first, not descending into a replaced one (names as ``named_modules`` gives them, ``model.layers.0.mlp``); returns
    ``(parent, name, child)`` of each module replaced, in order (setting them back in reverse undoes the swap)."""
    replaced = []
    for name, child in list(parent.named_children()):
        new = replacement(prefix + name, child)
        if new is None:
            replaced += swap_layers(child, replacement, f"{prefix}{name}.")
        else:
            setattr(parent, name, new)
            replaced.append((parent, name, child))
    return replaced


def is_rms_norm(module: torch.nn.Module) -> bool:
    """Whether ``module`` is one of transformers' RMSNorms (``weight * normalised.to(dtype)`` in the families the
    exact modes support)."""
    return type(module).__name__.endswith("RMSNorm")


class RMSNormSwap(torch.nn.Module):
    """What an exact mode's RMSNorm keeps of the transformers RMSNorm it replaces: the weight ``[H]`` and the
    epsilon (whichever name its family gives it); subclasses define the forward."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
