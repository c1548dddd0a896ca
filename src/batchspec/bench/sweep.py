"""``batchspec bench``: every method at every batch size on one workload, models loaded once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from batchspec.bench.audit import NearTieRule, audit_cell, empty_report
from batchspec.bench.cells import Cell, make_cell
from batchspec.bench.plots import write_plots
from batchspec.bench.reference import MatchSummary, Reference, load_or_compute_reference
from batchspec.bench.report import write_results
from batchspec.bench.runners import needs_draft, runner_for
from batchspec.bench.workload import ModelPair, Workload


@dataclass(frozen=True)
class SweepPlan:
    """The cells to run: ``methods`` × ``batch_sizes`` (hf-assisted at batch size 1 only)."""

    methods: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    compare: bool = True

    def __post_init__(self) -> None:
        if not self.methods or not self.batch_sizes:
            raise ValueError("a sweep needs at least one method and one batch size")
        for method in self.methods:
            runner_for(method)
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be integers >= 1; got {list(self.batch_sizes)}")

    def cells(self) -> list[tuple[str, int]]:
        return [(m, b) for m in self.methods for b in self.batch_sizes if m != "hf-assisted" or b == 1]


@dataclass
class SweepResult:
    cells: list[Cell]
    skipped: list[tuple[str, int]]
    plots: list[Path]


def warm_up(pair: ModelPair, workload: Workload, methods: tuple[str, ...]) -> None:
    """One short run of each method, so that first-call costs do not land in a measured cell."""
    tiny = Workload(
        workload.model,
        workload.dtype,
        workload.prompt_source,
        workload.prompts[:1],
        min(4, workload.max_new_tokens),
        workload.num_draft_tokens,
        workload.eos_token_ids,
        workload.pad_token_id,
    )
    for method in methods:
        runner_for(method)(pair, tiny, 1)


def run_sweep(
    pair: ModelPair, workload: Workload, plan: SweepPlan, out_dir: Path, progress: bool = True
) -> SweepResult:
    """Measure every cell, writing the results after each one (an interrupted sweep keeps what it finished).

    With ``plan.compare`` every cell's divergences from the reference are written to ``audit.json`` as well, in
    the format of ``batchspec audit`` (position and the reference's logit margin of each)."""
    if pair.draft is None and any(needs_draft(m) for m in plan.methods):
        raise ValueError("these methods need a draft model: " + ", ".join(m for m in plan.methods if needs_draft(m)))
    out_dir.mkdir(parents=True, exist_ok=True)
    reference: Reference | None = None
    if plan.compare:
        reference = load_or_compute_reference(pair, workload, out_dir / "reference.json", progress)
    warm_up(pair, workload, plan.methods)
    todo = plan.cells()
    skipped = [(m, b) for m in plan.methods for b in plan.batch_sizes if (m, b) not in todo]
    cells: list[Cell] = []
    rule = NearTieRule()
    audit = empty_report(workload, rule)
    for method, batch_size in tqdm(todo, desc="bench", unit="cell", disable=not progress):
        out = runner_for(method)(pair, workload, batch_size, progress=progress)
        compared = None
        if reference is not None:  # record where it diverged, and how close
            compared = audit_cell(method, batch_size, workload, out.sequences, reference, rule)
            audit.cells.append(compared)
        match = None if compared is None else MatchSummary(compared.exact_match, compared.partial_match)
        cells.append(make_cell(method, batch_size, workload, out, match))
        write_results(out_dir, cells)
        if compared is not None:
            audit.write(out_dir)
    return SweepResult(cells, skipped, write_plots(out_dir, cells))
