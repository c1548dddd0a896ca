"""SpecBench's categories, plain decoding against the default, at several batch sizes: one JSON and one markdown table.

Each category is one ``batchspec bench --category C`` run (models loaded once per run) whose cells alternate
``autoregressive`` and the default (``eqspec``, ``hybrid``, ``k`` auto) ``--repeats`` times at each batch size, one
after another and in A B B A order, so that the host's minute-to-minute drift falls on both alike; a cell's ratio is
the median of its pairs' ratios. Three pairs by default: on a shared host one pair of a cell may run 10-20% off the
others (SpecBench coding at B = 8: pairs of 0.99x and 0.82x, nothing proposed in either), and the median of three is
one such pair's only where two agree with it.
Every cell's answers are compared with the bench's reference (transformers' own greedy ``generate``, one prompt at a
time): the table's ``exact`` is the share that equal it, and the command fails unless every one does. ``lscpu`` is
kept beside the results.

    .venv/bin/python scripts/specbench.py --output runs/specbench                      # 7 categories, B = 1, 4, 8
    .venv/bin/python scripts/specbench.py --output runs/sb --categories writing,qa --batch-sizes 8 --repeats 1

Extra arguments after ``--`` go to every ``batchspec bench`` (e.g. ``-- --quantize int4``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

CATEGORIES = ("coding", "writing", "qa", "summarization", "math_reasoning", "translation", "rag")
QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
PLAIN, DEFAULT = "autoregressive", "eqspec"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--questions", type=Path, default=QUESTIONS, help="SpecBench's question.jsonl")
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    parser.add_argument("--batch-sizes", default="1,4,8")
    parser.add_argument("--limit", type=int, default=8, help="prompts per category")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="plain/default pairs per cell")
    parser.add_argument("--preset", default="qwen2.5-coder")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if not args.questions.is_file():
        parser.error(f"no SpecBench questions at {args.questions}; pass --questions PATH")
    args.output.mkdir(parents=True, exist_ok=True)
    lscpu(args.output / "lscpu.txt")
    rows = []
    for category in args.categories.split(","):
        cells = _bench(args, category, extra)
        for size in sorted({cell["batch_size"] for cell in cells}):
            rows.append(_row(category, [cell for cell in cells if cell["batch_size"] == size]))
        _write(args.output, rows)
    print((args.output / "specbench.md").read_text())
    inexact = [f"{row['category']} at B = {row['batch_size']}" for row in rows if row["exact"] < 1]
    if inexact:
        print(f"specbench: answers differ from the reference in {', '.join(inexact)}", file=sys.stderr)
        return 1
    return 0


def _bench(args: argparse.Namespace, category: str, extra: list[str]) -> list[dict]:
    """The cells of one category's run, in the order they ran."""
    out = args.output / category
    command = [str(Path(sys.executable).parent / "batchspec"), "bench", "--preset", args.preset,
               "--prompts", str(args.questions), "--category", category, "--limit", str(args.limit),
               "--max-new-tokens", str(args.max_new_tokens), "--batch-sizes", args.batch_sizes,
               "--methods", ",".join(_alternated(args.repeats)), "--proposers", "hybrid",
               "--output", str(out), *extra]
    print(f"specbench: {category}", file=sys.stderr, flush=True)
    subprocess.run(command, check=True)
    return json.loads((out / "results.json").read_text())


def _alternated(repeats: int) -> list[str]:
    """Plain and default, ``repeats`` pairs, each pair's order the reverse of the one before (A B B A ...): the bench
    runs them one after another at each batch size, so a drift of the host's speed over a pair's minute falls on both
    of the pairs' ratios in opposite directions."""
    return [method for i in range(repeats) for method in ((PLAIN, DEFAULT) if i % 2 == 0 else (DEFAULT, PLAIN))]


def _row(category: str, cells: list[dict]) -> dict:
    """One category at one batch size: medians of the plain and default cells, the median of the pairs' ratios."""
    plain = [c for c in cells if c["method"] == PLAIN]
    default = [c for c in cells if c["method"] == DEFAULT]
    ratios = [d["tokens_per_s"] / p["tokens_per_s"] for p, d in zip(plain, default, strict=True)]
    return {
        "category": category,
        "batch_size": cells[0]["batch_size"],
        "tokens": default[0]["generated_tokens"],
        "plain_tokens_per_s": statistics.median(c["tokens_per_s"] for c in plain),
        "default_tokens_per_s": statistics.median(c["tokens_per_s"] for c in default),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "exact": min(c["exact_match"] for c in cells),
        "mean_accepted_length": statistics.median(c["mean_accepted_length"] or 1.0 for c in default),
        "plain_wall_s": statistics.median(c["wall_s"] for c in plain),
        "default_wall_s": statistics.median(c["wall_s"] for c in default),
    }


def _write(output: Path, rows: list[dict]) -> None:
    """specbench.json and specbench.md, with the all-categories ratio per batch size (summed wall time)."""
    summary = {}
    for size in sorted({row["batch_size"] for row in rows}):
        mine = [row for row in rows if row["batch_size"] == size]
        summary[size] = sum(r["plain_wall_s"] for r in mine) / sum(r["default_wall_s"] for r in mine)
    (output / "specbench.json").write_text(json.dumps({"rows": rows, "overall": summary}, indent=2))
    lines = ["| category | B | tokens | plain tokens/s | default tokens/s | ratio (median of pairs) | mean accepted "
             "| exact |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['category']} | {r['batch_size']} | {r['tokens']} | {r['plain_tokens_per_s']:.2f} | "
              f"{r['default_tokens_per_s']:.2f} | {r['ratio']:.2f}× | {r['mean_accepted_length']:.2f} | "
              f"{r['exact']:.2f} |" for r in rows]
    lines += ["", "Over the categories (summed wall time): "
              + ", ".join(f"B = {size}: {ratio:.2f}×" for size, ratio in summary.items())]
    (output / "specbench.md").write_text("\n".join(lines) + "\n")


def lscpu(path: Path) -> None:
    if shutil.which("lscpu"):
        path.write_text(subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout)


if __name__ == "__main__":
    sys.exit(main())
