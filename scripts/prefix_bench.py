"""What the prefix cache saves, through the server, with the cache off and on; prints JSON.

    python scripts/prefix_bench.py [--preset qwen2.5-coder] [--out FILE]

Three workloads, each against a server with ``--prefix-cache-size 0`` and then one with the default (``auto``),
the models loaded once (int8 on the CPU, the default method and proposer), all requests streamed:

* **chat**: a conversation of ``--turns`` turns; every turn adds a user message of about ``--turn-tokens`` tokens
  (texts of SpecBench's RAG prompts, cut), sends the whole conversation, and appends the assistant's answer.
  Reported: the time to first token of every turn.
* **agents**: ``--agents`` requests sent at once that share a system prompt of about ``--system-tokens`` tokens
  (SpecBench summarization texts), each with its own short question. Reported: the engine's prefill seconds
  (``GenerationStats.prefill_s``) and the wall time until all are answered.
* **bounded** (cache on only, ``--bounded`` bytes): ``--chats`` chats of two to four turns over four shared system
  prompts in random order, one request at a time; the process's resident memory and the cache's bytes are read at
  every quarter of the run (the models alone hold most of it; ``rss_before_bounded`` is the figure before).

Outputs are compared between the cache-off and cache-on servers on the first two workloads (the same tokens are
expected). Each server answers one short request before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from contextlib import contextmanager

import httpx

from batchspec.memory import keep_freed_memory
from batchspec.models import load_pair
from batchspec.server import ServerConfig, create_app, serve_in_thread

QUESTIONS = "../shared/data/spec_bench/question.jsonl"


def texts(category: str) -> list[str]:
    with open(QUESTIONS) as f:
        rows = [json.loads(line) for line in f]
    return [row["turns"][0] for row in rows if row["category"] == category]


def cut(tokenizer, text: str, tokens: int) -> str:
    return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:tokens])


@contextmanager
def server(pair, size):
    config = ServerConfig.of(prefix_cache_size=size, batch_size=8)
    with serve_in_thread(create_app(pair, config)) as running:
        stream(running.url, [{"role": "user", "content": "Hello"}], 4)  # warm-up: first-call costs are not timed
        yield running


def stream(url: str, messages: list[dict], max_tokens: int) -> tuple[float, str, dict]:
    """Seconds to the first generated token, the answer and the usage of one streamed chat request."""
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    started, first, parts, usage = time.perf_counter(), None, [], {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                if choice["delta"].get("content") and first is None:
                    first = time.perf_counter() - started
                parts.append(choice["delta"].get("content") or "")
            usage = chunk.get("usage") or usage
    return first if first is not None else time.perf_counter() - started, "".join(parts), usage


def chat(url: str, tokenizer, turns: int, turn_tokens: int, max_tokens: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are a careful assistant. Answer briefly."}]
    out = []
    for text in texts("rag")[:turns]:
        messages.append({"role": "user", "content": cut(tokenizer, text, turn_tokens)})
        ttft, answer, usage = stream(url, messages, max_tokens)
        messages.append({"role": "assistant", "content": answer})
        out.append({"ttft_s": ttft, "prompt_tokens": usage.get("prompt_tokens"), "answer": answer,
                    "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens")})
    return out


def agents(url: str, app, tokenizer, count: int, system_tokens: int, max_tokens: int) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    system = cut(tokenizer, " ".join(texts("summarization")), system_tokens)
    questions = [cut(tokenizer, text, 40) for text in texts("qa")[:count]]
    stats = app.state.serving.loop.engine.stats
    before, started = stats.prefill_s, time.perf_counter()
    with ThreadPoolExecutor(count) as pool:
        replies = list(pool.map(lambda q: stream(url, [{"role": "system", "content": system},
                                                        {"role": "user", "content": q}], max_tokens), questions))
    return {"prefill_s": stats.prefill_s - before, "wall_s": time.perf_counter() - started,
            "ttft_s": [r[0] for r in replies], "answers": [r[1] for r in replies],
            "cached_tokens": [r[2].get("prompt_tokens_details", {}).get("cached_tokens") for r in replies]}


def bounded(url: str, app, tokenizer, chats: int, max_tokens: int) -> list[dict]:
    rng = random.Random(0)
    systems = [cut(tokenizer, text, 400) for text in texts("summarization")[:4]]
    questions = [cut(tokenizer, text, 120) for text in texts("qa")]
    cache = app.state.serving.loop.engine.prefixes
    quarters = []
    for i in range(chats):
        messages = [{"role": "system", "content": rng.choice(systems)}]
        for _ in range(rng.randint(2, 4)):
            messages.append({"role": "user", "content": rng.choice(questions)})
            messages.append({"role": "assistant", "content": stream(url, messages, max_tokens)[1]})
        if (i + 1) % max(1, chats // 4) == 0:
            quarters.append({"chats": i + 1, "cache_bytes": cache.stats.bytes_held, "rss_bytes": resident(),
                             "evicted": cache.stats.evicted})
    return quarters


def resident() -> int:
    """The process's resident memory now, in bytes (``VmRSS``)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-coder")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--turn-tokens", type=int, default=300)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--chats", type=int, default=40)
    parser.add_argument("--bounded", type=int, default=64 << 20)
    parser.add_argument("--out")
    args = parser.parse_args()
    pair = load_pair(args.preset, progress=False)
    keep_freed_memory()
    tokenizer = pair.tokenizer
    report: dict = {"preset": args.preset}
    for side, size in (("off", 0), ("on", "auto")):
        with server(pair, size) as running:
            report[f"chat_{side}"] = chat(running.url, tokenizer, args.turns, args.turn_tokens, args.max_tokens)
            report[f"agents_{side}"] = agents(running.url, running.app, tokenizer, args.agents, args.system_tokens,
                                              args.max_tokens)
    report["same_chat_answers"] = [t["answer"] for t in report["chat_on"]] == [t["answer"] for t in report["chat_off"]]
    report["same_agent_answers"] = report["agents_on"]["answers"] == report["agents_off"]["answers"]
    report["last_turn_ttft_ratio"] = report["chat_on"][-1]["ttft_s"] / report["chat_off"][-1]["ttft_s"]
    report["agents_prefill_ratio"] = report["agents_on"]["prefill_s"] / report["agents_off"]["prefill_s"]
    report["rss_before_bounded"] = resident()
    with server(pair, args.bounded) as running:
        report["bounded"] = {"bytes": args.bounded, "quarters": bounded(running.url, running.app, tokenizer,
                                                                         args.chats, args.max_tokens)}
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
