"""``batchspec bench`` and ``batchspec audit``: throughput and equivalence of every method on one workload."""

from __future__ import annotations

from dataclasses import dataclass
from inspect import Signature, signature
from pathlib import Path
from typing import Annotated, Any

import typer

from batchspec.bench import METHODS, SweepPlan, Workload, run_audit, run_sweep
from batchspec.bench.audit import NEAR_TIE_ULPS, AuditReport, NearTieRule
from batchspec.bench.merge import merge_runs
from batchspec.bench.report import markdown_table
from batchspec.bench.runners import draft_length, needs_draft, plan_cells
from batchspec.cli.common import (
    MaxNewTokensOption,
    Method,
    PromptChoice,
    encode_prompts,
    load_prompt_records,
    loaded_line,
    model_choice,
    prompt_choice,
    settings_choice,
    with_options,
)
from batchspec.cli.errors import user_errors
from batchspec.config import DEFAULT_MAX_NEW_TOKENS, PROPOSERS, SpecConfig
from batchspec.engine import resolve_special_ids
from batchspec.models.choice import ModelChoice
from batchspec.models.packing import kernels_in_use
from batchspec.models.pair import ModelPair
from batchspec.run import load_run, resolve_run

ALL_METHODS = ",".join(METHODS)
MethodsOption = Annotated[
    str,
    typer.Option(
        "--methods",
        metavar="M1,M2,...",
        help=f"Comma-separated methods: {', '.join(METHODS)}. hf-generate is transformers' batched greedy "
        "generate, hf-assisted its assisted generation with the draft (batch size 1 only).",
    ),
]
DEFAULT_BATCH_SIZES = "1,4,8"
BatchSizesOption = Annotated[
    str, typer.Option("--batch-sizes", metavar="B1,B2,...", help="Comma-separated batch sizes.")
]
ProposersOption = Annotated[
    str,
    typer.Option(
        "--proposers", "--proposer", metavar="P1,P2,...",
        help=f"Comma-separated proposers ({', '.join(PROPOSERS)}); eqspec and exspec run one cell per proposer.",
    ),
]
OutputDirOption = Annotated[
    Path, typer.Option("--output", "-o", metavar="DIR", file_okay=False, help="Folder for the results.")
]


ONLINE_METHODS = ("eqspec", "exspec", "autoregressive")
ONLINE_DEFAULTS = {"rate": 1.0, "requests": 32}


def parse_methods(text: str) -> tuple[str, ...]:
    methods = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(
            f"--methods: unknown method {', '.join(unknown) or '(none)'}; choose from {', '.join(METHODS)}"
        )
    return methods


