"""What bounds the default at one row (B = 1) on SpecBench, measured in one process (issue 76: "where a target is
missed, say by how much and what bounds it, measured: acceptance, the draft's cost")::

    .venv/bin/python scripts/one_row_bound.py --output runs/one_row [--categories coding,writing] [--fixed 3]

For each category's first ``--limit`` prompts (first turn, chat template, ``--max-new-tokens``):

1. **Agreement, as it drafts**: the target's greedy answers (plain decoding), then the preset's draft reading each
   prompt and answer on the pair's own forward (int8 by default, its output layer over the drafting vocabulary,
   ``SpecConfig.draft_vocabulary``): at each answer position its argmax either is the target's token or not, so a
   chain of ``k`` drafts accepts exactly what :func:`draft_agreement.accepted_length` walks (``E_k``, tokens a round).
2. **Costs**: the target's forward of ``n`` tokens at one row and the draft's of one and two (a round's first draft
   forward reads the bonus token and the pending one), after 200 cached columns, medians of alternated repeats.
3. **The bound of a fixed k**: a round of ``k`` model drafts costs ``c_d(2) + (k - 1) c_d(1) + c_t(k + 1)`` and gains
   ``E_k`` tokens, against ``c_t(1)`` a token plainly: ``E_k c_t(1) / round``, the best ``k``'s. It leaves out prompt
   lookup (free drafts where an answer copies its prompt) and the prompt: ``overall`` weighs it by plain decoding's
   share of time reading the prompt (measured here), and ``overall_read`` also charges the draft's reading of it
   (``c_d / c_t`` of the target's).
4. **Measured**: plain decoding, the default (``k`` auto) and ``--fixed`` drafts a round (hybrid), alternated
   ``A B F F B A`` in one process; each ratio is the median over the pairs. Every answer must be the target's own.

Writes ``one_row.json`` and ``one_row.md`` to ``--output`` (and ``lscpu.txt``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from draft_agreement import accepted_length
from specbench import CATEGORIES, QUESTIONS, lscpu

from batchspec import generate
from batchspec.bench.costs import time_forward
from batchspec.config import SpecConfig
from batchspec.data.prompts import format_prompts, load_prompts
from batchspec.engine.kv_cache import BatchKVCache
from batchspec.engine.runner import ModelRunner
from batchspec.engine.state import BatchState
from batchspec.models.loading import load_pair

CONTEXT = 200  # cached columns before each timed forward
KS = range(1, 7)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--questions", type=Path, default=QUESTIONS, help="SpecBench's question.jsonl")
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--fixed", type=int, default=3, help="drafts a round of the fixed-k runs")
    parser.add_argument("--quantize", default="int8")
    args = parser.parse_args()
    if not args.questions.is_file():
        parser.error(f"no SpecBench questions at {args.questions}; pass --questions PATH")
    args.output.mkdir(parents=True, exist_ok=True)
    lscpu(args.output / "lscpu.txt")
    pair = load_pair("qwen2.5-coder", quantize=args.quantize, progress=False)
    vocabulary = SpecConfig().draft_vocabulary
    costs = forward_costs(pair, vocabulary, range(1, max(KS) + 2), (1, 2))
    cells = {}
    for category in args.categories.split(","):
        prompts = format_prompts(load_prompts(args.questions, category=category, limit=args.limit), pair.tokenizer)
        runs = _runs(pair, prompts, args)
        matches = [[c == t for c, t in zip(draft_choices(pair.draft, prompt, answer, vocabulary), answer, strict=True)]
                   for prompt, answer in zip(prompts, runs["answers"], strict=True)]
        cells[category] = _cell(matches, costs, runs)
        print(f"one_row_bound: {category}: {json.dumps(cells[category]['summary'])}", file=sys.stderr, flush=True)
    report = {"costs_s": costs, "fixed": args.fixed, "categories": cells}
    (args.output / "one_row.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.output / "one_row.md").write_text(_table(report))
    print(_table(report))
    return 0


def forward_costs(pair, vocabulary: int, target_widths, draft_widths) -> dict[str, dict[int, float]]:
    """Medians of three alternated passes at one row after :data:`CONTEXT` cached columns: the target's forward of
    ``n`` tokens ``c_t(1, n)`` for each of ``target_widths`` and the draft's ``c_d(1, n)`` (over its drafting
    ``vocabulary``) for each of ``draft_widths``; 7 timed repeats of each below 32 tokens, 2 from there."""
    target = {n: [] for n in target_widths}
    draft = {n: [] for n in draft_widths}
    for _ in range(3):
        for n in target:
            target[n].append(time_forward(pair.target, 1, n, CONTEXT, 7 if n < 32 else 2))
        for n in draft:
            draft[n].append(time_forward(pair.draft, 1, n, CONTEXT, 7 if n < 32 else 2, vocabulary))
    return {"target": {n: statistics.median(v) for n, v in target.items()},
            "draft": {n: statistics.median(v) for n, v in draft.items()}}


def _runs(pair, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Plain (A), the default (B) and fixed k (F), alternated A B F F B A at one row: seconds, prompt-reading
    seconds and tokens a round of each, and the answers (all equal, else an error)."""
    options = {"A": dict(method="autoregressive"), "B": dict(method="eqspec"),
               "F": dict(method="eqspec", num_draft_tokens=args.fixed)}
    seconds = {m: [] for m in options}
    prefill = {m: [] for m in options}
    per_round = {m: [] for m in options}
    answers = None
    for m in "ABFFBA":
        started = time.perf_counter()
        result = generate(pair.target, pair.draft, prompts, max_new_tokens=args.max_new_tokens, batch_size=1,
                          eos_token_id=pair.tokenizer.eos_token_id, **options[m])
        seconds[m].append(time.perf_counter() - started)
        prefill[m].append(result.stats.prefill_s)
        per_round[m].append(result.stats.mean_tokens_per_row_round)
        sequences = [list(s) for s in result.sequences]
        answers = answers or sequences
        if sequences != answers:
            raise RuntimeError(f"{m}: an answer differs from plain decoding's")
    return {"seconds": seconds, "prefill": prefill, "per_round": per_round, "answers": answers}


