"""Issue 61, seventh stop: what the qwen2.5-coder pair holds once loaded (resident set), the peak of the load, and how
much of it is in transparent huge pages. One JSON line:

    PYTHONPATH=src python docs/results/2026-11-28g-cpu/held.py int4 after
"""

import json
import sys

from batchspec.memory import peak_resident_bytes, resident_bytes
from batchspec.models import load_model

quantize, code = sys.argv[1], sys.argv[2]
target, _ = load_model("qwen2.5-coder:target", progress=False, quantize=quantize)
draft, _ = load_model("qwen2.5-coder:draft", progress=False, quantize=quantize)
with open("/proc/self/smaps_rollup") as rollup:
    huge = next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("AnonHugePages:"))
print(json.dumps({"code": code, "quantize": quantize, "resident_gb": round(resident_bytes() / 1e9, 3),
                  "peak_gb": round(peak_resident_bytes() / 1e9, 3), "huge_pages_gb": round(huge / 1e9, 3)}))
