"""The public entry point, ``batchspec.generate``."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, fields
from typing import Any

import torch
from tqdm.auto import tqdm

from batchspec.config import DEFAULT_MAX_NEW_TOKENS, SamplingParams, SpecConfig, setting_default
from batchspec.engine import (
    FINISH_LENGTH,
    Engine,
    GenerationParams,
    GenerationStats,
    Grammar,
    Offline,
    Penalties,
    Sequence,
    TokenLogprob,
    bridge_of,
    check_budget,
    derive_row_seeds,
    drive,
    make_scheduler,
)
from batchspec.families import context_limit
from batchspec.model_checks import vocab_size
from batchspec.run import RunConfig, build_run, resolve_loaded


@dataclass
class GenerationResult:
    """What ``generate`` returns.

    Attributes:
        sequences: new tokens of each prompt, in prompt order, ending right after the first EOS or at
            ``max_new_tokens``.
        finish_reasons: ``"eos"`` or ``"length"`` for each prompt.
        stats: counters and timings of the run.
        texts: the decoded sequences when a tokenizer was given, else None.
        logprobs: with ``logprobs=n``, each sequence's tokens with their logprobs, else None.
        prompt_logprobs: with ``prompt_logprobs=n``, each prompt's tokens after the first with their logprobs,
            else None.
    """

    sequences: list[list[int]]
    finish_reasons: list[str]
    stats: GenerationStats
    texts: list[str] | None = None
    logprobs: list[list[TokenLogprob]] | None = None
    prompt_logprobs: list[list[TokenLogprob]] | None = None


def generate(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    prompts: Seq[Seq[int]] | Seq[str],
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    eos_token_id: int | Seq[int] | None = None,
    tokenizer=None,
    progress: bool = False,
    temperature: float = setting_default("temperature"),
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | Seq[int] | None = None,
    penalties: Penalties | None = None,
    grammar: Grammar | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    **options: Any,
) -> GenerationResult:
    """Generation with ``target``, batched, optionally sped up by speculative decoding with ``draft``.

    Greedy (``temperature=0``): every method returns, for each prompt, the tokens the target's own greedy decoding
    of that prompt alone would return: exactly, for models in float32 (or float64), as the tests and the audit
    check; for half-precision models (bfloat16, float16) up to near-ties, positions where the target's two best
    logits are within a few rounding steps and a batched forward may round the other way (see
    :mod:`batchspec.bench.audit`). Load models with ``batchspec.models.load_pair`` (float32 on the CPU by default)
    or pass ``dtype=torch.float32`` to transformers' ``from_pretrained``. Sampling (``temperature > 0``):
    each token is distributed as the target's own warped next-token distribution (lossless speculative sampling),
    and a prompt's tokens depend only on the prompt, its seed, the sampling settings and the two models, never on
    the batch, the method's batching or ``num_draft_tokens``.

    Args:
        target: a loaded transformers causal LM (Llama, Mistral, Qwen2 or Qwen3 family).
        draft: a smaller causal LM with the same vocabulary on the same device; None drafts by prompt lookup
            (``proposer="ngram"``); ignored for ``method="autoregressive"`` and ``proposer="ngram"``.
        prompts: token-id lists, or strings when ``tokenizer`` is given (encoded without a chat template).
        max_new_tokens: new tokens per prompt at most.
        eos_token_id: id or ids that end a sequence; default ``target.generation_config.eos_token_id``.
        tokenizer: encodes string prompts and decodes ``result.texts``.
        progress: show a progress bar over prompts.
        temperature: 0 for greedy decoding; > 0 samples from the target's logits divided by it.
        top_k: sampling only: keep the ``top_k`` most probable tokens.
        top_p: sampling only: keep the smallest set of most probable tokens with mass at least ``top_p``.
        seed: sampling only: an int (prompt ``i`` gets a seed derived from it and ``i``), one int in
            ``[0, 2**63)`` per prompt, or None for fresh random seeds.
        penalties: presence, frequency and repetition penalties and a logit bias, applied to the target's
            distribution at every verified position (:mod:`batchspec.engine.shaping`); greedy output is then the
            penalised greedy output and sampling follows the penalised distribution.
        grammar: every output follows it (``batchspec.engine.grammar.GrammarCompiler`` makes one from a JSON schema
            or a Lark grammar).
        logprobs: report each output token's logprob under the target and its ``logprobs`` most probable
            alternatives (0 .. 20) in ``result.logprobs``.
        prompt_logprobs: likewise for every prompt token after the first (given the tokens before it), in
            ``result.prompt_logprobs``; each prompt is then read once more, on its own (scoring a prompt's
            likelihood: ``max_new_tokens=0`` reads it only for this).
        **options: the run's settings, the fields of :class:`~batchspec.config.SpecConfig`, where each is declared
            once with its default, help and check: ``method``, ``batch_size``, ``num_draft_tokens``, ``proposer``,
            ``max_draft_tokens``, ``draft_vocabulary``, ``ngram_min``, ``ngram_max``, ``pad_token_id``, ``window_size``,
            ``sort_by_length``, ``check_invariants``, ``timing``, ``cuda_graphs`` and ``prefix_cache_size``
            (docs/api.md); any other name is a TypeError.
    """
    check_budget(max_new_tokens)  # before anything is built, and for an empty prompt list (no Sequence) too
    run = resolve_loaded(settings(options, eos_token_id), target, draft)
    return generate_with(
        target, draft, prompts, run, max_new_tokens=max_new_tokens, tokenizer=tokenizer,
        progress=progress, sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), seed=seed,
        penalties=penalties, grammar=grammar, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
    )


def generate_with(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    prompts: Seq[Seq[int]] | Seq[str],
    run: RunConfig,
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    tokenizer=None,
    progress: bool = False,
    sampling: SamplingParams | None = None,
    seed: int | Seq[int] | None = None,
    penalties: Penalties | None = None,
    grammar: Grammar | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> GenerationResult:
    """:func:`generate` with the run's settings as the record its entry made (``run``: :mod:`batchspec.run`, the
    engine's settings with EOS ids, the proposer and the graph mode) and the sampling settings as one: what the
    commands, Ray's predictor and the transformers adapter call, so a record is never taken apart into keywords to
    be built again (``sampling``: greedy where None)."""
    check_budget(max_new_tokens)
    sampling = sampling or SamplingParams()
    engine = build_run(run, target, draft)
    token_prompts = _encode_prompts(prompts, tokenizer, vocab_size(target))
    _check_context([target, None if bridge_of(draft) else draft], token_prompts, max_new_tokens)
    seeds = derive_row_seeds(seed, len(token_prompts))
    requests = [
        GenerationParams(prompt=p, max_tokens=max_new_tokens, sampling=sampling, penalties=penalties or Penalties(),
                         grammar=grammar, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        for p in token_prompts
    ]
    sequences = [request.sequence(i, s) for i, (request, s) in enumerate(zip(requests, seeds, strict=True))]
    _decode(engine, sequences, progress)
    texts = None if tokenizer is None else [tokenizer.decode(s.output) for s in sequences]
    return GenerationResult(
        sequences=[s.output for s in sequences],
        finish_reasons=[s.finish_reason or FINISH_LENGTH for s in sequences],
        stats=engine.stats,
        texts=texts,
        logprobs=None if logprobs is None else [s.token_logprobs for s in sequences],
        prompt_logprobs=None if prompt_logprobs is None else [s.prompt_token_logprobs for s in sequences],
    )


def _check_context(models: list[torch.nn.Module | None], prompts: list[list[int]], max_new_tokens: int) -> None:
    """Raise ValueError where a prompt and its ``max_new_tokens`` do not fit in the positions a model's family bounds
    them to (:func:`~batchspec.families.context_limit`: Phi-3's LongRoPE, past whose original length no batched
    decoding equals transformers' generate)."""
    for model in models:
        limit = None if model is None else context_limit(model.config)
        for i, prompt in enumerate(prompts if limit is not None else []):
            if len(prompt) + max_new_tokens > limit:
                raise ValueError(
                    f"prompts[{i}] ({len(prompt)} tokens) and max_new_tokens={max_new_tokens} take more than the "
                    f"{limit} positions {type(model).__name__} is decoded at exactly (its family's bound: "
                    "batchspec.families.context_limit)")


def _decode(engine: Engine, sequences: list[Sequence], progress: bool) -> None:
    """Queue every sequence with a budget and drive the method's scheduler until all are done."""
    scheduler = make_scheduler(engine.config)
    for row in sequences:
        if row.max_new_tokens == 0:
            row.finish_reason = FINISH_LENGTH
            with torch.inference_mode():
                engine.score_prompt(row)
        else:
            scheduler.add(row)
    queued = scheduler.waiting + scheduler.running
    bar = tqdm(total=queued, desc=engine.config.method.value, unit="prompt", disable=not progress)
    with bar, torch.inference_mode():
        drive(engine, scheduler, Offline(bar.update))


def settings(options: dict[str, Any], eos_token_id: int | Seq[int] | None) -> SpecConfig:
    """The run's :class:`SpecConfig` of ``generate``'s ``**options`` (checked against its fields) and EOS ids."""
    unknown = sorted(set(options) - {spec.name for spec in fields(SpecConfig)})
    if unknown:
        raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}")
    if eos_token_id is not None:
        options = {**options, "eos_token_ids": _as_tuple(eos_token_id)}
    return SpecConfig(**options)


def _as_tuple(eos_token_id: int | Seq[int]) -> tuple[int, ...]:
    return (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)


def _encode_prompts(prompts, tokenizer, vocab: int) -> list[list[int]]:
    """Validate prompts (non-empty lists of in-vocabulary ids), encoding strings with ``tokenizer``."""
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Seq):
        raise ValueError("prompts must be a list of token-id lists (or of strings with tokenizer=...)")
    encoded = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"prompts[{i}] is a string; pass tokenizer=... to encode string prompts")
            prompt = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        ids = [int(t) for t in prompt] if isinstance(prompt, Seq) and not isinstance(prompt, str) else None
        if ids is None:
            raise ValueError(f"prompts[{i}] must be a list of token ids; got {type(prompt).__name__}")
        if not ids:
            raise ValueError(f"prompts[{i}] is an empty prompt; every prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompts[{i}] has token id {bad[0]} outside the target vocabulary [0, {vocab})")
        encoded.append(ids)
    return encoded
