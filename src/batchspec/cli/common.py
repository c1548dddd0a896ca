"""Options and helpers shared by the ``batchspec`` commands: choosing models, prompts and a method.

Each option is an ``Annotated`` type so that every command spells it, documents it and validates it
the same way; options that go together (the models, the prompts) are one group that :func:`with_options` gives
every command that takes them. The helpers turn parsed options into formatted prompts and a summary; which
models to load and loading them is the library's (:mod:`batchspec.models.choice`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from inspect import Parameter, Signature, signature
from pathlib import Path
from typing import Annotated, Any, get_type_hints

import typer

from batchspec.bench.cells import read_rate
from batchspec.cli.errors import user_errors
from batchspec.config import (
    CudaGraphs,
    Method,
    ProposerKind,
    SamplingParams,
    SpecConfig,
    declaration,
)
from batchspec.data import PromptRecord, format_prompts, load_prompts
from batchspec.engine import STAGES
from batchspec.memory import peak_resident_bytes, resident_bytes
from batchspec.models.choice import ModelChoice

__all__ = ["CudaGraphs", "Method", "ProposerKind"]


def _read(read: Callable[[str], Any], value: Any) -> Any:
    """``read(value)`` as a typer callback: a ValueError is typer's BadParameter (a value already read passes)."""
    if not isinstance(value, str):
        return value
    try:
        return read(value)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


def setting_option(name: str, flag: str | None = None, record: type | None = None) -> Any:
    """The command-line option of the option ``name``, a field of ``record`` or, without one, any option
    :func:`~batchspec.config.declaration` knows: its type, flag, help and bounds as declared; ``flag`` renames it
    for a command (``serve``'s ``--max-batch-size``)."""
    if record is None:
        spec, kind = declaration(name)
    else:
        spec, kind = record.__dataclass_fields__[name], get_type_hints(record)[name]
    cli = dict(spec.metadata["cli"])
    cli.pop("flag", None)
    flag = flag or "--" + name.replace("_", "-")
    declared = [f"{flag}/--no-{flag[2:]}"] if cli.pop("switch", False) else [flag]
    if "short" in cli:
        declared.append(cli.pop("short"))
    options: dict[str, Any] = {"help": spec.metadata["help"], "metavar": cli.pop("metavar", None)}
    if "minimum" in cli:
        options["min"] = cli.pop("minimum")
    if "maximum" in cli:
        options["max"] = cli.pop("maximum")
    if "read" in cli:
        read = cli.pop("read")
        kind, options["callback"] = str, lambda value: _read(read, value)
    elif "choices" in cli:
        kind = cli.pop("choices")
    return Annotated[kind, typer.Option(*declared, **options, **cli)]


def settings_choice(
    *names: str, record: type = SpecConfig, flags: dict[str, str] | None = None, **defaults: Any
) -> Callable[..., Any]:
    """A group of options for :func:`with_options`: the fields ``names`` of ``record`` (a dataclass whose fields are
    declared with :func:`~batchspec.config.option`: :class:`~batchspec.config.SpecConfig`, ``SamplingParams``,
    ``ModelChoice``, the server's records) as command-line options (renamed by ``flags``, with a command's own
    ``defaults``), built into the record."""
    flags = flags or {}
    parameters = [
        Parameter(name, Parameter.KEYWORD_ONLY, annotation=setting_option(name, flags.get(name), record),
                  default=defaults.get(name, record.__dataclass_fields__[name].default))
        for name in names
    ]

    def build(**values: Any) -> Any:
        return record(**values)

    build.__signature__ = Signature(parameters)
    return build


MaxNewTokensOption = setting_option("max_new_tokens")
SeedOption = setting_option("seed")
sampling_choice = settings_choice("temperature", "top_k", "top_p", record=SamplingParams)


