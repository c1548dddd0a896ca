"""``batchspec bench-merge``: the results of several ``bench`` runs of one workload, as if from one sweep.

A full sweep of a 1.5B pair on a CPU takes hours, so it is often run in pieces (one batch size or one draft
length at a time, each into its own folder, sharing the reference). Merging checks that the pieces measured
the same thing — the same workload (model, dtype, quantization, prompts, budget: equal ``reference.json`` keys
where the runs compared) on the same machine and thread count — and that no cell appears twice, then writes the
usual table, CSV, plots and ``audit.json`` for all of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from batchspec.bench.audit import AuditCell, AuditReport, Divergence
from batchspec.bench.cells import Cell
from batchspec.bench.plots import write_plots
from batchspec.bench.report import write_results
from batchspec.bench.runners import draft_length

SAME_IN_EVERY_RUN = ("model", "dtype", "quantize", "prompts", "max_new_tokens", "torch_threads", "machine")


@dataclass
class MergedRuns:
    """The merged cells (in run order) and, when every run compared with the reference, their audit."""

    cells: list[Cell]
    audit: AuditReport | None
    plots: list[Path]


def read_cells(run_dir: Path) -> list[Cell]:
    path = run_dir / "results.json"
    if not path.is_file():
        raise ValueError(f"{run_dir} holds no results.json: is it a 'batchspec bench' output folder?")
    return [Cell.from_dict(row) for row in json.loads(path.read_text())]


def read_audit(run_dir: Path, num_draft_tokens: int | str | None) -> AuditReport | None:
    """The run's ``audit.json``; cells written without their draft length get the run's."""
    path = run_dir / "audit.json"
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    if "near_tie_ulps" not in raw:
        raise ValueError(
            f"{path} judges near-ties by the old relative tolerance; rerun that bench to judge them in ulps"
        )
    cells = [
        AuditCell(
            c["method"], c["batch_size"], c["exact_match"], c["partial_match"],
            [Divergence(**d) for d in c["divergences"]],
            c["num_draft_tokens"] if "num_draft_tokens" in c else draft_length(c["method"], num_draft_tokens),
            c.get("proposer"),
        )
        for c in raw["cells"]
    ]
    return AuditReport(
        raw["model"], raw["dtype"], raw["prompts"], raw["max_new_tokens"], raw["near_tie_ulps"], cells,
        raw.get("quantize", "none"),
    )


def reference_key(run_dir: Path) -> str | None:
    path = run_dir / "reference.json"
    return json.loads(path.read_text()).get("key") if path.is_file() else None


def check_same_workload(runs: list[tuple[Path, list[Cell]]]) -> None:
    """Refuse runs that differ in workload, machine or threads, and cells measured twice."""
    keys = {key for key in (reference_key(run_dir) for run_dir, _ in runs) if key is not None}
    if len(keys) > 1:
        raise ValueError("the runs have different references (reference.json keys): different prompts or models")
    first_dir, first_cells = runs[0]
    seen: dict[tuple[str, str | None, int, int | str | None], Path] = {}
    for run_dir, cells in runs:
        for cell in cells:
            for name in SAME_IN_EVERY_RUN:
                if getattr(cell, name) != getattr(first_cells[0], name):
                    raise ValueError(
                        f"{run_dir} and {first_dir} differ in {name}: "
                        f"{getattr(cell, name)!r} vs {getattr(first_cells[0], name)!r}"
                    )
            where = (cell.method, cell.proposer, cell.batch_size, cell.num_draft_tokens)
            if where in seen:
                proposer = "" if cell.proposer is None else f" ({cell.proposer})"
                raise ValueError(
                    f"{cell.method}{proposer} at batch size {cell.batch_size}, k = {cell.num_draft_tokens} is in "
                    f"both {seen[where]} and {run_dir}"
                )
            seen[where] = run_dir


def merge_audits(audits: list[AuditReport | None]) -> AuditReport | None:
    """One audit of every run's cells, when every run has one (all judged with one near-tie multiple)."""
    if any(a is None for a in audits):
        return None
    multiples = sorted({a.near_tie_ulps for a in audits})
    if len(multiples) > 1:
        raise ValueError(f"the runs judge near-ties with different multiples: {multiples} ulps")
    first = audits[0]
    return AuditReport(
        first.model, first.dtype, first.prompts, first.max_new_tokens, first.near_tie_ulps,
        [cell for a in audits for cell in a.cells], first.quantize,
    )


def merge_runs(run_dirs: list[Path], out_dir: Path) -> MergedRuns:
    """Merge ``run_dirs`` (``bench`` output folders) into ``out_dir``: results, plots and, if every run has
    one, ``audit.json``."""
    if not run_dirs:
        raise ValueError("give at least one bench output folder to merge")
    runs = [(run_dir, read_cells(run_dir)) for run_dir in run_dirs]
    empty = [str(d) for d, cells in runs if not cells]
    if empty:
        raise ValueError(f"no measured cells in {', '.join(empty)}")
    check_same_workload(runs)
    audit = merge_audits([read_audit(run_dir, run_cells[0].num_draft_tokens) for run_dir, run_cells in runs])
    cells = [cell for _, run_cells in runs for cell in run_cells]
    out_dir.mkdir(parents=True, exist_ok=True)
    write_results(out_dir, cells)
    if audit is not None:
        audit.write(out_dir)
    return MergedRuns(cells, audit, write_plots(out_dir, cells))
