"""Mistral and Ministral: Llama's layers, every one attending over a sliding window of ``config.sliding_window``
positions where the config sets one (the KV cache keeps every position; the attention mask hides those a query no
longer sees). A Ministral config whose layers mix sliding and full attention is refused."""

from typing import Any

from batchspec.families.base import Family, Plan, one_window


def _plan(config: Any) -> Plan:
    types = set(getattr(config, "layer_types", None) or ["sliding_attention"])
    window = getattr(config, "sliding_window", None)
    return Plan(window=int(window) if window and types == {"sliding_attention"} else None)


FAMILY = Family("mistral", ("mistral", "ministral"), plan=_plan, refuse=one_window)