@torch.inference_mode()
def draft_choices(draft, prompt: list[int], answer: list[int], vocabulary: int) -> list[int]:
    """Per answer position, the draft's argmax (over its drafting vocabulary, on its own forward) after the prompt
    and the answer before it: what it proposes there along a correct prefix."""
    runner = ModelRunner(next(draft.parameters()).device)
    ids = torch.tensor([prompt + answer])  # [1, P+A]
    cache = BatchKVCache.for_model(draft)
    batch = BatchState.dense(ids, cache)
    runner.read(draft, batch, cache, ids[:, : len(prompt) - 1])
    logits = runner.logits(draft, batch, cache, ids[:, len(prompt) - 1 : -1], keep=len(answer),
                           vocabulary=vocabulary)  # [1, A, V]
    return logits[0].argmax(-1).tolist()


def _cell(matches: list[list[bool]], costs: dict, runs: dict) -> dict:
    """One category: agreement, E_k, each fixed k's decode bound, the overall bounds and the measured ratios."""
    c_t, c_d = costs["target"], costs["draft"]
    e = {k: accepted_length(matches, k) for k in KS}
    decode = {k: e[k] * c_t[1] / (c_d[2] + (k - 1) * c_d[1] + c_t[k + 1]) for k in KS}
    best = max(decode, key=decode.get)
    plain_s = statistics.median(runs["seconds"]["A"])
    share = statistics.median(p / s for p, s in zip(runs["prefill"]["A"], runs["seconds"]["A"], strict=True))
    read = c_d[1] / c_t[1]
    pairs = {m: [a / b for a, b in zip(runs["seconds"]["A"], runs["seconds"][m], strict=True)]
             for m in "BF"}
    summary = {
        "agreement": round(sum(map(sum, matches)) / sum(map(len, matches)), 3),
        "best_k": best, "decode_bound": round(decode[best], 2), "prompt_share": round(share, 3),
        "overall_bound": round(1 / (share + (1 - share) / decode[best]), 2),
        "overall_read_bound": round(1 / (share * (1 + read) + (1 - share) / decode[best]), 2),
        "default": round(statistics.median(pairs["B"]), 2), "fixed": round(statistics.median(pairs["F"]), 2),
        "default_per_round": round(statistics.mean(runs["per_round"]["B"]), 2),
        "fixed_per_round": round(statistics.mean(runs["per_round"]["F"]), 2),
    }
    return {"summary": summary, "E": e, "decode_bound": decode, "pairs": pairs, "plain_s": plain_s,
            "runs": {key: runs[key] for key in ("seconds", "prefill", "per_round")}}


def _table(report: dict) -> str:
    k = report["fixed"]
    lines = ["| category | draft agreement | E_1 / E_2 / E_3 | best fixed k, decode bound | prompt share (plain) | "
             "bound overall (draft reading the prompt) | default, ratio (tokens a round) | "
             f"k = {k}, ratio (tokens a round) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for category, cell in report["categories"].items():
        s, e = cell["summary"], cell["E"]
        lines.append(f"| {category} | {s['agreement']:.2f} | {e[1]:.2f} / {e[2]:.2f} / {e[3]:.2f} | {s['best_k']}, "
                     f"{s['decode_bound']:.2f}× | {s['prompt_share']:.0%} | {s['overall_bound']:.2f}× "
                     f"({s['overall_read_bound']:.2f}×) | {s['default']:.2f}× ({s['default_per_round']:.2f}) | "
                     f"{s['fixed']:.2f}× ({s['fixed_per_round']:.2f}) |")
    c_t, c_d = report["costs_s"]["target"], report["costs_s"]["draft"]
    lines.append("")
    lines.append(f"Costs at one row after {CONTEXT} columns: target {1000 * c_t[1]:.1f} ms (1 token) to "
                 f"{1000 * c_t[max(c_t)]:.1f} ms ({max(c_t)} tokens); draft {1000 * c_d[1]:.1f} ms (1), "
                 f"{1000 * c_d[2]:.1f} ms (2): {c_d[1] / c_t[1]:.2f} of the target's step.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
