"""What ``batchspec generate`` writes: the generated texts printed or as JSONL, and the summary's names of the
settings and the sampling (shared by the single-process and the Ray paths)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import typer

from batchspec.config import SamplingParams, SpecConfig, one_seed
from batchspec.data import PromptRecord


@dataclass(frozen=True)
class GeneratedText:
    """One prompt's result as written to ``--output``: the new tokens, their text and why they ended."""

    index: int
    prompt: str
    text: str
    token_ids: list[int]
    num_tokens: int
    finish_reason: str

    def __post_init__(self) -> None:
        if self.num_tokens != len(self.token_ids):
            raise ValueError(f"num_tokens {self.num_tokens} differs from {len(self.token_ids)} token ids")

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)


def collect_results(records: list[PromptRecord], result: Any, tokenizer: Any) -> list[GeneratedText]:
    """Pair each prompt record with its generated tokens, decoded without special tokens."""
    return [
        GeneratedText(
            index=index,
            prompt=record.text,
            text=tokenizer.decode(tokens, skip_special_tokens=True),
            token_ids=list(tokens),
            num_tokens=len(tokens),
            finish_reason=reason,
        )
        for index, (record, tokens, reason) in enumerate(
            zip(records, result.sequences, result.finish_reasons, strict=True)
        )
    ]


def write_jsonl(path: Path, results: list[GeneratedText]) -> None:
    path.write_text("".join(r.to_json() + "\n" for r in results), encoding="utf-8")


def print_texts(records: list[PromptRecord], results: list[GeneratedText]) -> None:
    for record, result in zip(records, results, strict=True):
        header = f"=== [{result.index}] {record.id} ({result.finish_reason}, {result.num_tokens} tokens) ==="
        typer.echo(header)
        typer.echo(result.text)
        typer.echo()


def check_sampling_options(sampling: SamplingParams, seed: int | None) -> None:
    """Refuse sampling settings that greedy decoding (temperature 0) would silently ignore."""
    given = [name for name, value in (("--top-k", sampling.top_k), ("--top-p", sampling.top_p), ("--seed", seed))
             if value is not None]
    if sampling.greedy and given:
        raise ValueError(f"{', '.join(given)} only apply when sampling: add --temperature above 0")
    if seed is not None:
        one_seed("--seed", seed)


def sampling_summary(sampling: SamplingParams, seed: int | None) -> str:
    """``greedy`` or e.g. ``temperature 0.7, top-k 5, seed 3``."""
    if sampling.greedy:
        return "greedy"
    parts = [f"temperature {sampling.temperature:g}"]
    parts += [f"{name} {value:g}" for name, value in (("top-k", sampling.top_k), ("top-p", sampling.top_p),
                                                       ("seed", seed)) if value is not None]
    return ", ".join(parts)


def run_label(settings: SpecConfig) -> str:
    """``eqspec, batch size 8, hybrid proposer, k=auto``: how the summary names the run's settings."""
    proposer = settings.proposer
    drafting = "" if proposer is None else f", {proposer.value} proposer, k={settings.num_draft_tokens}"
    return f"{settings.method.value}, batch size {settings.batch_size}{drafting}"
