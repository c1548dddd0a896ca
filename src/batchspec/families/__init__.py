"""The model families batchspec runs, one file each: what a family's config says about its layers that a Llama's
does not, read once into a :class:`Plan` the fused integer forward follows (``exact/integer/forward.py``,
``csrc/decoder.h``), and what about a config makes it refuse one.

transformers' own forward of the integer model reads the same things from its own modules; the fused forward must
give its bits (``tests/test_integer_forward.py`` compares them, family by family). Adding a family whose layers need
no new kernel is its file here (a :data:`FAMILY` in :data:`FAMILIES`), its test, and the lists in the README and
``docs/models.md``; see ``docs/how-it-works.md``.
"""

from __future__ import annotations

from typing import Any

from batchspec.families import (
    gemma2,
    gemma3,
    glm4,
    granite,
    llama,
    mistral,
    mixtral,
    olmo2,
    olmoe,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
    smollm3,
)
from batchspec.families.base import FULL, SLIDING, Family, Norms, Plan, sliding_visible

FAMILIES: tuple[Family, ...] = tuple(
    module.FAMILY for module in (llama, mistral, qwen2, qwen3, smollm3, granite, olmo2, phi3, glm4, gemma2, gemma3,
                                 qwen3_moe, olmoe, mixtral)
)
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(kind for family in FAMILIES for kind in family.model_types)

__all__ = ["FAMILIES", "FULL", "SLIDING", "SUPPORTED_MODEL_TYPES", "Family", "Norms", "Plan", "attention_window",
           "context_limit", "family_of", "plan_of", "positions_of", "sliding_visible"]


def family_of(config: Any) -> Family | None:
    """The family of a transformers config, or None where none is supported."""
    model_type = getattr(config, "model_type", None)
    return next((family for family in FAMILIES if model_type in family.model_types), None)


def plan_of(config: Any) -> Plan:
    """The :class:`Plan` of a model of ``config`` (a Llama's where no family takes it)."""
    family = family_of(config)
    return Plan() if family is None else family.plan(config)


def attention_window(config: Any) -> int | None:
    """The sliding window every layer of a model of ``config`` attends over (:attr:`Plan.shared_window`), or None."""
    return plan_of(config).shared_window


def context_limit(config: Any) -> int | None:
    """The positions a prompt and its new tokens must fit in for a model of ``config`` where its family bounds them
    (:attr:`Family.context`: Phi-3's LongRoPE), else None."""
    family = family_of(config)
    return None if family is None else family.context(config)


def positions_of(config: Any) -> int:
    """The positions a model of ``config`` is decoded at, at most: its ``max_position_embeddings``, or
    :func:`context_limit` where that is smaller."""
    positions, limit = int(config.max_position_embeddings), context_limit(config)
    return positions if limit is None else min(positions, limit)
