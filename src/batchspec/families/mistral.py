"""Mistral and Ministral: Llama's layers, every one attending over a sliding window of ``config.sliding_window``
positions where the config sets one (the KV cache keeps every position; the attention mask hides those a query no
longer sees). A Ministral config whose ``layer_types`` mix sliding and full attention runs each layer over its own
kind's mask (:attr:`Plan.sliding`: the sliding layers over the window, the full ones over every position; one rotary
table serves both); a layer type other than these two is refused."""

from typing import Any

from batchspec.families.base import SLIDING, Family, Plan, layer_types, two_kinds, typed_plan


def _plan(config: Any) -> Plan:
    window = getattr(config, "sliding_window", None)
    if set(layer_types(config) or [SLIDING]) == {SLIDING}:  # Mistral's config names no layer types
        return Plan(window=int(window) if window else None)
    return typed_plan(config)


FAMILY = Family("mistral", ("mistral", "ministral"), plan=_plan, refuse=two_kinds)