def parse_positive_ints(text: str, option: str) -> tuple[int, ...]:
    """``"1,4,8"`` → ``(1, 4, 8)``; a ValueError naming ``option`` for anything else or a value below 1."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{option} must be comma-separated integers; got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{option} must be integers >= 1; got {text!r}")
    return values


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    return parse_positive_ints(text, "--batch-sizes")


def parse_proposers(text: str) -> tuple[str, ...]:
    """``"draft,ngram"`` → ``("draft", "ngram")``; a ValueError naming ``--proposers`` for anything else."""
    proposers = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    unknown = [p for p in proposers if p not in PROPOSERS]
    if unknown or not proposers:
        raise ValueError(
            f"--proposers: unknown proposer {', '.join(unknown) or '(none)'}; choose from {', '.join(PROPOSERS)}"
        )
    return proposers


@dataclass(frozen=True)
class Cells:
    """What every cell of a sweep shares: the batch sizes and proposers it runs, the budget, and the settings of
    the record that a sweep holds fixed (the draft length and the prefix cache)."""

    batch_sizes: tuple[int, ...]
    proposers: tuple[str, ...]
    max_new_tokens: int
    settings: SpecConfig


CELL_SETTINGS = settings_choice("num_draft_tokens", "prefix_cache_size")


def cells_choice(
    batch_sizes: BatchSizesOption = DEFAULT_BATCH_SIZES,
    proposers: ProposersOption = "draft",
    max_new_tokens: MaxNewTokensOption = DEFAULT_MAX_NEW_TOKENS,
    **settings: Any,
) -> Cells:
    """The cells of ``--batch-sizes``, ``--proposers``, ``--max-new-tokens`` and the settings of
    :data:`CELL_SETTINGS` (``--num-draft-tokens``, ``--prefix-cache-size``)."""
    return Cells(parse_batch_sizes(batch_sizes), parse_proposers(proposers), max_new_tokens,
                 CELL_SETTINGS(**settings))


cells_choice.__signature__ = Signature([
    *list(signature(cells_choice, eval_str=True).parameters.values())[:-1],
    *signature(CELL_SETTINGS).parameters.values(),
])


def build_workload(loaded: ModelPair, prompts: PromptChoice, cells: Cells) -> Workload:
    """The encoded prompts with the target's EOS ids and pad id (as the engine resolves them, so that the peers
    stop where batchspec does)."""
    token_ids = encode_prompts(load_prompt_records(prompts), loaded.tokenizer, prompts)
    eos_ids, pad = resolve_special_ids(loaded.target, None, loaded.tokenizer.pad_token_id)
    return Workload(
        model=loaded.name,
        dtype=loaded.dtype,
        prompt_source=prompts.source,
        prompts=tuple(tuple(p) for p in token_ids),
        max_new_tokens=cells.max_new_tokens,
        num_draft_tokens=cells.settings.num_draft_tokens,
        eos_token_ids=eos_ids,
        pad_token_id=pad,
        kernels=kernels_in_use(loaded.target),
        device=loaded.device,
        quantize=loaded.quantize,
        prefix_cache_size=cells.settings.prefix_cache_size,
    )


def load_for_methods(
    models: ModelChoice, methods: tuple[str, ...], proposers: tuple[str, ...] = ("draft",)
) -> ModelPair:
    """The models the cells need: a draft only when some method (with some proposer) runs one."""
    drafting = any(needs_draft(m, p) for m, p, _ in plan_cells(methods, proposers, (1,)))
    run = resolve_run(SpecConfig(method=Method.EQSPEC if drafting else Method.AUTOREGRESSIVE), models)
    loaded = load_run(run)
    typer.echo(loaded_line(loaded), err=True)
    return loaded


def load_workload(
    models: ModelChoice, prompts: PromptChoice, methods: tuple[str, ...], cells: Cells
) -> tuple[ModelPair, Workload]:
    """The models ``methods`` need and the workload of ``prompts`` (checked before any model is loaded)."""
    load_prompt_records(prompts)
    loaded = load_for_methods(models, methods, cells.proposers)
    return loaded, build_workload(loaded, prompts, cells)


@with_options(models=model_choice, prompts=prompt_choice, cells=cells_choice)
def bench_command(
    models: ModelChoice,
    prompts: PromptChoice,
    cells: Cells,
    output: OutputDirOption,
    methods: MethodsOption = ALL_METHODS,
    compare: Annotated[
        bool, typer.Option("--compare/--no-compare", help="Measure exact/partial match against the reference.")
    ] = True,
    online: Annotated[
        bool,
        typer.Option(
            "--online", help="Online serving benchmark instead: Poisson arrivals to an in-process server per "
            "method (eqspec, exspec, autoregressive) at the first --batch-sizes value; writes online.json."
        ),
    ] = False,
    rate: Annotated[
        float, typer.Option("--rate", min=0.0, help="--online: mean requests per second.")
    ] = ONLINE_DEFAULTS["rate"],
    requests: Annotated[
        int, typer.Option("--requests", min=1, help="--online: requests to send.")
    ] = ONLINE_DEFAULTS["requests"],
) -> None:
    """Measure throughput, time anatomy, grouping and equivalence of methods across batch sizes.

    Models are loaded once and every method is warmed up first. Writes results.json, results.csv, results.md
    and PNG plots (throughput.png, anatomy.png, grouping.png) into --output, updated after every cell. With
    --online, measures request latency (P50/P90/P99), time to first token and throughput under load instead.
    """
    with user_errors():
        _check_mode_options(online, cells, compare, rate, requests)
    if online:
        with user_errors():
            online_methods = _online_methods(methods)
            loaded, workload = load_workload(models, prompts, online_methods, cells)
            result = _run_online(loaded, workload, online_methods, cells.batch_sizes[0], rate, requests)
            output.mkdir(parents=True, exist_ok=True)
            (output / "online.json").write_text(result.to_json() + "\n")
        typer.echo(result.to_json())
        return
    with user_errors():
        plan = SweepPlan(parse_methods(methods), cells.batch_sizes, compare=compare, proposers=cells.proposers)
        loaded, workload = load_workload(models, prompts, plan.methods, cells)
        result = run_sweep(loaded, workload, plan, output)
    typer.echo(bench_header(workload))
    typer.echo(markdown_table(result.cells))
    for method, _, size in result.skipped:
        typer.echo(f"skipped {method} at batch size {size}: it runs at batch size 1 only", err=True)
    typer.echo(f"Wrote results and plots to {output}", err=True)


def bench_header(workload: Workload) -> str:
    """The line above the results table: the models, their precision, the prompts and the budget."""
    quantized = "" if workload.quantize == "none" else f", {workload.quantize} exact"
    return (
        f"Bench of {workload.model} ({workload.dtype}{quantized}), {len(workload.prompts)} prompts, "
        f"{workload.max_new_tokens} new tokens"
    )




def _check_mode_options(online: bool, cells: Cells, compare: bool, rate: float, requests: int) -> None:
    """Refuse, in one line, an option the chosen mode would drop: ``--rate`` and ``--requests`` apply only with
    ``--online``; ``--no-compare`` and other ``--proposers`` than draft only to the sweep (the online servers draft
    with their default proposer)."""
    given = {"rate": rate, "requests": requests}
    if not online:
        dropped = [f"--{name}" for name, value in given.items() if value != ONLINE_DEFAULTS[name]]
        if dropped:
            raise ValueError(f"{', '.join(dropped)} {'applies' if len(dropped) == 1 else 'apply'} only with --online")
        return
    dropped = ["--no-compare"] if not compare else []
    dropped += ["--proposers"] if cells.proposers != ("draft",) else []
    if dropped:
        raise ValueError(f"{', '.join(dropped)} {'applies' if len(dropped) == 1 else 'apply'} only to the sweep, "
                         "not --online")


def _online_methods(text: str) -> tuple[str, ...]:
    """The served methods among ``--methods`` (the default list keeps eqspec, exspec and autoregressive)."""
    methods = parse_methods(text)
    if text == ALL_METHODS:
        return tuple(m for m in methods if m in ONLINE_METHODS)
    wrong = [m for m in methods if m not in ONLINE_METHODS]
    if wrong:
        raise ValueError(f"--online serves {', '.join(ONLINE_METHODS)} only; not {', '.join(wrong)}")
    return methods


def _run_online(loaded: ModelPair, workload: Workload, methods, batch_size: int, rate: float, requests: int):
    from batchspec.bench.online import OnlineWorkload, run_online_benchmark
    online = OnlineWorkload(
        prompts=workload.prompts, rate=rate, requests=requests, max_tokens=workload.max_new_tokens
    )
    return run_online_benchmark(
        online, models=loaded, methods=methods, batch_size=batch_size, num_draft_tokens=workload.num_draft_tokens,
        prefix_cache_size=workload.prefix_cache_size,
    )


@with_options(models=model_choice, prompts=prompt_choice, cells=cells_choice)
def audit_command(
    models: ModelChoice,
    prompts: PromptChoice,
    cells: Cells,
    output: OutputDirOption,
    methods: MethodsOption = "eqspec,exspec",
    near_tie_ulps: Annotated[
        float,
        typer.Option(
            "--near-tie-ulps",
            min=0.0,
            metavar="N",
            help="A divergence is a near-tie (legitimate rounding, not a failure) when the reference's top-2 logit "
            "margin there is at most N spacings of the dtype at the top logit: margin <= N * 2**(floor(log2 |top "
            "logit|) - mantissa bits); bfloat16 has 7 mantissa bits, float16 10, float32 23. Not used with "
            "--quantize int8, where every divergence is a failure.",
        ),
    ] = NEAR_TIE_ULPS,
) -> None:
    """Check that methods reproduce the target's own greedy output (batch size 1, transformers' generate).

    Reports exact and partial match per method and batch size and, for every divergence, its position and the
    reference's top-2 logit margin there, also in ulps: spacings of the models' dtype at the top logit,
    2**(floor(log2 |top logit|) - mantissa bits), 0.125 for bfloat16 logits of magnitude 16 to 32. A divergence
    whose margin is at most --near-tie-ulps (default 4) ulps is a near-tie that rounding explains; any other
    fails the audit. With --quantize int8 each row's logits are bit-identical whatever the batch, so there are no
    near-ties: every divergence fails. Writes audit.json into --output. Exits with status 2 when a divergence is
    not a near-tie.
    """
    with user_errors():
        rule = NearTieRule(near_tie_ulps)
        method_list = parse_methods(methods)
        loaded, workload = load_workload(models, prompts, method_list, cells)
        report = run_audit(
            loaded, workload, method_list, cells.batch_sizes, proposers=cells.proposers, rule=rule, out_dir=output
        )
    print_audit(report)
    if not report.passed:
        raise typer.Exit(2)


def audit_rule_line(report: AuditReport) -> str:
    """The audit's first line: the models, the prompts and how divergences are judged."""
    if report.quantize != "none":
        return (
            f"Audit of {report.model} ({report.dtype}, {report.quantize} exact), {report.prompts} prompts; no "
            f"near-ties: each row's logits are bit-identical whatever the batch, so every divergence is a failure"
        )
    return (
        f"Audit of {report.model} ({report.dtype}), {report.prompts} prompts; near-tie: reference margin at most "
        f"{report.near_tie_ulps:g} ulps of {report.dtype} at the top logit"
    )


