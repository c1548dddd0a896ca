"""How long a request body takes to parse and validate (``BodyBounds.parse``, as the server runs it in its pool):
a completions body of ``--token-ids`` prompt token ids; prints one JSON object.

    python scripts/parse_bench.py --token-ids 32768
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from batchspec.server.bodies import BodyBounds
from batchspec.server.protocol import CompletionRequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--token-ids", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    bounds = BodyBounds(args.token_ids, 64, 64)
    raw = json.dumps({"model": "m", "prompt": list(range(1000, 1000 + args.token_ids)), "max_tokens": 16}).encode()
    seconds = []
    for _ in range(args.repeats + 1):
        started = time.perf_counter()
        bounds.parse(raw, CompletionRequest)
        seconds.append(time.perf_counter() - started)
    print(json.dumps({"body_bytes": len(raw), "token_ids": args.token_ids,
                      "median_ms": round(1000 * statistics.median(seconds[1:]), 2)}))


if __name__ == "__main__":
    main()
