"""Gemma 2 (Google, ``gemma2``): Gemma 3's layers (:mod:`batchspec.families.gemma3`: four norms a layer scaling by
``1 + w``, GELU with tanh, the embedding scaled by ``sqrt(hidden_size)``, the scores scaled by
``query_pre_attn_scalar ** -0.5``, sliding and full layers alternating as ``layer_types`` says) without the query and
key norms, one rotary table for both kinds of layer, and logit soft-capping: ``cap * tanh(x / cap)``, of the
attention's scores at ``attn_logit_softcapping`` (after the scaling, before the mask and the softmax) and of the
logits at ``final_logit_softcapping``. Both are computed exactly
(:func:`~batchspec.exact.integer.arithmetic.exact_softcap`, and its C twin in every build): the scores in the exact
attention (the attention module passes its cap as ``softcap``; the fused forward reads it from the same module), the
logits on the output layer's outputs, where :func:`~batchspec.exact.integer.model.quantize_model` moves them from
transformers' forward. The refusals are Gemma 3's."""

from batchspec.families.base import Family
from batchspec.families.gemma3 import plan, refuse

FAMILY = Family("gemma2", ("gemma2",), plan=plan, refuse=refuse)
