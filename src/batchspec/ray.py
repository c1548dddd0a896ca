"""Ray Data: batchspec over a ``ray.data.Dataset`` of prompts, on one machine or a cluster.

Needs the ``ray`` extra (``pip install 'batchspec[ray]'``). :class:`BatchspecPredictor` is a callable class for
``Dataset.map_batches``: each actor loads the target and draft once, then every batch it is handed is one
``batchspec.generate`` call::

    import ray
    from batchspec.ray import BatchspecPredictor

    ds = ray.data.from_items([{"prompt": "Write a haiku about tensors."}, {"prompt": "Explain KV caches."}])
    out = ds.map_batches(
        BatchspecPredictor,
        fn_constructor_kwargs={"preset": "smollm2", "dtype": "float32", "max_new_tokens": 64},
        batch_size=8,        # prompts per generate call
        concurrency=2,       # actors, each with its own copy of the models
        num_cpus=1,          # CPUs reserved per actor; give the same number as num_threads
    )
    for row in out.iter_rows():
        print(row["text"], row["finish_reason"])

Columns in: ``prompt`` (text; another name with ``prompt_column=``), optionally ``seed`` (one int in
``[0, 2**63)`` per row, for sampling) and ``code_completion`` (bool: with a chat template, ask to complete the
code, as the HumanEval prompts of ``batchspec generate`` are). Every input column is passed through. Columns out:
``text`` (special tokens removed), ``token_ids``, ``num_tokens``, ``finish_reason`` (``"eos"`` or ``"length"``)
and ``batch_stats``, the JSON of the batch's :class:`~batchspec.GenerationStats` (``to_dict()``) with ``batch_id``,
``rows``, ``started`` and ``finished`` (Unix seconds) added; :func:`merge_batch_stats` adds them up.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from itertools import count
from pathlib import Path
from typing import Any

import torch

from batchspec.api import GenerationResult, generate_with
from batchspec.config import DEFAULT_MAX_NEW_TOKENS, SamplingParams, SpecConfig, setting_default
from batchspec.data import PromptRecord, format_prompts
from batchspec.engine import GenerationStats
from batchspec.models.choice import ModelChoice
from batchspec.run import load_run, resolve_run

PROMPT_COLUMN = "prompt"
SEED_COLUMN = "seed"
CODE_COLUMN = "code_completion"
STATS_COLUMN = "batch_stats"


@dataclass(frozen=True)
class ActorJob:
    """What an actor is handed, whole (it pickles): which models, the run's settings as asked (each actor resolves
    them on its own machine: :func:`~batchspec.run.resolve_run`), the sampling and budget of every row, the prompt
    column, the chat template switch and the torch threads."""

    choice: ModelChoice
    engine: SpecConfig
    sampling: SamplingParams
    max_new_tokens: int
    prompt_column: str
    chat_template: bool
    num_threads: int | None


class BatchspecPredictor:
    """A ``map_batches`` callable class: the models load once per actor, each batch is one ``generate`` call.

    Args:
        preset: a preset name (``smollm2``, ``qwen2.5-coder``); obtained into the actor's cache if missing.
        target, draft: model specs as for ``batchspec generate --target/--draft`` (Hub id, directory, ``.gguf``,
            ``preset:role``); they replace the preset's models.
        dtype: weights and compute dtype of both models; ``"auto"`` (float32 on the CPU, see
            :func:`batchspec.models.resolve_dtype`) by default.
        kernels: CPU matrix kernels (``"auto"``, ``"packed"``, ``"default"``; see :func:`batchspec.models.use_kernels`).
        quantize: ``"auto"`` (default: int8 on the CPU in float32, see
            :func:`batchspec.models.loading.resolve_quantize`), ``"none"`` or ``"int8"`` (the exact int8 models on the
            CPU, see :func:`batchspec.models.load_model`).
        cache_dir: the preset cache on the actor's machine (default as for the CLI).
        num_threads: torch threads of each actor (match ``num_cpus`` of ``map_batches``); default torch's.
        prompt_column: the column holding the prompt texts.
        chat_template: wrap each prompt as a user message in the tokenizer's chat template (when it has one).
        **settings: ``batchspec.generate`` keywords: ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p`` and
            the fields of :class:`~batchspec.config.SpecConfig` (``method``, ``num_draft_tokens``, ...), checked
            when the actor starts.
    """

    def __init__(
        self,
        preset: str | None = None,
        *,
        target: str | None = None,
        draft: str | None = None,
        dtype: str = setting_default("dtype"),
        kernels: str = setting_default("kernels"),
        quantize: str = setting_default("quantize"),
        device: str = setting_default("device"),
        batch_invariant: bool = setting_default("batch_invariant"),
        cache_dir: str | None = None,
        num_threads: int | None = None,
        prompt_column: str = PROMPT_COLUMN,
        chat_template: bool = True,
        **settings: Any,
    ) -> None:
        max_new_tokens = settings.pop("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        sampling = SamplingParams(**{spec.name: settings.pop(spec.name) for spec in fields(SamplingParams)
                                     if spec.name in settings})
        choice = ModelChoice(preset=preset, target=target, draft=draft, dtype=dtype, kernels=kernels,
                             cache_dir=Path(cache_dir) if cache_dir is not None else None, quantize=quantize,
                             device=device, batch_invariant=batch_invariant)
        self._start(ActorJob(choice, SpecConfig(**settings), sampling, max_new_tokens, prompt_column, chat_template,
                             num_threads))

    def _start(self, job: ActorJob) -> None:
        """Make the run on this machine (:func:`~batchspec.run.resolve_run`: its device, its build) and load its
        models once, on the actor's one torch thread (:attr:`_torch`)."""
        self.job = job
        self._torch = ThreadPoolExecutor(1, thread_name_prefix="batchspec-actor")
        self._torch.submit(self._load).result()
        self._batch_ids = (f"{socket.gethostname()}:{os.getpid()}:{n}" for n in count())

    def _load(self) -> None:
        if self.job.num_threads is not None:
            torch.set_num_threads(self.job.num_threads)
        self.run = resolve_run(self.job.engine, self.job.choice)
        self.models = load_run(self.run, progress=False)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Ray Data calls this from a thread of its own, not the one that built the actor: the work goes to the
        thread that loaded the models. torch's OpenMP runtime keeps a pool of workers for each thread that runs
        parallel work, and two pools on a small host stop spinning between kernels: a plain step of the 1.5B target
        took 70 ms on Ray's thread against 52 ms on the loader's (2 vCPUs, ``num_threads=2``)."""
        return self._torch.submit(self._generate, batch).result()

    def _generate(self, batch: dict[str, Any]) -> dict[str, Any]:
        records = batch_records(batch, self.job.prompt_column)
        token_ids = format_prompts(records, self.models.tokenizer, chat_template=self.job.chat_template)
        seeds = [int(s) for s in batch[SEED_COLUMN]] if SEED_COLUMN in batch else None
        started = time.time()
        result = generate_with(self.models.target, self.models.draft, token_ids, self.run, seed=seeds,
                               max_new_tokens=self.job.max_new_tokens, sampling=self.job.sampling)
        stats = dict(result.stats.to_dict(), batch_id=next(self._batch_ids), rows=len(records), started=started,
                     finished=time.time())
        return dict(batch) | output_columns(result, self.models.tokenizer, json.dumps(stats))


class JobPredictor(BatchspecPredictor):
    """:class:`BatchspecPredictor` handed its :class:`ActorJob` whole: what ``batchspec generate --ray`` starts
    (``fn_constructor_kwargs={"job": job}``), so the records it holds reach the actors as they are."""

    def __init__(self, job: ActorJob) -> None:
        self._start(job)


def batch_records(batch: Mapping[str, Any], prompt_column: str) -> list[PromptRecord]:
    """The batch's prompts as records (``code_completion`` from its column when there is one)."""
    if prompt_column not in batch:
        raise ValueError(f"the batch has no {prompt_column!r} column; columns: {', '.join(sorted(batch))}")
    code = batch[CODE_COLUMN] if CODE_COLUMN in batch else [False] * len(batch[prompt_column])
    return [
        PromptRecord(id=str(i), text=str(text), code_completion=bool(flag))
        for i, (text, flag) in enumerate(zip(batch[prompt_column], code, strict=True))
    ]


