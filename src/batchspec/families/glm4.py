"""GLM-4 (Zhipu AI, ``Glm4ForCausalLM``): Llama's products with a bias on q, k and v, four norms a layer (before the
attention and the MLP as a Llama's, and on each of their outputs before the residual sum: ``post_self_attn_layernorm``,
``post_mlp_layernorm``), gate and up in one weight (``gate_up_proj``, split into a Llama's two at quantization:
:func:`batchspec.exact.integer.model.split_fused`) and a partial rotary embedding that turns adjacent pairs: each
head's first ``head_dim * partial_rotary_factor`` values (half, by default) turn as pairs ``(x[2i], x[2i + 1])`` by
frequency ``i``, the rest pass through. The integer model is not made from a GGUF file's GLM-4 (its fused tensors'
blocks are not read, ``models/gguf_weights.py``: load the safetensors checkpoint)."""

from batchspec.families.base import Family, Norms, Plan

NORMS = Norms(before="input_layernorm", after="post_attention_layernorm", attention_out="post_self_attn_layernorm",
              mlp_out="post_mlp_layernorm")

FAMILY = Family("glm4", ("glm4",), plan=lambda config: Plan(norms=NORMS, rotary_pairs=True))
