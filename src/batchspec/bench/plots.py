"""PNG plots of a sweep: throughput and batch-scaling efficiency, time anatomy, grouping rate."""

from __future__ import annotations

from pathlib import Path

from batchspec.bench.cells import Cell
from batchspec.engine import STAGES


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(cell: Cell, cells: list[Cell]) -> str:
    """The method's name, with its proposer when it ran with several and ``k=`` when at several draft lengths."""
    same = [c for c in cells if c.method == cell.method]
    label = cell.method
    if len({c.proposer for c in same}) > 1:
        label += f" {cell.proposer}"
    if len({c.num_draft_tokens for c in same}) > 1:
        label += f" k={cell.num_draft_tokens}"
    return label


def _by_method(cells: list[Cell]) -> dict[str, list[Cell]]:
    """Cells per plotted series (a method, or a method at one draft length), by increasing batch size."""
    series: dict[str, list[Cell]] = {}
    for cell in sorted(cells, key=lambda c: c.batch_size):
        series.setdefault(_label(cell, cells), []).append(cell)
    return series


def plot_throughput(cells: list[Cell], path: Path) -> None:
    """Tokens/s per method against batch size, and each method's throughput relative to its own at B = 1."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for method, rows in _by_method(cells).items():
        sizes = [c.batch_size for c in rows]
        left.plot(sizes, [c.tokens_per_s for c in rows], marker="o", label=method)
        base = next((c.tokens_per_s for c in rows if c.batch_size == 1), None)
        if base:
            right.plot(sizes, [c.tokens_per_s / base for c in rows], marker="o", label=method)
    left.set(xlabel="batch size", ylabel="tokens/s", title="Throughput")
    right.set(xlabel="batch size", ylabel="throughput / throughput at B=1", title="Batch-scaling efficiency")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:  # no efficiency line without a B = 1 cell
            axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_anatomy(cells: list[Cell], path: Path) -> None:
    """Stacked share of wall time in prefill / draft / verify / realign / other, per method and batch size."""
    plt = _pyplot()
    staged = [c for c in cells if c.draft_share is not None]
    fig, axis = plt.subplots(figsize=(max(6, 0.7 * len(staged) + 2), 4))
    labels = [f"{_label(c, cells)}\nB={c.batch_size}" for c in staged]
    bottom = [0.0] * len(staged)
    for stage in STAGES:
        shares = [100 * getattr(c, f"{stage}_share") for c in staged]
        axis.bar(labels, shares, bottom=bottom, label=stage)
        bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
    axis.set(ylabel="% of wall time", title="Where the time goes")
    axis.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_grouping(cells: list[Cell], path: Path) -> None:
    """ExSpec's grouping rate (rounds formed without realignment) against batch size."""
    plt = _pyplot()
    fig, axis = plt.subplots(figsize=(5, 4))
    for method, rows in _by_method([c for c in cells if c.grouping_rate is not None]).items():
        axis.plot([c.batch_size for c in rows], [100 * c.grouping_rate for c in rows], marker="o", label=method)
    axis.set(xlabel="batch size", ylabel="grouping rate (%)", ylim=(0, 105), title="Rounds without realignment")
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(out_dir: Path, cells: list[Cell]) -> list[Path]:
    paths = [out_dir / "throughput.png", out_dir / "anatomy.png", out_dir / "grouping.png"]
    for plot, path in zip((plot_throughput, plot_anatomy, plot_grouping), paths, strict=True):
        plot(cells, path)
    return paths
