"""The public entry point, ``batchspec.generate``."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from batchspec.config import SpecConfig
from batchspec.engine import Engine
from batchspec.metrics import GenerationStats, StageTimer
from batchspec.models.support import check_pair, vocab_size
from batchspec.sampling import SamplingParams, derive_row_seeds
from batchspec.schedulers import run_exspec, run_static_batches
from batchspec.state import FINISH_LENGTH, Sequence


@dataclass
class GenerationResult:
    """What ``generate`` returns.

    Attributes:
        sequences: new tokens of each prompt, in prompt order, ending right after the first EOS or at
            ``max_new_tokens``.
        finish_reasons: ``"eos"`` or ``"length"`` for each prompt.
        stats: counters and timings of the run.
        texts: the decoded sequences when a tokenizer was given, else None.
    """

    sequences: list[list[int]]
    finish_reasons: list[str]
    stats: GenerationStats
    texts: list[str] | None = None


def generate(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    prompts: Seq[Seq[int]] | Seq[str],
    *,
    method: str = "eqspec",
    batch_size: int = 8,
    max_new_tokens: int = 128,
    num_draft_tokens: int = 5,
    eos_token_id: int | Seq[int] | None = None,
    pad_token_id: int | None = None,
    window_size: int | None = None,
    sort_by_length: bool = True,
    tokenizer=None,
    check_invariants: bool = False,
    timing: bool = True,
    progress: bool = False,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | Seq[int] | None = None,
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
        draft: a smaller causal LM with the same vocabulary on the same device; ignored (may be None) for
            ``method="autoregressive"``.
        prompts: token-id lists, or strings when ``tokenizer`` is given (encoded without a chat template).
        method: ``"eqspec"`` (speculative, fixed batches, unpad–append–repad every round), ``"exspec"``
            (speculative, batches formed every round from a window of sequences, grouped by length) or
            ``"autoregressive"`` (the target alone).
        batch_size: rows decoded together.
        max_new_tokens: new tokens per prompt at most.
        num_draft_tokens: draft tokens ``k`` proposed per round.
        eos_token_id: id or ids that end a sequence; default ``target.generation_config.eos_token_id``.
        pad_token_id: filler for padding columns; padding itself is tracked by lengths.
        window_size: exspec only: sequences active at once, ``>= batch_size``; default ``4 * batch_size``.
        sort_by_length: exspec only: admit prompts into the window shortest first (more same-length groups).
        tokenizer: encodes string prompts and decodes ``result.texts``.
        check_invariants: check I1, I2 and both caches after every round (slower; for tests and debugging).
        timing: split wall time into draft / verify / realign / other.
        progress: show a progress bar over prompts.
        temperature: 0 for greedy decoding; > 0 samples from the target's logits divided by it.
        top_k: sampling only: keep the ``top_k`` most probable tokens.
        top_p: sampling only: keep the smallest set of most probable tokens with mass at least ``top_p``.
        seed: sampling only: an int (prompt ``i`` gets a seed derived from it and ``i``), one int in
            ``[0, 2**63)`` per prompt, or None for fresh random seeds.
    """
    config = SpecConfig(
        method=method,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        num_draft_tokens=num_draft_tokens,
        eos_token_ids=_eos_ids(target, eos_token_id),
        pad_token_id=_pad_id(target, pad_token_id),
        window_size=window_size,
        sort_by_length=sort_by_length,
        check_invariants=check_invariants,
        timing=timing,
        sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
    )
    check_pair(target, draft if config.speculative else None)
    if config.speculative and draft is None:
        raise ValueError(f"draft is required for method={method!r}; pass a draft model or use 'autoregressive'")
    token_prompts = _encode_prompts(prompts, tokenizer, vocab_size(target))
    seeds = derive_row_seeds(seed, len(token_prompts))
    sequences = [
        Sequence(i, p, max_new_tokens, sampling=config.sampling, seed=s)
        for i, (p, s) in enumerate(zip(token_prompts, seeds, strict=True))
    ]
    stats = GenerationStats()
    _decode(target, draft, config, sequences, stats, progress)
    texts = None if tokenizer is None else [tokenizer.decode(s.output) for s in sequences]
    return GenerationResult(
        sequences=[s.output for s in sequences],
        finish_reasons=[s.finish_reason or FINISH_LENGTH for s in sequences],
        stats=stats,
        texts=texts,
    )


def _decode(target, draft, config: SpecConfig, sequences: list[Sequence], stats: GenerationStats, progress) -> None:
    device = next(target.parameters()).device
    timer = StageTimer(stats, enabled=config.timing, device=device)
    todo = [s for s in sequences if s.max_new_tokens > 0]
    for s in sequences:
        if s.max_new_tokens == 0:
            s.finish_reason = FINISH_LENGTH
    engine = Engine(target, draft, config, stats, timer)
    bar = tqdm(total=len(todo), desc=config.method, unit="prompt", disable=not progress)
    with bar, torch.inference_mode(), timer.wall():
        if config.method == "exspec":
            run_exspec(engine, todo, bar.update, check=config.check_invariants)
        else:
            run_static_batches(engine, todo, bar.update)


def _eos_ids(target: torch.nn.Module, eos_token_id: int | Seq[int] | None) -> tuple[int, ...]:
    if eos_token_id is None:
        generation_config = getattr(target, "generation_config", None)
        eos_token_id = getattr(generation_config, "eos_token_id", None)
    if eos_token_id is None:
        return ()
    if isinstance(eos_token_id, int):
        return (eos_token_id,)
    return tuple(eos_token_id)


def _pad_id(target: torch.nn.Module, pad_token_id: int | None) -> int:
    if pad_token_id is not None:
        return pad_token_id
    generation_config = getattr(target, "generation_config", None)
    for candidate in (getattr(generation_config, "pad_token_id", None), getattr(target.config, "pad_token_id", None)):
        if isinstance(candidate, int):
            return candidate
    return 0


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
