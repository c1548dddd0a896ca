"""Issue 62: what bounding the heap's resident free memory between rounds (``batchspec.memory.HeapWatch``) costs in
speed: the bench's eqspec/hybrid cell at B = 8 (8 HumanEval prompts x 64 tokens, and 4 summarization
prompts x 32 tokens, whose long prompts free the most between rounds), with the bound at its default and at 2**62
bytes (never given back while rows run), alternated twice, one process each:

    PYTHONPATH=src python docs/results/2026-11-28e-cpu/ab_heapwatch.py  (from the repository root, ../shared beside it)
    > docs/results/2026-11-28e-cpu/ab_heapwatch.jsonl
"""

import json
import subprocess
import sys

RUN = """
import sys
import batchspec.memory as memory
if sys.argv[1] == "unbounded":
    memory.HELD_FREE_BYTES = 2**62
from batchspec.cli import app
sys.argv = ["batchspec", *sys.argv[2:]]
app()
"""
WORKLOADS = {
    "humaneval": ["--prompts", "humaneval", "-n", "8", "--max-new-tokens", "64"],
    "summarization": ["--prompts", "../shared/data/spec_bench/question.jsonl", "--category", "summarization", "-n",
                      "4", "--max-new-tokens", "32"],
}

for round_ in (1, 2):
    for name, workload in WORKLOADS.items():
        for bound in ("default", "unbounded"):
            out = f"/tmp/ab_heapwatch_{name}_{bound}"
            command = [sys.executable, "-c", RUN, bound, "bench", "--preset", "qwen2.5-coder", *workload,
                       "--batch-sizes", "8", "--methods", "eqspec", "--proposers", "hybrid",
                       "--prefix-cache-size", "0", "-o", out]
            subprocess.run(command, check=True, capture_output=True)
            with open(f"{out}/results.json") as results:
                rows = json.load(results)
            for row in rows:
                print(json.dumps({"round": round_, "workload": name, "bound": bound, "batch_size": row["batch_size"],
                                  "tokens_per_s": round(row["tokens_per_s"], 2),
                                  "prefill_s": round(row["prefill_s"], 2), "wall_s": round(row["wall_s"], 2)}),
                      flush=True)
