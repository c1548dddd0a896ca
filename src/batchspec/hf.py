"""``batchspec.hf_generate``: ``model.generate``'s call shape, batched speculative decoding underneath.

transformers' assisted generation (``model.generate(..., assistant_model=draft)`` or
``prompt_lookup_num_tokens=...``) refuses a batch of more than one row. :func:`hf_generate` takes the same
arguments, a padded batch as a tokenizer returns it and a ``GenerationConfig`` plus keyword overrides, runs
:func:`batchspec.generate` on each row's real tokens and returns what ``model.generate`` returns for greedy
decoding: one ``LongTensor`` holding the prompt exactly as given followed by the new tokens, rows that
ended early filled with ``pad_token_id``.

The configuration is resolved as transformers 5.x resolves it: the given ``generation_config`` (else an empty
one), then every field it leaves unset taken from ``model.generation_config``, then the keyword arguments on
top, then transformers' defaults for what is still unset. Fields that would change the output and that
batchspec does not implement (beam search, repetition penalty, logits processors, ...) raise a ``ValueError``
naming them instead of being ignored.
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from batchspec.api import generate_with
from batchspec.config import SEED_LIMIT, SamplingParams, SpecConfig
from batchspec.run import resolve_loaded

SUPPORTED_FIELDS = frozenset({
    "max_new_tokens", "max_length", "eos_token_id", "pad_token_id", "do_sample", "temperature", "top_k", "top_p",
    "num_assistant_tokens", "prompt_lookup_num_tokens",
})
# Fields that do not change which tokens come out: metadata, cache and compilation choices, and the knobs of
# transformers' own draft-length schedule (batchspec drafts a constant num_assistant_tokens per round).
NO_EFFECT_FIELDS = frozenset({
    "_from_model_config", "transformers_version", "bos_token_id", "decoder_start_token_id", "is_assistant",
    "use_cache", "cache_implementation", "cache_config", "max_cache_len", "prefill_chunk_size", "compile_config",
    "disable_compile", "continuous_batching_config", "low_memory", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind", "max_matching_ngram_size",
    "early_stopping", "length_penalty",
})
# Sampling warpers other than temperature, top-k and top-p: transformers applies them only with do_sample=True.
SAMPLING_ONLY_FIELDS = frozenset({"typical_p", "epsilon_cutoff", "eta_cutoff", "min_p", "top_h"})
# The value that switches a field off, where it is not None (or an empty list).
NEUTRAL_VALUES: dict[str, object] = {
    "min_length": 0, "min_new_tokens": 0, "num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0,
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "num_return_sequences": 1, "output_attentions": False,
    "output_hidden_states": False, "output_scores": False, "output_logits": False, "return_dict_in_generate": False,
    "renormalize_logits": False, "remove_invalid_values": False, "token_healing": False, "guidance_scale": 1.0,
    "use_mtp": False, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
}
# transformers' defaults for the supported fields still unset after the merge (GenerationConfig's globals).
TRANSFORMERS_DEFAULTS: dict[str, object] = {
    "max_length": 20, "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
}
DEFAULT_NUM_ASSISTANT_TOKENS = 5


@dataclass(frozen=True)
class GenerateCall:
    """The ``batchspec.generate`` call that one ``hf_generate`` call makes: the draft, the budget and sampling of
    every row, and the run's settings (method, drafting, batch size, EOS and padding)."""

    draft: torch.nn.Module | None
    max_new_tokens: int
    sampling: SamplingParams
    seed: list[int] | None
    settings: SpecConfig