def output_columns(result: GenerationResult, tokenizer: Any, stats_json: str) -> dict[str, list]:
    """The columns a batch gains: decoded text, token ids, their count, finish reason and the batch's stats."""
    return {
        "text": [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in result.sequences],
        "token_ids": [list(tokens) for tokens in result.sequences],
        "num_tokens": [len(tokens) for tokens in result.sequences],
        "finish_reason": list(result.finish_reasons),
        STATS_COLUMN: [stats_json] * len(result.sequences),
    }


def merge_batch_stats(stats_json: Iterable[str]) -> tuple[GenerationStats, float]:
    """One :class:`GenerationStats` summed over distinct batches, and the seconds from the first batch's start to
    the last one's end (wall time of generation across actors; the summed ``wall_s`` counts actor-seconds)."""
    batches = {b["batch_id"]: b for b in map(json.loads, stats_json)}.values()
    total = GenerationStats()
    for batch in batches:
        for spec in fields(GenerationStats):
            value = batch[spec.name]
            if isinstance(value, dict):
                merged = getattr(total, spec.name)
                for key, n in value.items():
                    merged[int(key)] = merged.get(int(key), 0) + n
            else:
                setattr(total, spec.name, getattr(total, spec.name) + value)
    span = max((b["finished"] for b in batches), default=0.0) - min((b["started"] for b in batches), default=0.0)
    return total, span