def print_audit(report: AuditReport) -> None:
    typer.echo(audit_rule_line(report))
    for cell in report.cells:
        ties = len(cell.divergences) - len(cell.failures)
        k = draft_length(cell.method, cell.num_draft_tokens)
        k_text = "–" if k is None else str(k)
        name = cell.method if cell.proposer is None else f"{cell.method}/{cell.proposer}"
        typer.echo(
            f"  {name:<18} B={cell.batch_size:<3} k={k_text:<4} exact {100 * cell.exact_match:5.1f}%  "
            f"partial {100 * cell.partial_match:5.1f}%  divergences {len(cell.divergences)} "
            f"(near-ties {ties}, failures {len(cell.failures)})"
        )
        for d in cell.divergences:
            kind = "near-tie" if d.near_tie else "FAILURE"
            where = "the reference had ended" if d.top_logit is None else f"top logit {d.top_logit:.4g}"
            typer.echo(
                f"    prompt {d.prompt} at token {d.position}: expected {d.expected}, got {d.got}; "
                f"reference margin {d.margin:.4g} = {d.margin_ulps:.3g} ulps ({where}) {kind}"
            )
    failed = "a divergence is larger than a near-tie" if report.quantize == "none" else "a divergence"
    typer.echo("PASSED" if report.passed else f"FAILED: {failed}")


def bench_merge_command(
    runs: Annotated[
        list[Path],
        typer.Argument(
            metavar="RUN_DIR...", exists=True, file_okay=False,
            help="Output folders of 'batchspec bench' runs of the same workload.",
        ),
    ],
    output: OutputDirOption,
) -> None:
    """Merge several bench runs of one workload into one table, CSV, plots and audit.json.

    For a sweep run in pieces (a batch size or a draft length at a time, each piece into its own folder,
    the reference copied between them). Refuses runs of different models, dtypes, prompts, budgets,
    machines or thread counts, and a cell (method, batch size, k) measured twice.
    """
    with user_errors():
        merged = merge_runs(runs, output)
    typer.echo(markdown_table(merged.cells))
    typer.echo(f"Merged {len(merged.cells)} cells from {len(runs)} runs into {output}", err=True)
