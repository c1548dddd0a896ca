"""OLMoE (AI2, ``olmoe``): Llama's norms before the attention and the MLP, the query and key norms over the whole
projection (OLMo 2's), and a mixture of experts in place of the MLP: a softmax router and each token's
``num_experts_per_tok`` most probable experts, their weights the probabilities themselves (``norm_topk_prob`` False
by default; renormalized where it is set). The block is computed as Qwen3-MoE's is
(:mod:`batchspec.families.qwen3_moe`, :mod:`batchspec.exact.integer.moe`). A config clipping q, k and v
(``clip_qkv``) is refused."""

from typing import Any

from batchspec.families.base import Family, full_attention


def _refuse(config: Any) -> str | None:
    clip = getattr(config, "clip_qkv", None)
    if clip is not None:
        return f"clips its queries, keys and values at {clip} (clip_qkv); batchspec runs OLMoE without clipping"
    return full_attention(config)


FAMILY = Family("olmoe", ("olmoe",), refuse=_refuse)