def hf_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    assistant_model: torch.nn.Module | None = None,
    generation_config: GenerationConfig | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``model.generate(input_ids, attention_mask=..., assistant_model=..., ...)`` for a whole batch at once.

    Args:
        model: the target, a causal LM batchspec supports (Llama, Mistral, Qwen2, Qwen3 families).
        input_ids: ``[B, T]`` prompt ids, left- or right-padded.
        attention_mask: ``[B, T]``, 1 on each row's real tokens; None means every token is real (padding is
            never guessed from token values).
        assistant_model: a draft sharing the target's vocabulary; its tokens are verified so that the output is
            the target's own.
        generation_config: as for ``model.generate``; unset fields come from ``model.generation_config``.
        **kwargs: generation config fields, overriding ``generation_config`` as in ``model.generate``.

    Returns:
        ``[B, T + N]`` LongTensor on ``input_ids``' device: ``input_ids`` as given, then each row's new tokens
        (``N`` the most any row generated), filled with ``pad_token_id`` after a row's EOS.
    """
    config, unused = resolve_generation_config(model, generation_config, kwargs)
    check_supported(config, unused)
    prompts = real_tokens(input_ids, attention_mask)
    call = plan_call(config, assistant_model, len(prompts), input_ids.shape[1])
    run = resolve_loaded(call.settings, model, call.draft)
    result = generate_with(model, call.draft, prompts, run, max_new_tokens=call.max_new_tokens,
                           sampling=call.sampling, seed=call.seed)
    return assemble(input_ids, result.sequences, call.settings.pad_token_id)


def resolve_generation_config(
    model: torch.nn.Module, generation_config: GenerationConfig | None, overrides: dict[str, Any]
) -> tuple[GenerationConfig, dict[str, Any]]:
    """The config ``model.generate`` would use, and the overrides that are no config field.

    The given config (else an empty one), every field it leaves unset from ``model.generation_config``, then
    ``overrides``, then transformers' defaults for what is still unset. The second value holds the overrides
    ``model.generate`` would take as logits processors, streamers or model inputs.
    """
    config = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    model_config = getattr(model, "generation_config", None)
    if model_config is not None:
        config.update(**model_config.to_dict(), defaults_only=True)
    unused = config.update(**overrides)
    config.update(**TRANSFORMERS_DEFAULTS, defaults_only=True)
    return config, unused


def check_supported(config: GenerationConfig, unused: dict[str, Any]) -> None:
    """Raise a ValueError naming every argument and set field that would change the output and batchspec lacks."""
    arguments = sorted(name for name, value in unused.items() if value is not None)
    fields = [
        f"{name}={value!r}"
        for name, value in sorted(config.to_dict().items())
        if name not in SUPPORTED_FIELDS | NO_EFFECT_FIELDS
        and not (name in SAMPLING_ONLY_FIELDS and not config.do_sample)
        and not _is_neutral(name, value)
    ]
    if arguments or fields:
        raise ValueError(
            f"hf_generate does not support {', '.join(arguments + fields)}: batchspec decodes greedily or samples "
            "with temperature, top_k and top_p, and takes no logits processors, stopping criteria, streamers or "
            "extra model inputs (leave these unset or at their defaults)"
        )


def _is_neutral(name: str, value: object) -> bool:
    if value is None or (isinstance(value, Collection) and not isinstance(value, str) and len(value) == 0):
        return True
    return name in NEUTRAL_VALUES and value == NEUTRAL_VALUES[name]


def real_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's real tokens, in order: where ``attention_mask`` is 1, whichever side the padding is on."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        raise ValueError("input_ids must be a [batch, length] integer tensor, as a tokenizer returns it")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)  # [B, T]
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, "
                         f"input_ids {tuple(input_ids.shape)}; they must match")
    mask = attention_mask.cpu()  # [B, T]
    if not torch.isin(mask, torch.tensor([0, 1], dtype=mask.dtype)).all():
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token)")
    rows = [ids[m.bool()].tolist() for ids, m in zip(input_ids.cpu(), mask, strict=True)]
    empty = [i for i, row in enumerate(rows) if not row]
    if empty:
        raise ValueError(f"row {empty[0]} of attention_mask has no real token; every prompt needs at least one")
    return rows


def plan_call(config: GenerationConfig, assistant_model: torch.nn.Module | None, rows: int, width: int) -> GenerateCall:
    """How to run ``config`` with batchspec: the method and drafter, the budget, EOS, padding and sampling."""
    eos = _eos_ids(config.eos_token_id)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    sampling, seed = _sampling(config, rows)
    method, proposer, k = _drafting(config, assistant_model)
    settings = SpecConfig(method=method, proposer=proposer, batch_size=rows, num_draft_tokens=k,
                          eos_token_ids=tuple(eos), pad_token_id=int(pad))
    return GenerateCall(draft=assistant_model, max_new_tokens=_budget(config, width), sampling=sampling, seed=seed,
                        settings=settings)


def _eos_ids(eos_token_id: int | list[int] | torch.Tensor | None) -> list[int]:
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor):
        return [int(t) for t in eos_token_id.flatten()]
    if isinstance(eos_token_id, int):
        return [eos_token_id]
    return [int(t) for t in eos_token_id]


def _budget(config: GenerationConfig, width: int) -> int:
    """New tokens per row: ``max_new_tokens``, else ``max_length`` minus the padded prompt width (as transformers)."""
    if config.max_new_tokens is not None:
        return config.max_new_tokens
    if config.max_length <= width:
        raise ValueError(f"max_length {config.max_length} leaves no room after the input length {width}; "
                         "increase max_length or set max_new_tokens")
    return config.max_length - width


def _sampling(config: GenerationConfig, rows: int) -> tuple[SamplingParams, list[int] | None]:
    """Greedy unless ``do_sample``; seeds drawn from torch's global generator, so ``torch.manual_seed`` repeats."""
    if not config.do_sample:
        return SamplingParams(), None
    if config.temperature is None or config.temperature <= 0:
        raise ValueError(f"temperature must be a strictly positive float with do_sample=True; got {config.temperature}")
    top_k = config.top_k if config.top_k else None
    top_p = config.top_p if config.top_p is not None and config.top_p < 1 else None
    seeds = torch.randint(0, SEED_LIMIT - 1, (rows,), dtype=torch.int64).tolist()
    return SamplingParams(temperature=float(config.temperature), top_k=top_k, top_p=top_p), seeds


def _drafting(config: GenerationConfig, assistant_model: torch.nn.Module | None) -> tuple[str, str | None, int]:
    """``(method, proposer, k)``: EqSpec with the assistant, EqSpec with n-gram drafts, or the target alone."""
    lookup = config.prompt_lookup_num_tokens
    if lookup is not None and assistant_model is not None:
        raise ValueError("pass either assistant_model or prompt_lookup_num_tokens, not both")
    if lookup is not None:
        return "eqspec", "ngram", int(lookup)
    if assistant_model is None:
        return "autoregressive", None, 1
    k = config.num_assistant_tokens
    assistant_config = getattr(assistant_model, "generation_config", None)
    if k is None and assistant_config is not None:
        k = assistant_config.num_assistant_tokens
    return "eqspec", None, int(k) if k is not None else DEFAULT_NUM_ASSISTANT_TOKENS


def assemble(input_ids: torch.Tensor, new_tokens: list[list[int]], pad_token_id: int) -> torch.Tensor:
    """``[B, T + N]``: ``input_ids`` ``[B, T]`` as given, each row's new tokens after it, then ``pad_token_id``."""
    rows, width = input_ids.shape
    longest = max((len(tokens) for tokens in new_tokens), default=0)
    out = torch.full((rows, width + longest), pad_token_id, dtype=torch.long, device=input_ids.device)  # [B, T+N]
    out[:, :width] = input_ids
    for i, tokens in enumerate(new_tokens):
        out[i, width : width + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return out
