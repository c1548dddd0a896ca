"""transformers configs and models of every family batchspec runs (:mod:`batchspec.families`), at any size, with each
family's departures from a Llama's switched on: the tests' tiny models (``tests/tiny_models.py``) and
``scripts/family_floor.py``'s ~1B ones are both made here.

:func:`family_config` gives a family's config from the common keyword arguments (``vocab_size``, ``hidden_size``,
``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size`` ...) plus the family's
own, each of which a keyword argument of the same name replaces:

* Mistral: full attention (``sliding_window=None``); Ministral: sliding layers (the even ones) and full ones;
* Qwen3, Mistral, Ministral, GLM-4, Gemma, Qwen3-MoE, Mixtral: ``head_dim`` the hidden size over the heads;
* SmolLM3: every fourth layer from the second without a rotary embedding (NoPE);
* Granite: its four multipliers away from 1;
* Phi-3: a tied output layer, a partial rotary embedding (0.75 of each head where that many values pair up, else
  half), LongRoPE with short and long factors away from 1 over an original context of half the positions;
* GLM-4: q, k and v with a bias;
* Gemma 3 and 2: a sliding layer then a full one, ``query_pre_attn_scalar`` away from the head size, a tied output
  layer; Gemma 3 with distinct rotary bases for each kind, Gemma 2 with soft-caps on the scores and the logits;
* the mixtures: Qwen3-MoE (top k renormalized, its second layer dense), OLMoE, Mixtral (every layer over a sliding
  window), ``num_experts_per_tok`` of ``experts`` experts of ``moe_intermediate_size`` inner values (OLMoE's and
  Mixtral's ``intermediate_size``).

The windows, soft-caps and expert counts default to the tiny models' (small, so that they bite in a short test).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers.initialization import no_init_weights

FAMILY_NAMES = ("llama", "qwen2", "qwen3", "mistral", "smollm3", "granite", "olmo2", "phi3", "glm4", "gemma3",
                "gemma2", "ministral", "qwen3_moe", "olmoe", "mixtral")
MIXTURES = ("qwen3_moe", "olmoe", "mixtral")
_CLASSES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "smollm3": "SmolLM3",
            "granite": "Granite", "olmo2": "Olmo2", "phi3": "Phi3", "glm4": "Glm4", "gemma3": "Gemma3",
            "gemma2": "Gemma2", "ministral": "Ministral", "qwen3_moe": "Qwen3Moe", "olmoe": "Olmoe",
            "mixtral": "Mixtral"}


def model_class(family: str) -> type:
    """The transformers causal LM class of ``family`` (one of :data:`FAMILY_NAMES`)."""
    if family not in _CLASSES:
        raise ValueError(f"unknown family {family!r}: one of {', '.join(FAMILY_NAMES)}")
    return getattr(transformers, f"{_CLASSES[family]}ForCausalLM")


def _config_class(family: str) -> type:
    name = "Gemma3TextConfig" if family == "gemma3" else f"{_CLASSES[family]}Config"
    return getattr(transformers, name)


def _head(kw: dict) -> int:
    return kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"]


def _alternating(kw: dict) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(kw["num_hidden_layers"])]


def _phi3(kw: dict) -> dict:
    head = kw["hidden_size"] // kw["num_attention_heads"]
    factor = 0.75 if int(head * 0.75) % 2 == 0 else 0.5
    pairs = range(int(head * factor) // 2)
    original = kw["max_position_embeddings"] // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": factor,
            "short_factor": [1.0 + 0.05 * i for i in pairs], "long_factor": [1.5 + 0.4 * i for i in pairs],
            "original_max_position_embeddings": original}
    return {"tie_word_embeddings": True, "rope_parameters": rope, "original_max_position_embeddings": original}


def _gemma(kw: dict, extra: dict) -> dict:
    return {"tie_word_embeddings": True, "head_dim": _head(kw), "sliding_window": 4, "query_pre_attn_scalar": 20,
            "layer_types": _alternating(kw), **extra}


_GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}
_TOP = {"num_experts_per_tok": 2, "output_router_logits": False}

# each family's departures, from the common keyword arguments
_DEPARTURES: dict[str, Callable[[dict], dict]] = {
    "llama": lambda kw: {},
    "qwen2": lambda kw: {},
    "qwen3": lambda kw: {"head_dim": _head(kw)},
    "mistral": lambda kw: {"head_dim": _head(kw), "sliding_window": None},
    "ministral": lambda kw: {"head_dim": _head(kw), "sliding_window": 4, "layer_types": _alternating(kw)},
    "smollm3": lambda kw: {"no_rope_layers": [int(i % 4 != 1) for i in range(kw["num_hidden_layers"])]},
    "granite": lambda kw: {"embedding_multiplier": 3.0, "residual_multiplier": 0.37, "attention_multiplier": 0.21,
                           "logits_scaling": 2.5},
    "olmo2": lambda kw: {},
    "phi3": _phi3,
    "glm4": lambda kw: {"head_dim": _head(kw), "attention_bias": True},
    "gemma3": lambda kw: _gemma(kw, {"rope_parameters": _GEMMA3_ROPE}),
    "gemma2": lambda kw: _gemma(kw, {"attn_logit_softcapping": 3.0, "final_logit_softcapping": 1.0}),
    "qwen3_moe": lambda kw: {**_TOP, "head_dim": _head(kw), "num_experts": 6, "norm_topk_prob": True,
                             "mlp_only_layers": [1], "decoder_sparse_step": 1},
    "olmoe": lambda kw: {**_TOP, "num_experts": 8},
    "mixtral": lambda kw: {**_TOP, "head_dim": _head(kw), "num_local_experts": 4, "sliding_window": 7},
}


def family_config(family: str, **kwargs: Any) -> transformers.PretrainedConfig:
    """The config of ``family`` (:data:`FAMILY_NAMES`) from ``kwargs``, the family's departures (module docstring)
    filled in where ``kwargs`` does not give them. No EOS id where ``kwargs`` gives none (GLM-4's class would put its
    own ids, past a small vocabulary, in place of None)."""
    model_class(family)
    config = _config_class(family)(**{**_DEPARTURES[family](kwargs), **kwargs})
    if getattr(config, "use_sliding_window", False):
        raise ValueError(f"{family}'s config turned its sliding window on")
    config.eos_token_id = kwargs.get("eos_token_id")
    return config


def random_model(config: transformers.PretrainedConfig, *, seed: int, dtype: torch.dtype,
                 std: float = 0.02) -> torch.nn.Module:
    """A model of ``config`` in eval mode, without transformers' initialization (slow at a billion weights): every
    matrix drawn from ``N(0, std**2)`` by a generator seeded with ``seed``, every bias 0 and every other vector (the
    norms') 1."""
    with no_init_weights():
        model = model_class(_family(config))._from_config(config, dtype=dtype)
    model.tie_weights()  # a tied config's output layer is its embedding (transformers leaves it apart here)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, std, generator=generator)
            else:
                parameter.fill_(0.0 if name.endswith("bias") else 1.0)
    model.generation_config.eos_token_id = None
    model.eval()
    return model.requires_grad_(False)


def _family(config: transformers.PretrainedConfig) -> str:
    kind = config.model_type.removesuffix("_text")
    if kind not in _CLASSES:
        raise ValueError(f"no family of model type {config.model_type!r}")
    return kind
