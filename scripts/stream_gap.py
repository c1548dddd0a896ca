"""How long a running stream stalls when a long prompt arrives: chunked prefill measured on a real server.

Starts ``batchspec serve --preset smollm2 --prefill-chunk CHUNK`` on 127.0.0.1:PORT and streams one greedy chat answer
of up to 400 tokens twice: alone (the baseline: how long the stream's own rounds take at each point of the answer),
then again with a ~3,000-token completion request sent after its 8th event. Prints one JSON line: the stream's
median gap between events before the long request, its longest gap while the long request was being served, that
gap over the baseline's median gap around the same event (how many of the stream's own rounds it took; the rounds
grow as the answer does), the median of that ratio over the long request, and how long the long request took.
``CHUNK`` is ``auto``, a number of columns, or a number larger than the prompt (100000) to read it in one piece.

    python scripts/stream_gap.py auto 8013
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
from specbench_serve import wait_for_health

from batchspec.models.loading import load_model

PARAGRAPH = (
    "The history of the city is long and full of change. Merchants came by river, built warehouses, "
    "argued about taxes and founded schools. "
)
STREAM_REQUEST = {
    "model": "smollm2", "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
    "max_tokens": 400, "temperature": 0, "stream": True,
}


def long_text(tokenizer, tokens: int) -> str:
    text = PARAGRAPH
    while len(tokenizer.encode(text)) < tokens:
        text += PARAGRAPH
    return text


def stream(client: httpx.Client, base: str, on_event=None) -> tuple[list[float], int]:
    """The arrival times of one stream's events; ``on_event(n)`` is called after the ``n``-th."""
    stamps: list[float] = []
    with client.stream("POST", base + "/v1/chat/completions", json=STREAM_REQUEST) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
                if on_event is not None:
                    on_event(len(stamps))
        return stamps, response.status_code


def rounds_of(gap: float, event: int, baseline: list[float]) -> float:
    """``gap`` (before event ``event``) in units of the baseline stream's own median gap around that event."""
    around = sorted(baseline[max(0, event - 10) : event + 10] or baseline[-10:])
    return gap / around[len(around) // 2]


def measure(base: str, text: str) -> dict:
    client = httpx.Client(timeout=600)
    client.post(base + "/v1/completions", json={"model": "smollm2", "prompt": "Hello", "max_tokens": 8})  # warm-up
    alone, _ = stream(client, base)
    baseline = [b - a for a, b in zip(alone, alone[1:], strict=False)]
    long_done: dict = {}

    def long_request() -> None:
        sent = time.perf_counter()
        reply = client.post(base + "/v1/completions",
                            json={"model": "smollm2", "prompt": text, "max_tokens": 8, "temperature": 0})
        long_done.update(sent=sent, seconds=time.perf_counter() - sent, status=reply.status_code)

    sender = threading.Thread(target=long_request)
    stamps, status = stream(client, base, lambda n: sender.start() if n == 8 else None)
    sender.join()
    gaps = [(a, b, b - a) for a, b in zip(stamps, stamps[1:], strict=False)]
    before = sorted(g for _, _, g in gaps[:7])
    end = long_done["sent"] + long_done["seconds"]
    during = [(i, g) for i, (a, b, g) in enumerate(gaps) if b >= long_done["sent"] and a <= end]
    ratios = sorted(rounds_of(g, i, baseline) for i, g in during)
    at, longest = max(during, key=lambda item: item[1])
    return {
        "stream_events": len(stamps), "stream_status": status, "median_gap_before_s": before[len(before) // 2],
        "max_gap_while_long_prompt_s": longest, "max_gap_in_own_rounds": rounds_of(longest, at, baseline),
        "max_ratio_to_own_rounds": ratios[-1], "median_ratio_to_own_rounds": ratios[len(ratios) // 2],
        "long_request_s": long_done["seconds"], "long_status": long_done["status"],
    }


def main(chunk: str, port: int) -> None:
    _, tokenizer = load_model("smollm2:target", progress=False)
    text = long_text(tokenizer, 3000)
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "batchspec", "serve", "--preset", "smollm2", "--port", str(port),
               "--max-batch-size", "8", "--prefill-chunk", chunk, "--log-level", "warning"]
    server = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    try:
        wait_for_health(base, server)
        result = measure(base, text)
    finally:
        server.terminate()
        server.wait(60)
    print(json.dumps({"prefill_chunk": chunk, "long_prompt_tokens": len(tokenizer.encode(text)), **result}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
