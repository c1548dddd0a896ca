"""Qwen3-MoE (``qwen3_moe``): Qwen3's attention (an RMSNorm over each query and key head) with a mixture of experts
in place of the MLP: a softmax router, each token's ``num_experts_per_tok`` most probable experts, their weights
renormalized to sum 1 where ``norm_topk_prob``, no shared expert. The layers ``mlp_only_layers`` names, and those
``decoder_sparse_step`` skips, keep a dense MLP. The exact model computes the block as
:mod:`batchspec.exact.integer.moe` says (the router an integer product, its softmax exact, ties to the lower expert,
each row's expert outputs summed by rank), in transformers' forward of the integer model and in the fused forward
alike (``csrc/decoder.h``'s ``mixture``: each expert on the rows that chose it). A forward reads the experts its
tokens chose, the union over them: a verification of ``k + 1`` tokens reads more than a one-token step
(:func:`~batchspec.exact.integer.moe.forward_bytes` counts them; the draft-length planner's prior for an extra
verified token follows the union expected of uniformly routed tokens,
:func:`~batchspec.engine.draft_length.prior_slope`, and ``batchspec costs`` reports each forward against the union
it touched, :func:`~batchspec.bench.costs.union_reads`)."""

from batchspec.families.base import Family

FAMILY = Family("qwen3_moe", ("qwen3_moe",))
