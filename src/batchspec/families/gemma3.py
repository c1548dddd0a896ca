"""Gemma 3 (Google; the text model, ``gemma3_text``): Llama's products with these departures, each read from the
config:

* four RMSNorms a layer: before the attention (``input_layernorm``) and on its output before the residual sum
  (``post_attention_layernorm``), before the MLP (``pre_feedforward_layernorm``) and on its output
  (``post_feedforward_layernorm``); every norm, the query and key norms over each head and the final one included,
  scales by ``1 + weight`` (:attr:`Plan.norm_offset`);
* the MLP's activation GELU with tanh (``hidden_activation`` ``gelu_pytorch_tanh``);
* the embedded tokens times ``sqrt(hidden_size)``, in the embedding module itself (its ``embed_scale``), so the plan's
  ``embedding_multiplier`` stays 1;
* the attention's scores scaled by ``query_pre_attn_scalar ** -0.5`` (the attention module's ``scaling``);
* layers of two kinds (``config.layer_types``): sliding ones attend over the last ``sliding_window`` positions and
  rotate by their own rotary table (``rope_parameters["sliding_attention"]``, base 10,000 in the published models),
  full ones over every position with theirs (base 1,000,000). The KV cache keeps every position of every layer (the
  sliding layers' masks hide those they no longer see, as Mistral's), so realignment and the prefix cache need
  nothing of their own.

Gemma 2's logit soft-capping (``attn_logit_softcapping``, ``final_logit_softcapping``) runs here too where a config
sets it (see :mod:`batchspec.families.gemma2`). Refused: bidirectional attention, and layer types other than these
two."""

from typing import Any

from batchspec.families.base import Family, Norms, Plan, two_kinds, typed_plan

NORMS = Norms(before="input_layernorm", after="pre_feedforward_layernorm", attention_out="post_attention_layernorm",
              mlp_out="post_feedforward_layernorm")


def plan(config: Any) -> Plan:
    """Gemma's plan: four norms a layer scaling by ``1 + w``, sliding and full layers as ``layer_types`` says."""
    return typed_plan(config, norms=NORMS, norm_offset=1.0)


def refuse(config: Any) -> str | None:
    """Why a Gemma config cannot run here: bidirectional attention, or a layer type neither full nor sliding."""
    if getattr(config, "use_bidirectional_attention", False):
        return "uses bidirectional attention; batchspec decodes causal models only"
    return two_kinds(config)


FAMILY = Family("gemma3", ("gemma3_text",), plan=plan, refuse=refuse)
