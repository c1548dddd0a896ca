"""Phi-3 and Phi-4-mini (Microsoft, ``Phi3ForCausalLM``): Llama's layers with q, k and v in one weight (``qkv_proj``)
and gate and up in one (``gate_up_proj``), split into a Llama's at quantization
(:func:`batchspec.exact.integer.model.split_fused`: every output keeps its channel's weights); Phi-4-mini's rotary
embedding is partial (``partial_rotary_factor`` 0.75: each head's first three quarters turn, over their halves as a
Llama's, the rest pass through) and its output layer tied to the embedding.

LongRoPE (``rope_type`` ``longrope``, Phi-3-*-128k's and Phi-4-mini's): transformers turns every position of a forward
by the short factors while the forward's last position is below ``original_max_position_embeddings``, and by the long
ones once it reaches it (the keys cached before keep the short ones), so past that length a position's cos and sin
depend on the forward that reads it, and no batched decoding equals generate's. batchspec's rule: a prompt and its new
tokens must fit in ``original_max_position_embeddings`` positions (:attr:`Family.context`; ``batchspec.generate`` and
the server refuse a request that does not, and the exact model's rotary table holds the short factors' positions
alone, :func:`batchspec.families.positions_of`): every forward then turns by the short factors, as generate's do.

A ``sliding_window`` in the config (Phi-3-mini-4k's 2047) makes every layer attend over that window, as Mistral's
does: transformers' Phi-3 builds the same sliding-window mask. The integer model is not made from a GGUF file's
Phi-3 (its fused tensors' blocks are not read, ``models/gguf_weights.py``: load the safetensors checkpoint)."""

from typing import Any

from batchspec.families.base import Family, one_window, window_plan


def _context(config: Any) -> int | None:
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "longrope":
        return None
    return int(rope.get("original_max_position_embeddings") or config.original_max_position_embeddings)


FAMILY = Family("phi3", ("phi3",), plan=window_plan, refuse=one_window, context=_context)
