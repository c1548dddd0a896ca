"""The reference every method is compared with: the target alone, greedy, one prompt at a time.

It runs transformers' own ``generate`` at batch size 1 (no padding, its own cache), independent of batchspec's
machinery, and keeps the reference's margin between its two highest logits at every generated position: a
divergence where that margin is tiny is a numerical near-tie, one where it is large is a bug.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from batchspec.bench.runners import cut_after_eos, greedy_generate_kwargs
from batchspec.bench.workload import Workload
from batchspec.models.pair import ModelPair


@dataclass
class Reference:
    """Reference outputs of a workload.

    Attributes:
        key: the workload's key (model, dtype, prompts, budget, EOS).
        sequences: new tokens of each prompt.
        margins: per prompt and generated position, top-1 minus top-2 logit of the reference.
        top_logits: per prompt and position, the top-1 logit (whose magnitude sets the dtype's spacing there).
    """

    key: str
    sequences: list[list[int]]
    margins: list[list[float]]
    top_logits: list[list[float]]


@torch.inference_mode()
def compute_reference(pair: ModelPair, workload: Workload, progress: bool = True) -> Reference:
    device = next(pair.target.parameters()).device
    sequences, margins, tops = [], [], []
    for prompt in tqdm(workload.prompts, desc="reference", unit="prompt", disable=not progress):
        ids = torch.tensor([prompt], device=device)
        out = pair.target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            output_logits=True,
            return_dict_in_generate=True,
            **greedy_generate_kwargs(workload),
        )
        tokens = cut_after_eos(out.sequences[0, len(prompt) :].tolist(), workload.eos_token_ids)
        top2 = torch.stack([step[0].double().topk(2).values for step in out.logits[: len(tokens)]])  # [T, 2]
        sequences.append(tokens)
        margins.append((top2[:, 0] - top2[:, 1]).tolist() if tokens else [])
        tops.append(top2[:, 0].tolist() if tokens else [])
    return Reference(workload.key, sequences, margins, tops)


def load_or_compute_reference(
    pair: ModelPair, workload: Workload, cache_file: Path | None, progress: bool = True
) -> Reference:
    """The workload's reference, read from ``cache_file`` when it holds this workload's, else computed (and
    written there)."""
    if cache_file is not None and cache_file.is_file():
        stored = json.loads(cache_file.read_text())
        if stored.get("key") == workload.key:
            return Reference(**stored)
    reference = compute_reference(pair, workload, progress)
    if cache_file is not None:
        cache_file.write_text(json.dumps(asdict(reference)))
    return reference


@dataclass(frozen=True)
class MatchSummary:
    """Exact match: share of sequences identical to the reference. Partial match: share of each reference
    sequence reproduced before the first divergence, averaged over prompts (the paper's table 1)."""

    exact_match: float
    partial_match: float


def first_divergence(sequence: list[int], reference: list[int]) -> int | None:
    """First position where ``sequence`` and ``reference`` differ (a missing token counts), None if equal."""
    for position, (got, expected) in enumerate(zip(sequence, reference, strict=False)):
        if got != expected:
            return position
    return None if len(sequence) == len(reference) else min(len(sequence), len(reference))


def match_summary(sequences: list[list[int]], reference: list[list[int]]) -> MatchSummary:
    exact, partial = 0, 0.0
    for sequence, expected in zip(sequences, reference, strict=True):
        position = first_divergence(sequence, expected)
        exact += position is None
        partial += 1.0 if position is None else position / max(len(expected), 1)
    count = len(reference)
    return MatchSummary(exact_match=exact / count, partial_match=partial / count)
