"""Tiny random-weight causal LMs for the batchspec test suite.

Everything here is built from configs (no Hub downloads), seeded, converted to float64 and put
in eval mode, so greedy decoding is deterministic and numerically far from argmax ties.

The targets cover the four supported families: Llama, Qwen2, Qwen3 (per-head q/k RMSNorm) and Mistral (with
``sliding_window=None``, i.e. full attention). For each target three kinds of draft are provided:

* ``identical``: a deepcopy of the target (every draft token is accepted);
* ``unrelated``: an independent random model of another architecture and size, same vocab
  (almost nothing is accepted);
* ``perturbed``: the target with Gaussian noise added to every weight (partial acceptance).

EOS and pad ids are chosen deterministically from the target's own greedy behaviour: EOS is a
token that the target emits within the first ~40 steps for some, but not most, prompts.
"""

from __future__ import annotations

import copy
import random
from collections import Counter
from dataclasses import dataclass, field

import torch
from transformers import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Glm4ForCausalLM,
    GraniteForCausalLM,
    LlamaForCausalLM,
    MinistralForCausalLM,
    MistralForCausalLM,
    MixtralForCausalLM,
    Olmo2ForCausalLM,
    OlmoeForCausalLM,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    SmolLM3ForCausalLM,
)

from batchspec.bench.shapes import family_config, model_class

VOCAB_SIZE = 96
MAX_POSITIONS = 512
INIT_RANGE = 0.3
# Relative std of the Gaussian noise added to every weight of the "perturbed" draft
# (tuned so that greedy agreement with the target is partial: see validate_models()).
PERTURB_SCALE = {"llama": 0.03, "qwen2": 0.03, "qwen3": 0.03, "mistral": 0.03}

# Horizon used to choose the EOS id, and the probe prompts used for the choice.
EOS_HORIZON = 40
N_PROBE_PROMPTS = 24

TARGET_KINDS = ("llama", "qwen2", "qwen3", "mistral")
DRAFT_KINDS = ("identical", "unrelated", "perturbed")


def _common_config_kwargs(**overrides) -> dict:
    kw = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    kw.update(overrides)
    return kw


def _finish(model: PreTrainedModel) -> PreTrainedModel:
    model = model.to(torch.float64)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _built(family: str, seed: int, kw: dict) -> PreTrainedModel:
    """A model of ``family_config(family, **kw)`` drawn by transformers' own initialization after ``seed``."""
    cfg = family_config(family, **kw)
    torch.manual_seed(seed)
    return model_class(family)(cfg)


def build_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    return _finish(_built("llama", seed, _common_config_kwargs(**overrides)))


def build_qwen2(seed: int = 0, **overrides) -> Qwen2ForCausalLM:
    return _finish(_built("qwen2", seed, _common_config_kwargs(**overrides)))


def build_qwen3(seed: int = 0, **overrides) -> Qwen3ForCausalLM:
    return _finish(_built("qwen3", seed, _common_config_kwargs(**overrides)))


def build_mistral(seed: int = 0, **overrides) -> MistralForCausalLM:
    """Mistral with full attention, unless ``sliding_window`` is given."""
    return _finish(_built("mistral", seed, _common_config_kwargs(**overrides)))


def build_ministral(seed: int = 0, **overrides) -> MinistralForCausalLM:
    """Ministral whose layers mix sliding attention (window 4, the first of each pair) and full attention."""
    return _finish(_built("ministral", seed, _common_config_kwargs(**overrides)))


def build_smollm3(seed: int = 0, **overrides) -> SmolLM3ForCausalLM:
    """SmolLM3 with its second layer of two without a rotary embedding (NoPE)."""
    return _finish(_built("smollm3", seed, _common_config_kwargs(**overrides)))


def build_granite(seed: int = 0, **overrides) -> GraniteForCausalLM:
    """Granite with each of its four multipliers away from 1."""
    return _finish(_built("granite", seed, _common_config_kwargs(**overrides)))


def build_olmo2(seed: int = 0, **overrides) -> Olmo2ForCausalLM:
    """OLMo 2: norms on the attention's and the MLP's outputs, none before them, q and k normed whole."""
    return _finish(_built("olmo2", seed, _common_config_kwargs(**overrides)))


def build_phi3(seed: int = 0, **overrides) -> Phi3ForCausalLM:
    """Phi-3 as Phi-4-mini is: fused qkv_proj and gate_up_proj, a partial rotary embedding (0.75 of each head where
    that many values pair up, else half), LongRoPE with short and long factors away from 1 (its attention factor from
    max_position_embeddings over an original_max_position_embeddings of half of it). Its output layer is untied
    (the common keyword arguments' ``tie_word_embeddings=False`` replaces the family's tied one)."""
    return _finish(_built("phi3", seed, _common_config_kwargs(**overrides)))


