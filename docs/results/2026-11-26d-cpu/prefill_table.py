"""Issue 35: the bench's prompt reading (prefill_s) of the issue's day's code and of this code, from run_all.sh's
results, and the ratio."""
import json
from pathlib import Path

here = Path(__file__).parent
for name in ("humaneval", "summaries"):
    before = {c["batch_size"]: c for c in json.loads((here / f"prefill_issue_{name}" / "results.json").read_text())}
    after = {c["batch_size"]: c for c in json.loads((here / f"prefill_{name}" / "results.json").read_text())}
    for size in sorted(after):
        old, new = before[size]["prefill_s"], after[size]["prefill_s"]
        print(f"{name}, B = {size}: prompts read in {old:.2f} s on the issue's day's code, {new:.2f} s now: "
              f"{old / new:.2f}x")
