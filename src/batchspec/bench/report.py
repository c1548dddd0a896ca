"""Writing benchmark cells out: ``results.json``, ``results.csv`` and ``results.md``."""

from __future__ import annotations

import csv
import json
from dataclasses import fields
from pathlib import Path

from batchspec.bench.cells import Cell

COLUMNS = [f.name for f in fields(Cell)]
TABLE = (
    ("method", "method"),
    ("proposer", "proposer"),
    ("B", "batch_size"),
    ("k", "num_draft_tokens"),
    ("tokens/s", "tokens_per_s"),
    ("wall s", "wall_s"),
    ("tokens", "generated_tokens"),
    ("accept", "acceptance_rate"),
    ("mean acc len", "mean_accepted_length"),
    ("prefill", "prefill_share"),
    ("draft", "draft_share"),
    ("verify", "verify_share"),
    ("realign", "realign_share"),
    ("other", "other_share"),
    ("read GB/s", "read_gb_per_s"),
    ("grouping", "grouping_rate"),
    ("exact", "exact_match"),
    ("partial", "partial_match"),
)
PERCENT = {
    "prefill_share",
    "draft_share",
    "verify_share",
    "realign_share",
    "other_share",
    "grouping_rate",
    "exact_match",
    "partial_match",
    "acceptance_rate",
}


def _format(name: str, value: object) -> str:
    if value is None:
        return "–"
    if name in PERCENT:
        return f"{100 * float(value):.1f}%"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _cell_value(cell: Cell, name: str) -> object:
    return getattr(cell, name)


def markdown_table(cells: list[Cell]) -> str:
    header = "| " + " | ".join(title for title, _ in TABLE) + " |"
    rule = "|" + "|".join(" --- " for _ in TABLE) + "|"
    rows = ["| " + " | ".join(_format(name, _cell_value(c, name)) for _, name in TABLE) + " |" for c in cells]
    return "\n".join([header, rule, *rows]) + "\n"


def write_results(out_dir: Path, cells: list[Cell]) -> None:
    """Write the cells so far (called after every cell, so an interrupted sweep keeps what it measured)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(out_dir / "results.json", json.dumps([c.to_dict() for c in cells], indent=2) + "\n")
    with (out_dir / "results.csv.tmp").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(c.to_dict() for c in cells)
    (out_dir / "results.csv.tmp").replace(out_dir / "results.csv")
    if cells:
        first = cells[0]
        arithmetic = f"{first.kernels} kernels" if first.quantize == "none" else f"{first.quantize} exact"
        reads = "" if first.target_gb is None else f", the target reads {first.target_gb:.3f} GB a forward"
        title = (
            f"{first.model}, {first.dtype} ({arithmetic}{reads}), {first.prompts} prompts, "
            f"{first.max_new_tokens} new tokens, "
            f"{first.torch_threads} threads, {first.machine}" + ("" if first.device == "cpu" else f", {first.device}")
        )
        _atomic_write(out_dir / "results.md", f"{title}\n\n{markdown_table(cells)}")


def _atomic_write(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    temporary.replace(path)
