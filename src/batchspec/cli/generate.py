"""``batchspec generate``: generation for a prompt set with a target/draft pair, greedy or sampled."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from batchspec.api import generate
from batchspec.cli.common import (
    BatchSizeOption,
    CacheDirOption,
    CategoryOption,
    ChatTemplateOption,
    DraftOption,
    DType,
    DTypeOption,
    Kernels,
    KernelsOption,
    LimitOption,
    MaxNewTokensOption,
    Method,
    MethodOption,
    ModelChoice,
    NumDraftTokensOption,
    PresetOption,
    PromptChoice,
    PromptsOption,
    ProposerOption,
    SeedOption,
    TargetOption,
    TemperatureOption,
    TopKOption,
    TopPOption,
    check_output_path,
    encode_prompts,
    load_models,
    load_prompt_records,
    summary_lines,
)
from batchspec.cli.errors import user_errors
from batchspec.cli.ray_generate import (
    ActorsOption,
    RayAddressOption,
    RayChoice,
    RayOption,
    ThreadsPerActorOption,
    run_generate_on_ray,
)
from batchspec.data import PromptRecord
from batchspec.ray import GenerationSettings

OutputOption = Annotated[
    Path | None,
    typer.Option(
        "--output", "-o", metavar="PATH.jsonl", dir_okay=False,
        help="Write one JSON object per prompt (index, prompt, text, token_ids, num_tokens, finish_reason) "
        "instead of printing the generated texts.",
    ),
]


@dataclass(frozen=True)
class GeneratedText:
    """One prompt's result as written to ``--output``: the new tokens, their text and why they ended."""

    index: int
    prompt: str
    text: str
    token_ids: list[int]
    num_tokens: int
    finish_reason: str

    def __post_init__(self) -> None:
        if self.num_tokens != len(self.token_ids):
            raise ValueError(f"num_tokens {self.num_tokens} differs from {len(self.token_ids)} token ids")

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)


def collect_results(records: list[PromptRecord], result: Any, tokenizer: Any) -> list[GeneratedText]:
    """Pair each prompt record with its generated tokens, decoded without special tokens."""
    return [
        GeneratedText(
            index=index,
            prompt=record.text,
            text=tokenizer.decode(tokens, skip_special_tokens=True),
            token_ids=list(tokens),
            num_tokens=len(tokens),
            finish_reason=reason,
        )
        for index, (record, tokens, reason) in enumerate(
            zip(records, result.sequences, result.finish_reasons, strict=True)
        )
    ]


def write_jsonl(path: Path, results: list[GeneratedText]) -> None:
    path.write_text("".join(r.to_json() + "\n" for r in results), encoding="utf-8")


def print_texts(records: list[PromptRecord], results: list[GeneratedText]) -> None:
    for record, result in zip(records, results, strict=True):
        header = f"=== [{result.index}] {record.id} ({result.finish_reason}, {result.num_tokens} tokens) ==="
        typer.echo(header)
        typer.echo(result.text)
        typer.echo()


def check_sampling_options(temperature: float, top_k: int | None, top_p: float | None, seed: int | None) -> None:
    """Refuse sampling settings that greedy decoding (temperature 0) would silently ignore."""
    if not math.isfinite(temperature):
        raise ValueError(f"--temperature must be a finite number; got {temperature}")
    given = [name for name, value in (("--top-k", top_k), ("--top-p", top_p), ("--seed", seed)) if value is not None]
    if temperature == 0 and given:
        raise ValueError(f"{', '.join(given)} only apply when sampling: add --temperature above 0")
    if top_p is not None and top_p == 0:
        raise ValueError("--top-p must be above 0 (1 keeps every token)")
    if seed is not None and not 0 <= seed < 2**63:
        raise ValueError(f"--seed must be in [0, 2**63); got {seed}")


def sampling_summary(temperature: float, top_k: int | None, top_p: float | None, seed: int | None) -> str:
    """``greedy`` or e.g. ``temperature 0.7, top-k 5, seed 3``."""
    if temperature == 0:
        return "greedy"
    parts = [f"temperature {temperature:g}"]
    parts += [f"{name} {value:g}" for name, value in (("top-k", top_k), ("top-p", top_p), ("seed", seed))
              if value is not None]
    return ", ".join(parts)


