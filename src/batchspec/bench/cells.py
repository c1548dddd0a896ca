"""One benchmark cell: a method at a batch size on a workload, measured."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from batchspec.bench.reference import MatchSummary
from batchspec.bench.runners import SPECULATIVE, RunOutput, draft_length
from batchspec.bench.workload import Workload, machine_description
from batchspec.engine import STAGES


@dataclass
class Cell:
    """The measurements of one cell; None where a field does not apply to the method (e.g. the peers have no
    acceptance statistics or stage split, only exspec groups, and only the speculative methods have a proposer
    and a draft length). ``target_gb`` is what one target forward reads of its weights and ``read_gb_per_s`` the
    rate the decoding rounds' target forwards read them at (:func:`read_rate`): a plain B = 1 step's ratio to the
    memory's read bandwidth is how far it is from its floor."""

    method: str
    proposer: str | None
    batch_size: int
    model: str
    dtype: str
    kernels: str
    device: str
    quantize: str
    prompts: int
    max_new_tokens: int
    num_draft_tokens: int | str | None
    torch_threads: int
    machine: str
    tokens_per_s: float
    wall_s: float
    generated_tokens: int
    acceptance_rate: float | None
    mean_accepted_length: float | None
    recomputed_columns: int | None
    cached_tokens: int | None
    prefill_s: float | None
    draft_s: float | None
    verify_s: float | None
    realign_s: float | None
    other_s: float | None
    prefill_share: float | None
    draft_share: float | None
    verify_share: float | None
    realign_share: float | None
    other_share: float | None
    grouping_rate: float | None
    exact_match: float | None
    partial_match: float | None
    target_gb: float | None = None
    read_gb_per_s: float | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict[str, object]) -> Cell:
        """A cell read back from ``results.json``; rows written before proposers, the prefill stage and
        quantization existed get their draft proposer, PyTorch's default kernels, the CPU, no prefill figures and no
        quantization."""
        method = str(row["method"])
        defaults = {
            "proposer": "draft" if method in SPECULATIVE else None,
            "kernels": "default",
            "device": "cpu",
            "quantize": "none",
            "recomputed_columns": None,
            "cached_tokens": None,
            "prefill_s": None,
            "prefill_share": None,
        }
        return cls(**{**defaults, **row})


def make_cell(
    method: str,
    proposer: str | None,
    batch_size: int,
    workload: Workload,
    out: RunOutput,
    match: MatchSummary | None,
    target_bytes: int | None = None,
) -> Cell:
    tokens = sum(len(s) for s in out.sequences)
    stats = out.stats
    seconds: dict[str, float | None] = {f"{s}_s": None for s in STAGES}
    shares: dict[str, float | None] = {f"{s}_share": None for s in STAGES}
    if stats is not None:
        for stage in STAGES:
            value = getattr(stats, f"{stage}_s")
            seconds[f"{stage}_s"] = value
            shares[f"{stage}_share"] = value / stats.wall_s if stats.wall_s > 0 else 0.0
    speculative = stats is not None and method != "autoregressive"
    return Cell(
        method=method,
        proposer=proposer,
        batch_size=batch_size,
        model=workload.model,
        dtype=workload.dtype,
        kernels=workload.kernels,
        device=workload.device,
        quantize=workload.quantize,
        prompts=len(workload.prompts),
        max_new_tokens=workload.max_new_tokens,
        num_draft_tokens=draft_length(method, workload.num_draft_tokens),
        torch_threads=torch.get_num_threads(),
        machine=machine_description(),
        tokens_per_s=tokens / out.wall_s if out.wall_s > 0 else 0.0,
        wall_s=out.wall_s,
        generated_tokens=tokens,
        acceptance_rate=stats.acceptance_rate if speculative else None,
        mean_accepted_length=stats.mean_accepted_length if speculative else None,
        recomputed_columns=None if stats is None else stats.recomputed_columns,
        cached_tokens=None if stats is None else stats.cached_tokens,
        **seconds,
        **shares,
        grouping_rate=stats.grouping_rate if speculative and method == "exspec" else None,
        exact_match=None if match is None else match.exact_match,
        partial_match=None if match is None else match.partial_match,
        target_gb=None if target_bytes is None else target_bytes / 1e9,
        read_gb_per_s=_per_billion(None if stats is None or target_bytes is None else read_rate(target_bytes, stats)),
    )


def _per_billion(value: float | None) -> float | None:
    return None if value is None else value / 1e9


def read_rate(target_bytes: int, stats) -> float | None:
    """Bytes per second the target's weights were read at while decoding: each round's verification (or plain step)
    is one target forward, which reads ``target_bytes``; over the time the rounds spent in it (``verify_s``)."""
    return target_bytes * stats.rounds / stats.verify_s if stats.verify_s > 0 else None
