"""OLMo 2 (AI2): Llama's products with its norms moved: none before the attention or the MLP, one on each of their
outputs before the residual sum (``post_attention_layernorm``, ``post_feedforward_layernorm``), and the query and
key norms over the whole projection rather than each head. Without a norm before them to fold into, its int8
products are not smoothed (:mod:`batchspec.exact.integer.smoothing`)."""

from batchspec.families.base import Family, Norms, Plan

NORMS = Norms(before=None, after=None, attention_out="post_attention_layernorm", mlp_out="post_feedforward_layernorm")

FAMILY = Family("olmo2", ("olmo2",), plan=lambda config: Plan(norms=NORMS))
