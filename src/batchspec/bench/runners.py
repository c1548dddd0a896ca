"""How each benchmarked method turns a workload into output sequences.

``autoregressive``, ``eqspec`` and ``exspec`` run through :func:`batchspec.generate`. The peers run the same
prompts through transformers itself: ``hf-generate`` is its batched greedy ``generate`` (left padding and an
attention mask), ``hf-assisted`` its assisted generation with the draft, which works at batch size 1 only.
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
from batchspec.bench.workload import ModelPair, Workload
from batchspec.metrics import GenerationStats

BATCHSPEC_METHODS = ("autoregressive", "eqspec", "exspec")
PEER_METHODS = ("hf-generate", "hf-assisted")
METHODS = BATCHSPEC_METHODS + PEER_METHODS


@dataclass
class RunOutput:
    """New tokens per prompt, the run's stats (batchspec methods only) and its wall seconds."""

    sequences: list[list[int]]
    stats: GenerationStats | None
    wall_s: float


class Runner(Protocol):
    """Runs a method over the workload's prompts at a batch size; ``progress`` shows a bar over prompts."""

    def __call__(self, pair: ModelPair, workload: Workload, batch_size: int, progress: bool = False) -> RunOutput: ...


def _batchspec_runner(method: str) -> Runner:
    def run(pair: ModelPair, workload: Workload, batch_size: int, progress: bool = False) -> RunOutput:
        result = generate(
            pair.target,
            pair.draft,
            [list(p) for p in workload.prompts],
            method=method,
            batch_size=batch_size,
            max_new_tokens=workload.max_new_tokens,
            num_draft_tokens=workload.num_draft_tokens,
            eos_token_id=list(workload.eos_token_ids),
            pad_token_id=workload.pad_token_id,
            progress=progress,
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
def run_hf_generate(pair: ModelPair, workload: Workload, batch_size: int, progress: bool = False) -> RunOutput:
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
def run_hf_assisted(pair: ModelPair, workload: Workload, batch_size: int, progress: bool = False) -> RunOutput:
    """transformers' assisted generation: the draft proposes ``num_draft_tokens`` per round (constant)."""
    if batch_size != 1:
        raise ValueError("hf-assisted runs at batch size 1 only: transformers' assisted generation does not batch")
    if pair.draft is None:
        raise ValueError("hf-assisted needs a draft model")
    device = next(pair.target.parameters()).device
    bar = _prompt_bar("hf-assisted", workload, progress)
    started = time.perf_counter()
    sequences = []
    with _constant_draft_length(pair.draft, workload.num_draft_tokens):
        for prompt in workload.prompts:
            ids = torch.tensor([prompt], device=device)
            out = pair.target.generate(
                ids, attention_mask=torch.ones_like(ids), assistant_model=pair.draft, **greedy_generate_kwargs(workload)
            )
            sequences.append(cut_after_eos(out[0, len(prompt) :].tolist(), workload.eos_token_ids))
            bar.update(1)
    wall_s = time.perf_counter() - started
    bar.close()
    return RunOutput(sequences, None, wall_s)


def _prompt_bar(method: str, workload: Workload, progress: bool) -> tqdm:
    return tqdm(total=len(workload.prompts), desc=method, unit="prompt", disable=not progress)


@contextmanager
def _constant_draft_length(draft: torch.nn.Module, k: int) -> Iterator[None]:
    """Make transformers' assistant draft exactly ``k`` tokens per round. Its candidate generator reads these
    settings from the assistant's own generation config (the target's ``generate`` arguments do not reach it);
    the defaults adapt the draft length and stop drafting below a confidence threshold."""
    config = draft.generation_config
    settings = {"num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0}
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
}


def runner_for(method: str) -> Runner:
    try:
        return RUNNERS[method]
    except KeyError:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(RUNNERS)}") from None


def needs_draft(method: str) -> bool:
    return method not in ("autoregressive", "hf-generate")


def draft_length(method: str, num_draft_tokens: int | None) -> int | None:
    """The draft length a method ran with: None for the methods that do not draft (or when not recorded)."""
    return num_draft_tokens if needs_draft(method) else None
