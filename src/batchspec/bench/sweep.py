"""``batchspec bench``: every method at every batch size on one workload, models loaded once."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from tqdm.auto import tqdm

from batchspec.bench.audit import NearTieRule, audit_cell, empty_report, rule_for
from batchspec.bench.cells import Cell, make_cell
from batchspec.bench.costs import weight_bytes
from batchspec.bench.plots import write_plots
from batchspec.bench.reference import MatchSummary, Reference, load_or_compute_reference
from batchspec.bench.report import write_results
from batchspec.bench.runners import Where, needs_draft, plan_cells, runner_for, runs
from batchspec.bench.workload import Workload
from batchspec.config import PROPOSERS, ProposerKind
from batchspec.models.pair import ModelPair


@dataclass(frozen=True)
class SweepPlan:
    """The cells to run: ``methods`` × ``batch_sizes``, the speculative batchspec methods once per proposer
    (hf-assisted and hf-prompt-lookup at batch size 1 only)."""

    methods: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    compare: bool = True
    proposers: tuple[str, ...] = (ProposerKind.DRAFT.value,)

    def __post_init__(self) -> None:
        if not self.methods or not self.batch_sizes:
            raise ValueError("a sweep needs at least one method and one batch size")
        for method in self.methods:
            runner_for(method)
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be integers >= 1; got {list(self.batch_sizes)}")
        unknown = [p for p in self.proposers if p not in PROPOSERS]
        if unknown or not self.proposers:
            raise ValueError(f"proposers must be among {', '.join(PROPOSERS)}; got {list(self.proposers)}")

    def wanted(self) -> list[Where]:
        """Every (method, proposer, batch size) asked for."""
        return plan_cells(self.methods, self.proposers, self.batch_sizes)

    def cells(self) -> list[Where]:
        """The cells that run: those of :meth:`wanted` except single-row peers at batch sizes above 1."""
        return [where for where in self.wanted() if runs(where)]

    def needs_draft(self) -> list[str]:
        return sorted({m for m, p, _ in self.cells() if needs_draft(m, p)})


@dataclass
class SweepResult:
    cells: list[Cell]
    skipped: list[Where]
    plots: list[Path]


def warm_up(pair: ModelPair, workload: Workload, cells: list[Where]) -> None:
    """One short run of each method and proposer, so that first-call costs do not land in a measured cell."""
    tiny = replace(workload, prompts=workload.prompts[:1], max_new_tokens=min(4, workload.max_new_tokens))
    for method, proposer in dict.fromkeys((m, p) for m, p, _ in cells):
        runner_for(method)(pair, tiny, 1, proposer=proposer)


def run_sweep(
    pair: ModelPair, workload: Workload, plan: SweepPlan, out_dir: Path, progress: bool = True
) -> SweepResult:
    """Measure every cell, writing the results after each one (an interrupted sweep keeps what it finished).

    With ``plan.compare`` every cell's divergences from the reference are written to ``audit.json`` as well, in
    the format of ``batchspec audit`` (position and the reference's logit margin of each; for an int8 pair every
    divergence is a failure, see :func:`batchspec.bench.audit.rule_for`)."""
    if pair.draft is None and plan.needs_draft():
        raise ValueError("these methods need a draft model: " + ", ".join(plan.needs_draft()))
    rule = rule_for(pair, workload, NearTieRule())
    out_dir.mkdir(parents=True, exist_ok=True)
    reference: Reference | None = None
    if plan.compare:
        reference = load_or_compute_reference(pair, workload, out_dir / "reference.json", progress)
    todo = plan.cells()
    warm_up(pair, workload, todo)
    target_bytes = weight_bytes(pair.target)
    skipped = [where for where in plan.wanted() if where not in todo]
    cells: list[Cell] = []
    audit = empty_report(workload, rule)
    for method, proposer, batch_size in tqdm(todo, desc="bench", unit="cell", disable=not progress):
        out = runner_for(method)(pair, workload, batch_size, progress=progress, proposer=proposer)
        compared = None
        if reference is not None:  # record where it diverged, and how close
            compared = audit_cell(method, batch_size, workload, out.sequences, reference, rule, proposer)
            audit.cells.append(compared)
        match = None if compared is None else MatchSummary(compared.exact_match, compared.partial_match)
        cells.append(make_cell(method, proposer, batch_size, workload, out, match, target_bytes))
        write_results(out_dir, cells)
        if compared is not None:
            audit.write(out_dir)
    return SweepResult(cells, skipped, write_plots(out_dir, cells))
