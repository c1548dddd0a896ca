"""SmolLM3 (Hugging Face): Llama's layers, some without a rotary embedding: ``config.no_rope_layers[i]`` is 1 where
layer ``i`` rotates its queries and keys, 0 where it attends over them as they are (NoPE, every fourth layer in the
published model)."""

from typing import Any

from batchspec.families.base import Family, Plan


def _plan(config: Any) -> Plan:
    return Plan(rotary=tuple(bool(used) for used in config.no_rope_layers[: config.num_hidden_layers]))


FAMILY = Family("smollm3", ("smollm3",), plan=_plan)
