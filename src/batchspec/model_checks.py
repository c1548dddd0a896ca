"""Which models batchspec can decode with, checked before any work starts (by the engine, on models however
they were loaded; :mod:`batchspec.models` is loading only)."""

from __future__ import annotations

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_model(model: torch.nn.Module, role: str) -> None:
    """Raise ``ValueError`` unless ``model`` is a decoder-only, full-attention RoPE causal LM we support."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_output_embeddings"):
        raise ValueError(f"{role} must be a transformers causal LM; got {type(model).__name__}")
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{role} model is an encoder-decoder ({model_type}); batchspec needs decoder-only causal LMs"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{role} model type {model_type!r} is not supported; supported decoder-only full-attention "
            f"RoPE families: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    sliding = getattr(config, "sliding_window", None) if model_type == "mistral" else None
    if layer_types != {"full_attention"} or sliding:
        raise ValueError(
            f"{role} model uses sliding-window or hybrid attention (layer types {sorted(layer_types)}, "
            f"sliding_window={getattr(config, 'sliding_window', None)}); batchspec supports full attention only"
        )


def vocab_size(model: torch.nn.Module) -> int:
    """Rows of the model's output embedding (the number of logits per position): its weight's, or for a layer
    that keeps no float weight (an int8 one, see :mod:`batchspec.models.int8`) its ``out_features``."""
    embeddings = model.get_output_embeddings()
    if embeddings is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings; a causal LM is needed")
    weight = getattr(embeddings, "weight", None)
    return int(embeddings.out_features if weight is None else weight.shape[0])


def check_pair(target: torch.nn.Module, draft: torch.nn.Module | None) -> None:
    """Check each model and that the draft scores the same vocabulary on the same device as the target."""
    check_model(target, "target")
    if draft is None:
        return
    check_model(draft, "draft")
    if vocab_size(draft) != vocab_size(target):
        raise ValueError(
            f"draft vocabulary ({vocab_size(draft)} tokens) differs from the target's ({vocab_size(target)}); "
            "target and draft must share a tokenizer"
        )
    target_device = next(target.parameters()).device
    draft_device = next(draft.parameters()).device
    if draft_device != target_device:
        raise ValueError(f"draft is on {draft_device} but target is on {target_device}; put both on one device")
