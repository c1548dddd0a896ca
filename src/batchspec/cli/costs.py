"""``batchspec costs``: forward costs of the target and the draft, and the acceptance speculation needs to pay."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import torch
import typer

from batchspec.bench.costs import (
    DEFAULT_CONTEXT,
    DEFAULT_REPEATS,
    ForwardCost,
    SpeculationCost,
    StepFloor,
    UnionRead,
    measure_forward_costs,
    read_bandwidth,
    speculation_costs,
    step_floors,
    union_reads,
    weight_bytes,
)
from batchspec.cli.bench import (
    DEFAULT_BATCH_SIZES,
    BatchSizesOption,
    OutputDirOption,
    load_for_methods,
    parse_batch_sizes,
    parse_positive_ints,
)
from batchspec.cli.common import model_choice, with_options
from batchspec.cli.errors import user_errors
from batchspec.config import DEFAULT_DRAFT_VOCABULARY
from batchspec.models.choice import ModelChoice
from batchspec.models.packing import kernels_in_use
from batchspec.models.pair import ModelPair

DraftLengthsOption = Annotated[
    str, typer.Option("--draft-lengths", metavar="K1,K2,...", help="Comma-separated draft lengths k to cost.")
]


def costs_report(
    loaded: ModelPair, context: int, costs: list[ForwardCost], summary: list[SpeculationCost], floors: list[StepFloor],
    draft_vocabulary: int, reads: list[UnionRead],
) -> dict[str, object]:
    """What ``costs.json`` holds: the models and how they compute, the threads, the context, the draft's vocabulary,
    the costs, each one-token step against the floor its weights' bytes set and, for a mixture-of-experts target,
    each of its forwards against the union of experts it touched (``union_reads``, empty for a dense target)."""
    return {
        "model": loaded.name,
        "dtype": loaded.dtype,
        "kernels": kernels_in_use(loaded.target),
        "quantize": loaded.quantize,
        "precision": loaded.precision,  # with int8, the native build it ran on (float32, int8 exact on avx2)
        "torch_threads": torch.get_num_threads(),
        "context": context,
        "draft_vocabulary": draft_vocabulary,
        "forward_costs": [c.__dict__ for c in costs],
        "speculation": [s.to_dict() for s in summary],
        "step_floors": [f.__dict__ for f in floors],
        "union_reads": [r.__dict__ for r in reads],
    }


@with_options(models=model_choice)
def costs_command(
    models: ModelChoice,
    output: OutputDirOption,
    batch_sizes: BatchSizesOption = DEFAULT_BATCH_SIZES,
    draft_lengths: DraftLengthsOption = "3,5",
    context: Annotated[
        int, typer.Option("--context", min=1, help="Cached columns before the timed tokens.")
    ] = DEFAULT_CONTEXT,
    repeats: Annotated[
        int, typer.Option("--repeats", min=1, help="Timed forwards per cost (median).")
    ] = DEFAULT_REPEATS,
    mean_accepted_length: Annotated[
        float | None,
        typer.Option(
            "--mean-accepted-length", min=1.0,
            help="A measured mean accepted length E (from bench): adds the predicted speedup and the draft cost "
            "at which speculation breaks even.",
        ),
    ] = None,
    draft_vocabulary: Annotated[
        int, typer.Option("--draft-vocabulary", min=0, help="The draft's forward over its first N token ids, as "
                          "generate's --draft-vocabulary drafts (0: every id).")
    ] = DEFAULT_DRAFT_VOCABULARY,
) -> None:
    """Time one target and one draft forward per batch size, and derive what speculation needs to pay off.

    For every batch size B and draft length k: c_t(B, 1) (a plain decoding step), c_t(B, k+1) (a verification)
    and c_d(B, 1) (one draft step); a round costs k * c_d(B, 1) + c_t(B, k+1), so speculation beats plain
    batched decoding only when rows gain more than round / c_t(B, 1) tokens per round. Writes costs.json.
    """
    with user_errors():
        sizes = parse_batch_sizes(batch_sizes)
        lengths = parse_positive_ints(draft_lengths, "--draft-lengths")
        loaded = load_for_methods(models, ("eqspec",))
        costs = measure_forward_costs(loaded.target, loaded.draft, sizes, lengths, context=context, repeats=repeats,
                                      draft_vocabulary=draft_vocabulary)
        summary = speculation_costs(costs, mean_accepted_length)
        weights = {"target": weight_bytes(loaded.target), "draft": weight_bytes(loaded.draft)}
        bandwidth = read_bandwidth(next(loaded.target.parameters()).device)
        floors = step_floors(costs, weights, bandwidth)
        reads = union_reads(costs, loaded.target, bandwidth)
    output.mkdir(parents=True, exist_ok=True)
    report = costs_report(loaded, context, costs, summary, floors, draft_vocabulary, reads)
    (output / "costs.json").write_text(json.dumps(report, indent=2) + "\n")
    typer.echo(f"{loaded.name} ({loaded.precision}, {torch.get_num_threads()} threads), {context} cached columns, "
               f"the draft over {draft_vocabulary or 'all'} token ids")
    typer.echo("| B | k | c_t(B,1) s | c_t(B,k+1) s | c_d(B,1) s | round s | break-even E | speedup | c_d needed s |")
    typer.echo("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in summary:
        speedup = "–" if s.predicted_speedup is None else f"{s.predicted_speedup:.2f}"
        needed = "–" if s.break_even_draft_step_s is None else f"{s.break_even_draft_step_s:.3f}"
        typer.echo(
            f"| {s.batch_size} | {s.num_draft_tokens} | {s.target_step_s:.3f} | {s.verify_s:.3f} | "
            f"{s.draft_step_s:.3f} | {s.round_s:.3f} | {s.break_even_accepted_length:.2f} | {speedup} | {needed} |"
        )
    if loaded.through_text:
        typer.echo("The draft is of another tokenizer and drafts a row at a time: at B rows its drafts cost B of its "
                   "B = 1 forwards, not the batched c_d(B,1) above.")
    echo_floors(floors)
    if reads:
        echo_unions(reads)
    typer.echo(f"Wrote {Path(output) / 'costs.json'}", err=True)


def echo_floors(floors: list[StepFloor]) -> None:
    """The one-token steps against the read bandwidth: how far from the limit each runs."""
    typer.echo(f"One-token steps against the measured read bandwidth ({floors[0].bandwidth / 1e9:.1f} GB/s):")
    typer.echo("| model | B | weights GB | floor s | step s | read GB/s | x floor |")
    typer.echo("| --- | --- | --- | --- | --- | --- | --- |")
    for f in floors:
        typer.echo(
            f"| {f.model} | {f.batch_size} | {f.weight_bytes / 1e9:.3f} | {f.floor_s:.4f} | {f.seconds:.4f} | "
            f"{f.achieved / 1e9:.1f} | {f.over_floor:.2f} |"
        )


def echo_unions(reads: list[UnionRead]) -> None:
    """A mixture-of-experts target's forwards against the experts they touched: the union a sparse block ran (the
    mean over the blocks) beside the one uniform routing of as many tokens gives, the bytes those experts make, and
    the forward against those bytes over the read bandwidth."""
    typer.echo("Target forwards against the experts their tokens touched (experts a block, mean over the blocks):")
    typer.echo("| B | tokens/row | experts run | expected union | GB read | GB expected | floor s | step s | x floor |")
    typer.echo("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in reads:
        typer.echo(
            f"| {r.batch_size} | {r.new_tokens} | {r.experts_run:.2f} | {r.expected_union:.2f} | "
            f"{r.bytes_read / 1e9:.3f} | {r.expected_bytes / 1e9:.3f} | {r.floor_s:.4f} | {r.seconds:.4f} | "
            f"{r.over_floor:.2f} |"
        )