def build_glm4(seed: int = 0, **overrides) -> Glm4ForCausalLM:
    """GLM-4: four norms a layer (two on the attention's and the MLP's outputs), q, k and v with a bias, a fused
    gate_up_proj and half of each head turned over adjacent pairs. The norms' weights and the biases are drawn away
    from their initial ones and zeros; no EOS."""
    model = _built("glm4", seed, _common_config_kwargs(**overrides))
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                parameter.normal_(0.0, 0.3)
    return _finish(model)


def build_gemma3(seed: int = 0, **overrides) -> Gemma3ForCausalLM:
    """Gemma 3 (text) with every departure from a Llama's switched on: a sliding layer (window 4) then a full one,
    distinct rotary bases for each kind, ``query_pre_attn_scalar`` away from the head size, norms scaling by
    ``1 + w`` with ``w`` drawn away from 0, GELU with tanh, the embedding scaled by ``sqrt(hidden_size)``, tied
    output layer."""
    model = _built("gemma3", seed, _common_config_kwargs(**{"tie_word_embeddings": True, **overrides}))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0.0, 0.3)
    return _finish(model)


def build_gemma2(seed: int = 0, **overrides) -> Gemma2ForCausalLM:
    """Gemma 2 with every departure from a Llama's switched on, and soft-caps that bite: the scores capped at 3
    (q and k weights drawn large, so that many exceed it) and the logits at 1 (the tied output layer's weights drawn
    large); a sliding layer (window 4) then a full one, ``query_pre_attn_scalar`` away from the head size, norms scaling
    by ``1 + w`` with ``w`` drawn away from 0, GELU with tanh, the embedding scaled by ``sqrt(hidden_size)``."""
    model = _built("gemma2", seed, _common_config_kwargs(**{"tie_word_embeddings": True, **overrides}))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("norm.weight", "q_proj.weight", "k_proj.weight")):
                parameter.normal_(0.0, 0.3)
            elif name.endswith("embed_tokens.weight"):
                parameter.normal_(0.0, 0.1)
    return _finish(model)


