"""Mixtral (Mistral AI, ``mixtral``): Mistral's layers (every one over a sliding window of ``sliding_window``
positions where the config sets one) with a mixture of experts in place of the MLP: each token's
``num_experts_per_tok`` largest router logits, their weights the softmax over those k (transformers computes it as the
softmax over every expert, renormalized over the chosen: the same function). The block is computed as Qwen3-MoE's is
(:mod:`batchspec.families.qwen3_moe`, :mod:`batchspec.exact.integer.moe`, renormalized always)."""

from batchspec.families.base import Family, one_window, window_plan

FAMILY = Family("mixtral", ("mixtral",), plan=window_plan, refuse=one_window)
