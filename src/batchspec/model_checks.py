"""Which models batchspec can decode with, checked before any work starts (by the engine, on models however
they were loaded; :mod:`batchspec.models` is loading only)."""

from __future__ import annotations

from typing import Any

import torch

from batchspec.families import SUPPORTED_MODEL_TYPES, family_of


def check_model(model: torch.nn.Module, role: str) -> None:
    """Raise ``ValueError`` unless ``model`` is a decoder-only causal LM of a family batchspec runs
    (:mod:`batchspec.families`) whose config that family accepts."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_output_embeddings"):
        raise ValueError(f"{role} must be a transformers causal LM; got {type(model).__name__}")
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{role} model is an encoder-decoder ({model_type}); batchspec needs decoder-only causal LMs"
        )
    family = family_of(config)
    if family is None:
        raise ValueError(
            f"{role} model type {model_type!r} is not supported; supported families: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    reason = family.refuse(config)
    if reason is not None:
        raise ValueError(f"{role} model {reason}")


def vocab_size(model: torch.nn.Module) -> int:
    """Rows of the model's output embedding (the number of logits per position)."""
    embeddings = model.get_output_embeddings()
    if embeddings is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings; a causal LM is needed")
    rows = getattr(embeddings, "out_features", None)  # nn.Linear and batchspec's swapped linear layers
    return int(rows if rows is not None else embeddings.weight.shape[0])


def check_pair(target: torch.nn.Module, draft: torch.nn.Module | None, *, same_tokenizer: bool = True) -> None:
    """Check each model and that the draft is on the target's device and, where it shares the target's tokenizer
    (``same_tokenizer``; else its drafts reach the target as text: :mod:`batchspec.engine.retokenize`), scores the
    same vocabulary."""
    check_model(target, "target")
    if draft is None:
        return
    check_model(draft, "draft")
    if same_tokenizer and vocab_size(draft) != vocab_size(target):
        raise ValueError(
            f"draft vocabulary ({vocab_size(draft)} tokens) differs from the target's ({vocab_size(target)}); "
            "target and draft must share a tokenizer, or the draft be loaded with its own (batchspec.load_pair "
            "does: its drafts then reach the target as text)"
        )
    target_device = next(target.parameters()).device
    draft_device = next(draft.parameters()).device
    if draft_device != target_device:
        raise ValueError(f"draft is on {draft_device} but target is on {target_device}; put both on one device")


def forward_weights(model: torch.nn.Module, vocabulary: int = 0) -> int:
    """Weights a one-token forward of ``model`` multiplies by, from its config: every layer's q, k, v, o and gated MLP
    products (a mixture of experts' router and the ``num_experts_per_tok`` experts one token reads) and the output
    layer (over its first ``vocabulary`` rows where that is smaller; 0: all of them), not the embedding it looks one
    row up in. Two models of one quantization read bytes in this ratio: the draft-length planner's prior for a
    draft's cost against its target's, before the draft has run (a verification of several tokens reads the union
    of their experts: more, which the prior does not count)."""
    config = model.config.get_text_config()
    hidden, layers = config.hidden_size, config.num_hidden_layers
    size = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    attention = 2 * hidden * config.num_attention_heads * size + 2 * hidden * kv_heads * size
    outputs = vocab_size(model) if not vocabulary else min(vocabulary, vocab_size(model))
    mlps = sum(_mlp_weights(config, layer) for layer in range(layers))
    return layers * attention + mlps + outputs * hidden


def _mlp_weights(config: Any, layer: int) -> int:
    """The weights a token's forward multiplies by in layer ``layer``'s MLP: a gated MLP's, or a mixture of experts'
    router and ``num_experts_per_tok`` experts (Qwen3-MoE's ``mlp_only_layers`` and ``decoder_sparse_step`` keep
    some layers dense)."""
    hidden = config.hidden_size
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
    step = getattr(config, "decoder_sparse_step", None) or 1
    dense = layer in (getattr(config, "mlp_only_layers", None) or ()) or (layer + 1) % step != 0
    if not experts or dense:
        return 3 * hidden * config.intermediate_size
    inner = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return hidden * experts + config.num_experts_per_tok * 3 * hidden * inner
