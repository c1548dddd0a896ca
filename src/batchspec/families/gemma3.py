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

Refused: logit soft-capping (``attn_logit_softcapping``, ``final_logit_softcapping``; Gemma 2's), bidirectional
attention, and layer types other than these two."""

from typing import Any

from batchspec.families.base import FULL, SLIDING, Family, Norms, Plan

NORMS = Norms(before="input_layernorm", after="pre_feedforward_layernorm", attention_out="post_attention_layernorm",
              mlp_out="post_feedforward_layernorm")


def _layer_types(config: Any) -> list[str]:
    return list(config.layer_types[: config.num_hidden_layers])


def _plan(config: Any) -> Plan:
    sliding = tuple(kind == SLIDING for kind in _layer_types(config))
    window = getattr(config, "sliding_window", None)
    if not any(sliding):
        return Plan(norms=NORMS, norm_offset=1.0)
    return Plan(window=int(window) if window else None, sliding=sliding, norms=NORMS, norm_offset=1.0)


def _refuse(config: Any) -> str | None:
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None) is not None:
            return f"sets {name}={getattr(config, name)}; batchspec does not soft-cap logits"
    if getattr(config, "use_bidirectional_attention", False):
        return "uses bidirectional attention; batchspec decodes causal models only"
    kinds = set(_layer_types(config))
    if not kinds <= {FULL, SLIDING}:
        return f"has layer types {sorted(kinds)}; batchspec runs {FULL!r} and {SLIDING!r} layers only"
    return None


FAMILY = Family("gemma3", ("gemma3_text",), plan=_plan, refuse=_refuse)
