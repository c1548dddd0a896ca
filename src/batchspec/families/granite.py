"""Granite (IBM): Llama's layers with four multipliers from the config: the embedded tokens are multiplied by
``embedding_multiplier``, each attention's and MLP's output by ``residual_multiplier`` before it joins the residual
stream, the attention's scores by ``attention_multiplier`` (its scaling, in place of one over the root of the head
size) and the logits divided by ``logits_scaling``."""

from typing import Any

from batchspec.families.base import Family, Plan


def _plan(config: Any) -> Plan:
    return Plan(embedding_multiplier=float(config.embedding_multiplier),
                residual_multiplier=float(config.residual_multiplier), logits_divisor=float(config.logits_scaling))


FAMILY = Family("granite", ("granite",), plan=_plan)
