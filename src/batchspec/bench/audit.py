"""``batchspec audit``: does each method reproduce the target's own greedy output, and where not, why?

For every method and batch size the outputs are compared with the reference (the target alone, greedy, batch
size 1). Every divergence is reported with its position and the reference's margin between its two highest
logits there: a relative margin at or below ``tolerance`` is a numerical near-tie (batched arithmetic may
legitimately round the other way), anything larger is a synchronisation bug and fails the audit.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from batchspec.bench.reference import Reference, first_divergence, load_or_compute_reference, match_summary
from batchspec.bench.runners import draft_length, plan_cells, runner_for, runs
from batchspec.bench.workload import ModelPair, Workload

DEFAULT_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Divergence:
    """Where one output first differs from the reference.

    Attributes:
        prompt: prompt index.
        position: generated-token index of the first difference.
        expected, got: the reference's token and the method's (None where a sequence had already ended).
        margin: the reference's top-1 minus top-2 logit at ``position``.
        relative_margin: ``margin / |top-1 logit|``.
        near_tie: ``relative_margin <= tolerance``.
    """

    prompt: int
    position: int
    expected: int | None
    got: int | None
    margin: float
    relative_margin: float
    near_tie: bool


@dataclass
class AuditCell:
    """One method at one batch size (and draft length ``num_draft_tokens``) against the reference."""

    method: str
    batch_size: int
    exact_match: float
    partial_match: float
    divergences: list[Divergence] = field(default_factory=list)
    num_draft_tokens: int | str | None = None
    proposer: str | None = None

    @property
    def failures(self) -> list[Divergence]:
        return [d for d in self.divergences if not d.near_tie]


@dataclass
class AuditReport:
    model: str
    dtype: str
    prompts: int
    max_new_tokens: int
    tolerance: float
    cells: list[AuditCell]

    @property
    def passed(self) -> bool:
        return not any(cell.failures for cell in self.cells)

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["passed"] = self.passed
        return out

    def write(self, out_dir: Path) -> None:
        """Write ``audit.json`` into ``out_dir``."""
        (out_dir / "audit.json").write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")


def audit_cell(
    method: str,
    batch_size: int,
    workload: Workload,
    sequences: list[list[int]],
    reference: Reference,
    tolerance: float,
    proposer: str | None = None,
) -> AuditCell:
    """``sequences`` (a method's output at ``batch_size`` on ``workload``, with ``proposer``) against the
    reference."""
    match = match_summary(sequences, reference.sequences)
    divergences = find_divergences(sequences, reference, tolerance)
    return AuditCell(
        method, batch_size, match.exact_match, match.partial_match, divergences,
        draft_length(method, workload.num_draft_tokens), proposer,
    )


def find_divergences(sequences: list[list[int]], reference: Reference, tolerance: float) -> list[Divergence]:
    found = []
    for prompt, (got, expected) in enumerate(zip(sequences, reference.sequences, strict=True)):
        position = first_divergence(got, expected)
        if position is None:
            continue
        if position >= len(expected):  # the method went on where the reference had stopped
            margin = relative = float("inf")
        else:
            margin = reference.margins[prompt][position]
            relative = reference.relative_margin(prompt, position)
        found.append(
            Divergence(
                prompt=prompt,
                position=position,
                expected=expected[position] if position < len(expected) else None,
                got=got[position] if position < len(got) else None,
                margin=margin,
                relative_margin=relative,
                near_tie=relative <= tolerance,
            )
        )
    return found


def run_audit(
    pair: ModelPair,
    workload: Workload,
    methods: tuple[str, ...],
    batch_sizes: tuple[int, ...],
    *,
    proposers: tuple[str, ...] = ("draft",),
    tolerance: float = DEFAULT_TOLERANCE,
    out_dir: Path | None = None,
    progress: bool = True,
) -> AuditReport:
    """Audit ``methods`` (the speculative ones with each of ``proposers``) at ``batch_sizes``; writes
    ``audit.json`` into ``out_dir`` when given."""
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0; got {tolerance}")
    cache = None if out_dir is None else out_dir / "reference.json"
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    reference = load_or_compute_reference(pair, workload, cache, progress)
    cells = []
    todo = [where for where in plan_cells(methods, proposers, batch_sizes) if runs(where)]
    for method, proposer, batch_size in tqdm(todo, desc="audit", unit="cell", disable=not progress):
        sequences = runner_for(method)(pair, workload, batch_size, progress=progress, proposer=proposer).sequences
        cells.append(audit_cell(method, batch_size, workload, sequences, reference, tolerance, proposer))
    report = AuditReport(
        workload.model, workload.dtype, len(workload.prompts), workload.max_new_tokens, tolerance, cells
    )
    if out_dir is not None:
        report.write(out_dir)
    return report
