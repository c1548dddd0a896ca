"""Peak and steady memory of each preset's pair per --quantize mode (issue 62), one JSON line per run.

    python docs/results/2026-11-28c-cpu/memory.py > memory.jsonl

Each run is `batchspec generate --preset P --prompts humaneval --limit 8 --batch-size 8 --max-new-tokens 64
--quantize Q` in a process of its own under `/usr/bin/time -v`: `peak_gb` is its maximum resident set (kbytes x 1024
bytes), `load_peak_gb` the peak when the models had loaded and `steady_gb` the resident set when generation had
ended (what a server holds between requests), both from the command's own lines, `load_s` its loading line.
"""

import json
import re
import subprocess
import sys

for preset in ("qwen2.5-coder", "smollm2"):
    for quantize in ("int8", "int4", "none"):
        command = ["/usr/bin/time", "-v", sys.executable, "-m", "batchspec", "generate", "--preset", preset,
                   "--prompts", "humaneval", "--limit", "8", "--batch-size", "8", "--max-new-tokens", "64",
                   "--quantize", quantize, "--output", "/dev/null"]
        run = subprocess.run(command, capture_output=True, text=True)
        text = run.stdout + run.stderr
        peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1)) * 1024
        load = re.search(r"Loaded .* in ([\d.]+) s, peak ([\d.]+) GB", text)
        steady = float(re.search(r"memory +peak [\d.]+ GB, now ([\d.]+) GB", text).group(1))
        rate = re.search(r"= ([\d.]+) tokens/s", text)
        print(json.dumps({"preset": preset, "quantize": quantize, "peak_gb": round(peak / 1e9, 2),
                          "load_peak_gb": float(load.group(2)), "steady_gb": steady, "load_s": float(load.group(1)),
                          "tokens_per_s": rate and float(rate.group(1)), "rc": run.returncode}), flush=True)