def _moe_kwargs(overrides: dict, layers: int = 3) -> dict:
    """The common kwargs with three layers and the experts' inner size a third of the MLP's (its dense layers')."""
    kw = _common_config_kwargs(**{"num_hidden_layers": layers, **overrides})
    return {**kw, "moe_intermediate_size": kw["intermediate_size"] // 3}


def build_qwen3_moe(seed: int = 0, **overrides) -> Qwen3MoeForCausalLM:
    """Qwen3-MoE with its departures on: 6 experts, top 2 renormalized (``norm_topk_prob``), its second layer of three
    dense (``mlp_only_layers``)."""
    return _finish(_built("qwen3_moe", seed, _moe_kwargs(overrides)))


def build_olmoe(seed: int = 0, **overrides) -> OlmoeForCausalLM:
    """OLMoE: 8 experts, top 2 not renormalized (its default), q and k normed over the whole projection."""
    kw = _moe_kwargs(overrides)
    kw.pop("moe_intermediate_size")
    return _finish(_built("olmoe", seed, {**kw, "intermediate_size": kw["intermediate_size"] // 3}))


def build_mixtral(seed: int = 0, **overrides) -> MixtralForCausalLM:
    """Mixtral: 4 experts, the softmax over the top 2 logits, every layer over a sliding window of 7."""
    kw = _moe_kwargs(overrides)
    kw.pop("moe_intermediate_size")
    return _finish(_built("mixtral", seed, {**kw, "intermediate_size": kw["intermediate_size"] // 3}))


_BUILDERS = {"llama": build_llama, "qwen2": build_qwen2, "qwen3": build_qwen3, "mistral": build_mistral}
_TARGET_SEEDS = {"llama": 1234, "qwen2": 4321, "qwen3": 2468, "mistral": 1357}


def build_target(kind: str) -> PreTrainedModel:
    return _BUILDERS[kind](seed=_TARGET_SEEDS[kind])


def perturbed_copy(model: PreTrainedModel, scale: float, seed: int) -> PreTrainedModel:
    """Deepcopy ``model`` and add N(0, (scale * std(param))^2) noise to every parameter."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            std = p.std() if p.numel() > 1 else p.abs().mean()
            if float(std) < 1e-12:
                # constant vectors (RMSNorm weights of ones): perturb relative to their magnitude
                std = p.abs().mean()
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.add_(noise * std * scale)
    return draft


def build_draft(target: PreTrainedModel, target_kind: str, draft_kind: str) -> PreTrainedModel:
    if draft_kind == "identical":
        draft = copy.deepcopy(target)
    elif draft_kind == "unrelated":
        # a different architecture and a smaller size, same vocabulary
        other = "qwen2" if target_kind == "llama" else "llama"
        draft = _BUILDERS[other](
            seed=_TARGET_SEEDS[target_kind] + 777,
            hidden_size=32,
            num_hidden_layers=1,
            intermediate_size=64,
        )
    elif draft_kind == "perturbed":
        draft = perturbed_copy(target, PERTURB_SCALE[target_kind], seed=_TARGET_SEEDS[target_kind] + 99)
    else:  # pragma: no cover - programming error in the tests
        raise KeyError(draft_kind)
    draft.generation_config.eos_token_id = target.generation_config.eos_token_id
    draft.generation_config.pad_token_id = target.generation_config.pad_token_id
    return _finish(draft)


# --------------------------------------------------------------------------------------------------
# greedy helpers (independent of batchspec)


def random_prompts(n: int, seed: int, min_len: int = 1, max_len: int = 50) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


@torch.no_grad()
def greedy_no_eos(model: PreTrainedModel, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """``steps`` greedy tokens after each prompt, generated as one left-padded batch (in float64 the tokens each
    prompt gets alone: the probes of every bundle were checked to be the same)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # [N, width]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [N, width]
    out = model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=steps, min_new_tokens=steps, eos_token_id=None,
        pad_token_id=0,
    )
    return out[:, width:].tolist()


@torch.no_grad()
def teacher_forced_agreement(target: PreTrainedModel, draft: PreTrainedModel, sequences) -> float:
    """Fraction of positions (after the prompt) where draft and target argmax agree."""
    agree = total = 0
    for prompt, cont in sequences:
        ids = torch.tensor([prompt + cont])
        t = target(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
        d = draft(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
        agree += int((t == d).sum())
        total += len(cont)
    return agree / total


def choose_special_ids(target: PreTrainedModel, seed: int) -> tuple[int, int, list]:
    """Deterministically choose (eos_id, pad_id) for ``target``.

    EOS: among tokens whose first occurrence in the greedy continuation (no EOS) is at step
    >= 2 for some probe prompts, pick the one hit by the largest number of prompts while being hit
    by at most ~60% of them (so many sequences still run to max_new_tokens). Pad: a token that the
    target emits (it must be a normal token; pad handling is by length only).
    """
    prompts = random_prompts(N_PROBE_PROMPTS, seed)
    conts = greedy_no_eos(target, prompts, EOS_HORIZON)
    hit = Counter()
    for c in conts:
        first = {}
        for i, t in enumerate(c):
            first.setdefault(t, i)
        for t, i in first.items():
            if i >= 2:
                hit[t] += 1
    # prompts whose continuation contains the token at step 0/1 are counted too (not excluded)
    limit = int(0.6 * len(prompts))
    candidates = sorted(
        (t for t in range(VOCAB_SIZE) if 0 < sum(t in c for c in conts) <= limit and hit[t] >= 3),
        key=lambda t: (-hit[t], t),
    )
    assert candidates, "no usable EOS candidate; change the seed"
    eos = candidates[0]
    counts = Counter(t for c in conts for t in c)
    pad = next(t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if t != eos)
    return eos, pad, list(zip(prompts, conts, strict=True))


@dataclass
class TargetBundle:
    kind: str
    target: PreTrainedModel
    eos_id: int
    pad_id: int
    drafts: dict[str, PreTrainedModel] = field(default_factory=dict)
    probe: list = field(default_factory=list)  # [(prompt, 40-token continuation without EOS)]


def build_bundle(kind: str) -> TargetBundle:
    target = build_target(kind)
    eos, pad, probe = choose_special_ids(target, seed=_TARGET_SEEDS[kind] + 1)
    target.generation_config.eos_token_id = eos
    target.generation_config.pad_token_id = pad
    bundle = TargetBundle(kind=kind, target=target, eos_id=eos, pad_id=pad, probe=probe)
    for dk in DRAFT_KINDS:
        bundle.drafts[dk] = build_draft(target, kind, dk)
    return bundle


def validate_bundle(bundle: TargetBundle) -> dict:
    """Sanity numbers for the fixtures (used by a test and for tuning)."""
    info = {}
    for dk, d in bundle.drafts.items():
        info[f"agree_{dk}"] = teacher_forced_agreement(bundle.target, d, bundle.probe)
    conts = [c for _, c in bundle.probe]
    info["eos_hit_fraction"] = sum(bundle.eos_id in c for c in conts) / len(conts)
    info["distinct_tokens_mean"] = sum(len(set(c)) for c in conts) / len(conts)
    return info


if __name__ == "__main__":  # pragma: no cover - manual tuning aid
    for k in TARGET_KINDS:
        b = build_bundle(k)
        print(k, "eos", b.eos_id, "pad", b.pad_id, validate_bundle(b))
