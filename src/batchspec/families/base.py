"""What a family file declares: its :class:`Plan` (its layers' departures from a Llama's) and its :class:`Family`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Norms:
    """The names of a decoder layer's RMSNorms by where they sit (None: the layer has none there): ``before`` its
    attention and ``after`` it, before the MLP (a Llama's), and on the attention's and the MLP's outputs before the
    residual sum (``attention_out``, ``mlp_out``: OLMo 2's). The places are ``decoder.h``'s ``layer_t`` fields."""

    before: str | None = "input_layernorm"
    after: str | None = "post_attention_layernorm"
    attention_out: str | None = None
    mlp_out: str | None = None


@dataclass(frozen=True)
class Plan:
    """One model's departures from a Llama's layers, for the fused forward.

    Attributes:
        rotary: per layer, whether it rotates its queries and keys (None: every layer does).
        embedding_multiplier: the embedded tokens are multiplied by it before the first layer.
        residual_multiplier: each attention's and MLP's output is multiplied by it before it is added to the
            residual stream.
        logits_divisor: the logits are divided by it.
        window: every layer attends over the last ``window`` positions, its own included (a sliding window, as
            transformers' ``sliding_window`` means it); None: over every position before it.
        sliding: per layer, whether it is a sliding layer (transformers' :data:`SLIDING` layer type: Gemma 3's local
            layers), attending over the last ``window`` positions (every position where ``window`` is None) and
            rotating its queries and keys by the sliding layers' rotary table; the other layers attend over every
            position (:data:`FULL`). None: no layer is, and every layer attends alike (over ``window`` where it is
            set).
        norms: where each layer's RMSNorms sit (:class:`Norms`).
        rotary_pairs: the rotary embedding turns each head's adjacent pairs ``(x[2i], x[2i + 1])`` by frequency
            ``i`` (GLM-4's), where a Llama's turns ``x[i]`` with ``x[i + R/2]``. Either turns a head's first ``R``
            values only where the rope's ``partial_rotary_factor`` is below 1 (``R``: the width of the rotary
            embedding's cos and sin), the others passing through.
        norm_offset: every RMSNorm scales by ``norm_offset + weight`` (Gemma's ``1 + w``), not by its weight.
    """

    rotary: tuple[bool, ...] | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_divisor: float = 1.0
    window: int | None = None
    sliding: tuple[bool, ...] | None = None
    norms: Norms = field(default_factory=Norms)
    rotary_pairs: bool = False
    norm_offset: float = 0.0

    @property
    def shared_window(self) -> int | None:
        """The window every layer attends over (one mask serves them all), or None: every layer attends over every
        position, or the layers mix (:attr:`sliding`; each kind then gets its own mask, :data:`FULL` and
        :data:`SLIDING`)."""
        return self.window if self.sliding is None else None


FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer types, the keys of its masks by kind


def sliding_visible(visible: torch.Tensor, window: int | None) -> torch.Tensor:
    """``visible`` ``[B, 1, q, L]`` (bool: causal over each row's own columns) over a sliding ``window`` only: each
    query keeps the keys less than ``window`` columns before the last one it sees, its own column (a row's columns
    are its positions in order, so a distance in columns is one in positions); a query that sees no key still sees
    none. ``window`` None: ``visible`` itself.

    Example: a query seeing columns 2..6 with ``window = 3`` keeps 4, 5, 6."""
    if window is None:
        return visible
    keys = torch.arange(visible.shape[-1], device=visible.device)  # [L]
    own = torch.where(visible, keys, -1).amax(-1, keepdim=True)  # [B, 1, q, 1]: the query's own column, or -1
    return visible & (keys > own - window)  # [B, 1, q, L]


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


def one_window(config: Any) -> str | None:
    """Why ``config`` cannot run here (a phrase after "the model"), where its layers do not all attend alike (some over
    a sliding window, some over everything: one attention mask serves every layer); else None."""
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if len(layer_types) > 1:
        return (f"mixes sliding-window and full attention across its layers (layer types {sorted(layer_types)}); "
                "batchspec supports one kind of attention in every layer")
    return None


def layer_types(config: Any) -> list[str]:
    """The type of each of ``config``'s layers (transformers' ``layer_types``; empty where it names none)."""
    return list((getattr(config, "layer_types", None) or [])[: config.num_hidden_layers])


def window_plan(config: Any) -> Plan:
    """The :class:`Plan` of ``config`` whose every layer attends over its ``sliding_window`` where it sets one."""
    window = getattr(config, "sliding_window", None)
    return Plan(window=int(window) if window else None)


def typed_plan(config: Any, **fields: Any) -> Plan:
    """The :class:`Plan` (with ``fields``) of ``config`` whose ``layer_types`` may name :data:`SLIDING` layers
    (:attr:`Plan.sliding`, over ``sliding_window``) beside :data:`FULL` ones."""
    sliding = tuple(kind == SLIDING for kind in layer_types(config))
    if not any(sliding):
        return Plan(**fields)
    window = getattr(config, "sliding_window", None)
    return Plan(window=int(window) if window else None, sliding=sliding, **fields)


def two_kinds(config: Any) -> str | None:
    """Why ``config`` cannot run here (a phrase after "the model"), where a layer's type is neither :data:`FULL`
    nor :data:`SLIDING`; else None."""
    kinds = set(layer_types(config))
    if not kinds <= {FULL, SLIDING}:
        return f"has layer types {sorted(kinds)}; batchspec runs {FULL!r} and {SLIDING!r} layers only"
    return None


@dataclass(frozen=True)
class Family:
    """One family: its ``model_type`` names, why one of its configs is refused (:func:`full_attention` unless it
    says otherwise), its :class:`Plan`, and ``context``: the positions past which it decodes a model of a config
    no longer as transformers' generate does (a prompt and its new tokens must fit in them; Phi-3's LongRoPE), or
    None where the family sets no such bound."""

    name: str
    model_types: tuple[str, ...]
    plan: Callable[[Any], Plan] = field(default=lambda config: Plan())
    refuse: Callable[[Any], str | None] = full_attention
    context: Callable[[Any], int | None] = field(default=lambda config: None)
