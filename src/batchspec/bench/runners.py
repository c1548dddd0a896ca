"""How each benchmarked method turns a workload into output sequences.

``autoregressive``, ``eqspec`` and ``exspec`` run through :func:`batchspec.generate` (the speculative ones with a
proposer: ``draft``, ``ngram`` or ``hybrid``). The peers run the same prompts through transformers itself:
``hf-generate`` is its batched greedy ``generate`` (left padding and an attention mask), ``hf-assisted`` its
assisted generation with the draft and ``hf-prompt-lookup`` its prompt lookup decoding
(``prompt_lookup_num_tokens``), both at batch size 1 only. With ``k = "auto"`` the peers keep transformers' own
defaults: the assistant's adaptive schedule, and 10 lookup tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from tqdm.auto import tqdm

from batchspec.api import generate
from batchspec.bench.workload import Workload
from batchspec.config import AUTO, Method, ProposerKind, uses_draft_model
from batchspec.engine import GenerationStats
from batchspec.models.pair import ModelPair

BATCHSPEC_METHODS = tuple(m.value for m in Method)
SPECULATIVE = (Method.EQSPEC.value, Method.EXSPEC.value)
PEER_METHODS = ("hf-generate", "hf-assisted", "hf-prompt-lookup")
SINGLE_ROW = ("hf-assisted", "hf-prompt-lookup")
METHODS = BATCHSPEC_METHODS + PEER_METHODS
HF_LOOKUP_TOKENS = 10


@dataclass
class RunOutput:
    """New tokens per prompt, the run's stats (batchspec methods only) and its wall seconds."""

    sequences: list[list[int]]
    stats: GenerationStats | None
    wall_s: float


class Runner(Protocol):
    """Runs a method (with ``proposer`` for the speculative batchspec methods) over the workload's prompts at a
    batch size; ``progress`` shows a bar over prompts."""

    def __call__(
        self, pair: ModelPair, workload: Workload, batch_size: int, progress: bool = False, proposer: str | None = None
    ) -> RunOutput: ...


def _batchspec_runner(method: str) -> Runner:
    def run(
        pair: ModelPair, workload: Workload, batch_size: int, progress: bool = False, proposer: str | None = None
    ) -> RunOutput:
        result = generate(
            pair.target,
            None if proposer == ProposerKind.NGRAM else pair.draft,
            [list(p) for p in workload.prompts],
            method=method,
            proposer=proposer if method in SPECULATIVE else None,
            batch_size=batch_size,
            max_new_tokens=workload.max_new_tokens,
            num_draft_tokens=workload.num_draft_tokens,
            eos_token_id=list(workload.eos_token_ids),
            pad_token_id=workload.pad_token_id,
            progress=progress,
            prefix_cache_size=workload.prefix_cache_size,
        )
        return RunOutput(result.sequences, result.stats, result.stats.wall_s)

    return run


def cut_after_eos(tokens: list[int], eos_token_ids: tuple[int, ...]) -> list[int]:
    """``tokens`` up to and including the first EOS."""
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[: i + 1]
    return tokens


def greedy_generate_kwargs(workload: Workload) -> dict:
    return dict(
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        max_new_tokens=workload.max_new_tokens,
        eos_token_id=list(workload.eos_token_ids) or None,
        pad_token_id=workload.pad_token_id,
    )


@torch.inference_mode()
def run_hf_generate(
    pair: ModelPair, workload: Workload, batch_size: int, progress: bool = False, proposer: str | None = None
) -> RunOutput:
    """transformers' batched greedy ``generate`` over consecutive batches of left-padded prompts."""
    device = next(pair.target.parameters()).device
    bar = _prompt_bar("hf-generate", workload, progress)
    started = time.perf_counter()
    sequences = []
    for start in range(0, len(workload.prompts), batch_size):
        chunk = workload.prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), workload.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(chunk):
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        out = pair.target.generate(ids.to(device), attention_mask=mask.to(device), **greedy_generate_kwargs(workload))
        sequences += [cut_after_eos(row[width:].tolist(), workload.eos_token_ids) for row in out]
        bar.update(len(chunk))
    wall_s = time.perf_counter() - started
    bar.close()
    return RunOutput(sequences, None, wall_s)


@torch.inference_mode()
def run_hf_assisted(
    pair: ModelPair, workload: Workload, batch_size: int, progress: bool = False, proposer: str | None = None
) -> RunOutput:
    """transformers' assisted generation: the draft proposes ``num_draft_tokens`` per round (constant), or with
    ``"auto"`` as many as transformers' own heuristic schedule chooses."""
    if pair.draft is None:
        raise ValueError("hf-assisted needs a draft model")
    k = workload.num_draft_tokens
    with _assistant_settings(pair.draft, None if k == AUTO else k):
        return _one_prompt_at_a_time("hf-assisted", pair, workload, batch_size, progress, assistant_model=pair.draft)