def generate_command(
    preset: PresetOption = None,
    target: TargetOption = None,
    draft: DraftOption = None,
    prompts: PromptsOption = "humaneval",
    limit: LimitOption = None,
    category: CategoryOption = None,
    chat_template: ChatTemplateOption = True,
    method: MethodOption = Method.EQSPEC,
    proposer: ProposerOption = None,
    batch_size: BatchSizeOption = 8,
    max_new_tokens: MaxNewTokensOption = 128,
    num_draft_tokens: NumDraftTokensOption = "auto",
    dtype: DTypeOption = DType.AUTO,
    kernels: KernelsOption = Kernels.AUTO,
    temperature: TemperatureOption = 0.0,
    top_k: TopKOption = None,
    top_p: TopPOption = None,
    seed: SeedOption = None,
    output: OutputOption = None,
    cache_dir: CacheDirOption = None,
    ray: RayOption = False,
    ray_address: RayAddressOption = None,
    actors: ActorsOption = None,
    threads_per_actor: ThreadsPerActorOption = None,
) -> None:
    """Generate for a prompt set: greedy by default, and then every output is the target's own greedy output,
    exactly in float32 (--dtype auto, the default on the CPU) and up to near-ties (the two best tokens within a few
    rounding steps) in bfloat16 or float16; with --temperature > 0 outputs are samples from the target's own
    distribution.

    Without --preset, --target or --draft the default preset is used; the first use of a preset
    downloads and converts it (see `batchspec fetch`). Shows a progress bar while generating, then the
    generated texts (or writes --output) and a summary: sequences, tokens/s, acceptance rate, mean
    accepted length and the time split between draft, verify, realign and other work.

    With --ray the prompts become a Ray Dataset generated by --actors actors (each loads the models once), on
    a local cluster or the one at --ray-address / $RAY_ADDRESS; the output is the same, in prompt order.
    """
    with user_errors():
        models = ModelChoice(
            preset=preset, target=target, draft=draft, dtype=dtype, cache_dir=cache_dir, kernels=kernels
        )
        models.check_for(method, proposer)
        check_sampling_options(temperature, top_k, top_p, seed)
        prompt_choice = PromptChoice(source=prompts, limit=limit, category=category, chat_template=chat_template)
        records = load_prompt_records(prompt_choice)
        check_output_path(output)
        ray_choice = RayChoice(enabled=ray, address=ray_address, actors=actors, threads_per_actor=threads_per_actor)
        if ray_choice.enabled:
            settings = GenerationSettings(
                method=method.value, batch_size=batch_size, max_new_tokens=max_new_tokens,
                num_draft_tokens=num_draft_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                chat_template=chat_template, proposer=getattr(models.proposer_for(method, proposer), "value", None),
            )
            run_generate_on_ray(records, models, settings, seed, ray_choice, output)
            return
        loaded = load_models(models, method, proposer)
        proposer = models.proposer_for(method, proposer)
        typer.echo(f"Loaded {loaded.name} ({loaded.precision}) in {loaded.seconds:.1f} s", err=True)
        token_ids = encode_prompts(records, loaded.tokenizer, prompt_choice)
        result = generate(
            loaded.target,
            loaded.draft,
            token_ids,
            method=method.value,
            proposer=None if proposer is None else proposer.value,
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            num_draft_tokens=num_draft_tokens,
            progress=True,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
        )
        results = collect_results(records, result, loaded.tokenizer)
        if output is None:
            print_texts(records, results)
        else:
            write_jsonl(output, results)
            typer.echo(f"Wrote {len(results)} results to {output}", err=True)
    drafting = "" if proposer is None else f", {proposer.value} proposer, k={num_draft_tokens}"
    sampling = sampling_summary(temperature, top_k, top_p, seed)
    typer.echo(
        f"Summary: {loaded.name} ({loaded.precision}), {method.value}, batch size {batch_size}{drafting}, {sampling}"
    )
    for line in summary_lines(result.stats, result.finish_reasons, method):
        typer.echo(f"  {line}")
