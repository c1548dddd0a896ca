"""Which models batchspec can decode with, checked before any work starts (by the engine, on models however
they were loaded; :mod:`batchspec.models` is loading only)."""

from __future__ import annotations

from dataclasses import dataclass
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
    draft's cost against its target's, before the draft has run. A verification of several tokens reads the union
    of their experts, more: :class:`Mixture` prices that growth."""
    config = model.config.get_text_config()
    hidden, layers = config.hidden_size, config.num_hidden_layers
    size = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    attention = 2 * hidden * config.num_attention_heads * size + 2 * hidden * kv_heads * size
    outputs = vocab_size(model) if not vocabulary else min(vocabulary, vocab_size(model))
    mlps = sum(_mlp_weights(config, layer) for layer in range(layers))
    return layers * attention + mlps + outputs * hidden


@dataclass(frozen=True)
class Mixture:
    """A target's mixtures of experts as the bytes of its forwards see them: ``experts`` in each sparse block,
    ``top_k`` of them read by each token, and ``share``, the experts' part of the weights a one-token forward
    multiplies by (:func:`forward_weights`; the rest is attention, routers, dense layers and the output layer).

    A forward of ``n`` tokens runs, in each sparse block, the union of the experts its tokens chose. Under independent
    uniform routing each expert is missed by a token with chance ``1 - k/E``, so the union holds
    ``E (1 - (1 - k/E)^n)`` experts on average (:meth:`union`): ``k`` at one token, all ``E`` as ``n`` grows. Every
    sparse block's experts being of one size, the forward reads ``1 - share + share * union(n) / k`` times a
    one-token forward's weights (:meth:`weights`). Example: 8 experts, top 2, ``share`` 0.65: one token reads 2
    experts a block, four 5.47 of them, so the four read 0.35 + 0.65 * 5.47 / 2 = 2.13 times the one's bytes (a dense
    model's four read the same bytes as its one). Real routers are not uniform (some experts are popular, and
    neighbouring tokens agree), so the union measured is at most this, never more than ``E`` or fewer than ``k``.
    """

    experts: int
    top_k: int
    share: float

    def union(self, tokens: int) -> float:
        """Experts a sparse block of a forward of ``tokens`` tokens is expected to run."""
        return self.experts * (1 - (1 - self.top_k / self.experts) ** tokens)

    def weights(self, tokens: int) -> float:
        """The weights a forward of ``tokens`` tokens is expected to read, over a one-token forward's."""
        return 1 - self.share + self.share * self.union(tokens) / self.top_k


def mixture_of(model: torch.nn.Module) -> Mixture | None:
    """``model``'s :class:`Mixture`, from its config; None for a dense model (no layer a sparse block)."""
    config = model.config.get_text_config()
    sparse = [layer for layer in range(config.num_hidden_layers) if not _dense(config, layer)]
    if not sparse:
        return None
    share = len(sparse) * _expert_weights(config) / forward_weights(model)
    return Mixture(_experts(config), config.num_experts_per_tok, share)


def _experts(config: Any) -> int:
    """Experts in each of ``config``'s sparse blocks (0: a dense model)."""
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)


def _dense(config: Any, layer: int) -> bool:
    """Whether layer ``layer``'s MLP is a gated MLP, not a mixture of experts (every layer of a dense model;
    Qwen3-MoE's ``mlp_only_layers`` and those ``decoder_sparse_step`` skips)."""
    step = getattr(config, "decoder_sparse_step", None) or 1
    return not _experts(config) or layer in (getattr(config, "mlp_only_layers", None) or ()) or (layer + 1) % step != 0


def _mlp_weights(config: Any, layer: int) -> int:
    """The weights a token's forward multiplies by in layer ``layer``'s MLP: a gated MLP's, or a mixture of experts'
    router and ``num_experts_per_tok`` experts."""
    hidden = config.hidden_size
    if _dense(config, layer):
        return 3 * hidden * config.intermediate_size
    return hidden * _experts(config) + _expert_weights(config)


def _expert_weights(config: Any) -> int:
    """The weights of the ``num_experts_per_tok`` experts a token reads in a sparse layer (every one alike)."""
    inner = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return config.num_experts_per_tok * 3 * config.hidden_size * inner