@torch.inference_mode()
def run_hf_prompt_lookup(
    pair: ModelPair, workload: Workload, batch_size: int, progress: bool = False, proposer: str | None = None
) -> RunOutput:
    """transformers' prompt lookup decoding: ``num_draft_tokens`` lookup tokens per round (10 for ``"auto"``)."""
    k = workload.num_draft_tokens
    tokens = HF_LOOKUP_TOKENS if k == AUTO else k
    return _one_prompt_at_a_time(
        "hf-prompt-lookup", pair, workload, batch_size, progress, prompt_lookup_num_tokens=tokens
    )


def _one_prompt_at_a_time(method: str, pair: ModelPair, workload: Workload, batch_size: int, progress: bool,
                          **extra) -> RunOutput:
    if batch_size != 1:
        raise ValueError(f"{method} runs at batch size 1 only: transformers' {method[3:]} does not batch")
    device = next(pair.target.parameters()).device
    bar = _prompt_bar(method, workload, progress)
    started = time.perf_counter()
    sequences = []
    for prompt in workload.prompts:
        ids = torch.tensor([prompt], device=device)
        mask = torch.ones_like(ids)
        out = pair.target.generate(ids, attention_mask=mask, **extra, **greedy_generate_kwargs(workload))
        sequences.append(cut_after_eos(out[0, len(prompt) :].tolist(), workload.eos_token_ids))
        bar.update(1)
    wall_s = time.perf_counter() - started
    bar.close()
    return RunOutput(sequences, None, wall_s)


def _prompt_bar(method: str, workload: Workload, progress: bool) -> tqdm:
    return tqdm(total=len(workload.prompts), desc=method, unit="prompt", disable=not progress)


@contextmanager
def _assistant_settings(draft: torch.nn.Module, k: int | None) -> Iterator[None]:
    """Make transformers' assistant draft exactly ``k`` tokens per round, or (None) use transformers' defaults: up
    to 20 tokens, stopping early below a confidence threshold of 0.4 (transformers' own adaptive draft length).
    Its candidate generator reads these settings from the assistant's own generation config (the target's
    ``generate`` arguments do not reach it)."""
    config = draft.generation_config
    settings = {"num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0}
    if k is None:
        settings = {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
                    "assistant_confidence_threshold": 0.4}
    saved = {name: getattr(config, name, None) for name in settings}
    for name, value in settings.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


RUNNERS: dict[str, Runner] = {
    **{method: _batchspec_runner(method) for method in BATCHSPEC_METHODS},
    "hf-generate": run_hf_generate,
    "hf-assisted": run_hf_assisted,
    "hf-prompt-lookup": run_hf_prompt_lookup,
}


def runner_for(method: str) -> Runner:
    try:
        return RUNNERS[method]
    except KeyError:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(RUNNERS)}") from None


Where = tuple[str, str | None, int]  # (method, proposer, batch size)


def plan_cells(methods: tuple[str, ...], proposers: tuple[str, ...], batch_sizes: tuple[int, ...]) -> list[Where]:
    """Every (method, proposer, batch size) asked for: the speculative batchspec methods once per proposer, the
    others with proposer None. The batch size is the outer loop, so that the cells compared at one batch size run one
    after another: the host's read bandwidth drifts from minute to minute, and cells compared across other batch
    sizes' cells see different hosts."""
    return [(m, p, b) for b in batch_sizes for m in methods for p in (proposers if m in SPECULATIVE else (None,))]


def runs(where: Where) -> bool:
    """The cell can run: the single-row peers run at batch size 1 only."""
    method, _, batch_size = where
    return method not in SINGLE_ROW or batch_size == 1


def proposes(method: str) -> bool:
    """The method proposes drafts (a draft length applies to it)."""
    return method in SPECULATIVE or method in SINGLE_ROW


def needs_draft(method: str, proposer: str | None = None) -> bool:
    """The method, with ``proposer`` (batchspec's methods: the draft model's when None), runs a draft model."""
    if method in SPECULATIVE:
        return uses_draft_model(Method(method), ProposerKind(proposer or ProposerKind.DRAFT))
    return method == "hf-assisted"


def draft_length(method: str, num_draft_tokens: int | str | None) -> int | str | None:
    """The draft length a method ran with: None for the methods that do not draft (or when not recorded)."""
    return num_draft_tokens if proposes(method) else None
