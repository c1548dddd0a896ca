"""Issue 35: the bench's prompt reading (prefill_s) of the issue's day's code and of this code, from a run_all.sh's
results in the folder given (this script's own by default), and the ratio:

    python docs/results/2026-11-26c-cpu/prefill_table.py docs/results/2026-11-26d-cpu
"""
import json
import sys
from pathlib import Path

here = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
for name in ("humaneval", "summaries"):
    before = {c["batch_size"]: c for c in json.loads((here / f"prefill_issue_{name}" / "results.json").read_text())}
    after = {c["batch_size"]: c for c in json.loads((here / f"prefill_{name}" / "results.json").read_text())}
    for size in sorted(after):
        old, new = before[size]["prefill_s"], after[size]["prefill_s"]
        print(f"{name}, B = {size}: prompts read in {old:.2f} s on the issue's day's code, {new:.2f} s now: "
              f"{old / new:.2f}x")