def with_options(**groups: Callable[..., Any]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command groups of options before its own.

    ``@with_options(models=model_choice)`` adds the parameters of ``model_choice`` to the command's options and calls
    the command with ``models=model_choice(**their values)`` instead; a ValueError of the group's function is one
    ``Error:`` line (:func:`user_errors`). typer reads the options from the signature this gives the command.
    """

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        grouped = {name: signature(build, eval_str=True).parameters for name, build in groups.items()}
        own = [p for name, p in signature(command, eval_str=True).parameters.items() if name not in groups]
        shared = [p for parameters in grouped.values() for p in parameters.values()]

        @wraps(command)
        def run(**options: Any) -> None:
            with user_errors():
                built = {
                    name: groups[name](**{key: options.pop(key) for key in parameters})
                    for name, parameters in grouped.items()
                }
            command(**options, **built)

        run.__signature__ = Signature([p.replace(kind=Parameter.KEYWORD_ONLY) for p in shared + own])
        return run

    return decorate


model_choice = settings_choice(
    "preset", "target", "draft", "dtype", "kernels", "quantize", "draft_quantize", "cache_dir", "device",
    "batch_invariant",
    record=ModelChoice,
)


def prompt_choice(
    prompts: Annotated[
        str,
        typer.Option(
            "--prompts", metavar="humaneval|PATH",
            help="'humaneval' (164 problems), a SpecBench JSONL file (first turn of each question), "
            'a JSONL file of {"prompt": ...} records, or a text file with one prompt per line.',
        ),
    ] = "humaneval",
    limit: Annotated[
        int | None, typer.Option("--limit", "-n", metavar="N", min=1, help="Use only the first N prompts.")
    ] = None,
    category: Annotated[
        str | None,
        typer.Option(
            "--category", metavar="NAME",
            help="Only prompts of this category (SpecBench: writing, coding, math_reasoning, qa, ...).",
        ),
    ] = None,
    chat_template: Annotated[
        bool,
        typer.Option(
            "--chat-template/--no-chat-template",
            help="Wrap each prompt as a user message in the tokenizer's chat template (when it has one).",
        ),
    ] = True,
) -> PromptChoice:
    """The prompts of ``--prompts``, ``--limit``, ``--category`` and ``--chat-template``."""
    return PromptChoice(source=prompts, limit=limit, category=category, chat_template=chat_template)


@dataclass(frozen=True)
class PromptChoice:
    """Which prompts to use and how to present them to the model."""

    source: str = "humaneval"
    limit: int | None = None
    category: str | None = None
    chat_template: bool = True

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be at least 1; got {self.limit}")


def load_prompt_records(choice: PromptChoice) -> list[PromptRecord]:
    """The prompt records of ``choice``; an error when the source yields none."""
    records = load_prompts(choice.source, limit=choice.limit, category=choice.category)
    if not records:
        raise ValueError(f"No prompts in {choice.source}")
    return records


def encode_prompts(records: list[PromptRecord], tokenizer: Any, choice: PromptChoice) -> list[list[int]]:
    """Token ids of each record, through the chat template unless ``choice.chat_template`` is off."""
    return format_prompts(records, tokenizer, chat_template=choice.chat_template)


def check_output_path(path: Path | None) -> None:
    """Fail early, before loading models, if ``path`` cannot be written later."""
    if path is None:
        return
    if path.is_dir():
        raise IsADirectoryError(f"--output {path} is a directory; give a .jsonl file path")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"--output {path}: directory {path.parent} does not exist")


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "-"


def loaded_line(loaded: Any) -> str:
    """What the commands print once the models are loaded: which, how, in how long and the memory it took."""
    return f"Loaded {loaded.name} ({loaded.precision}) in {loaded.seconds:.1f} s, {memory_figures()}"


def memory_figures() -> str:
    """``peak 4.12 GB, now 3.46 GB resident``: the process's largest resident set so far and its present one."""
    now = resident_bytes()
    held = "" if now is None else f", now {now / 1e9:.2f} GB"
    return f"peak {peak_resident_bytes() / 1e9:.2f} GB{held} resident"


def summary_lines(stats: Any, finish_reasons: list[str], method: Method, target_bytes: int | None = None) -> list[str]:
    """A short human-readable summary of a run's ``GenerationStats``; with ``target_bytes`` (what a target forward
    reads of its weights, :func:`~batchspec.bench.costs.weight_bytes`) the rate its forwards read them at."""
    reasons = {reason: finish_reasons.count(reason) for reason in sorted(set(finish_reasons))}
    finished = ", ".join(f"{reason} {count}" for reason, count in reasons.items())
    lines = [
        f"sequences        {len(finish_reasons)} ({finished})" if finished else "sequences        0",
        f"tokens           {stats.generated_tokens} in {stats.wall_s:.1f} s = {stats.tokens_per_s:.1f} tokens/s",
    ]
    if method is not Method.AUTOREGRESSIVE:
        lines += [
            f"acceptance rate  {stats.acceptance_rate:.3f} "
            f"({stats.draft_tokens_accepted} of {stats.draft_tokens_proposed} draft tokens)",
            f"mean accepted    {stats.mean_accepted_length:.2f} tokens per row per round "
            f"(accepted drafts + bonus token; {stats.rounds} rounds, {stats.ragged_rounds} ragged)",
        ]
    stages = [(stage, getattr(stats, f"{stage}_s")) for stage in STAGES]
    split = ", ".join(f"{name} {seconds:.1f} s ({_percent(seconds, stats.wall_s)})" for name, seconds in stages)
    lines.append(f"time             {split}")
    if stats.realign_bytes:
        rate = stats.realign_bytes / stats.realign_s / 1e9 if stats.realign_s > 0 else 0.0
        lines.append(f"realign          {stats.realign_bytes / 1e9:.3f} GB of KV copied in {stats.realign_s:.2f} s "
                     f"({rate:.1f} GB/s), {stats.realign_rows} rows moved in {stats.rounds} rounds")
    lines.append(f"memory           {memory_figures()} (this process: its most so far, the load included; and now)")
    rate = None if target_bytes is None else read_rate(target_bytes, stats)
    if rate is not None:
        lines.append(f"weights          the target reads {target_bytes / 1e9:.3f} GB a forward: {rate / 1e9:.1f} GB/s "
                     f"over its {stats.rounds} decoding forwards (a plain step's floor is the memory's read rate)")
    return lines
