"""Resident memory and load time of the loaded qwen2.5-coder pair: ``python memory.py none|int8`` prints JSON.

Each mode in its own process; float32 uses the default (packed) kernels.
"""

from __future__ import annotations

import json
import sys
import time

from batchspec.models import load_pair


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        text = f.read()
    return int(text.split(f"{field}:")[1].split()[0]) * 1024


quantize = sys.argv[1]
started = time.perf_counter()
pair = load_pair("qwen2.5-coder", quantize=quantize, progress=False)
print(json.dumps({"quantize": quantize, "precision": pair.precision, "seconds": round(time.perf_counter() - started, 1),
                  "VmRSS_GB": round(status("VmRSS") / 1e9, 2), "VmHWM_GB": round(status("VmHWM") / 1e9, 2)}))
