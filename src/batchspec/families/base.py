"""What a family file declares: its :class:`Plan` (its layers' departures from a Llama's) and its :class:`Family`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Plan:
    """One model's departures from a Llama's layers, for the fused forward.

    Attributes:
        rotary: per layer, whether it rotates its queries and keys (None: every layer does).
        embedding_multiplier: the embedded tokens are multiplied by it before the first layer.
        residual_multiplier: each attention's and MLP's output is multiplied by it before it is added to the
            residual stream.
        logits_divisor: the logits are divided by it.
    """

    rotary: tuple[bool, ...] | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_divisor: float = 1.0


def full_attention(config: Any) -> str | None:
    """Why ``config`` cannot run here (a phrase after "the model"), where it attends over a sliding window in any
    layer; else None."""
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", window is not None)
    if layer_types != {"full_attention"} or (window and uses_window):
        return (f"uses sliding-window or hybrid attention (layer types {sorted(layer_types)}, sliding_window="
                f"{window}); batchspec supports full attention only")
    return None


@dataclass(frozen=True)
class Family:
    """One family: its ``model_type`` names, why one of its configs is refused (:func:`full_attention` unless it
    says otherwise) and its :class:`Plan`."""

    name: str
    model_types: tuple[str, ...]
    plan: Callable[[Any], Plan] = field(default=lambda config: Plan())
    refuse: Callable[[Any], str | None] = full_attention
