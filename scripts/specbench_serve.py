"""The server under load: ``batchspec serve`` decoding plainly against its default, at several numbers of clients.

The workload is 28 chats, each the first turn of its prompt with up to ``--max-tokens`` greedy tokens: the first 8
HumanEval problems and the first 4 writing, 4 qa, 4 summarization, 4 math_reasoning, 2 translation and 2 rag
prompts of SpecBench. ``N`` closed-loop streaming clients share them: each sends the next chat as soon as its last
answer has ended, until none is left. A cell is one server at one ``N``: tokens/s (answer tokens over the cell's
wall), time to first token (p50 and mean) and the gap between streamed events (p50 and p99, over every stream; an
event carries the tokens one round gave a row). The first tokens' times are bimodal (the 4 summarization prompts
arrive together and wait 8-15 s, most others under a second), so their median can jump by a second from run to run of
one server; the mean is reported beside it.

Each cell starts its own server, so that no load finds another's prompts in the prefix cache: for each repeat and
each ``N``, the plain server (``--method autoregressive``), then the default one (no method flags), so that the host's
drift falls on both alike; a ratio is the median of the repeats' default/plain tokens/s. Every answer must be the
same text on both servers at every load (greedy output is the target's own): the run fails otherwise. ``lscpu`` is
kept beside the results.

    .venv/bin/python scripts/specbench_serve.py --output runs/serve                        # 1, 4, 8, 16 clients
    .venv/bin/python scripts/specbench_serve.py --output runs/serve --clients 8 -- --quantize int8

Extra arguments after ``--`` go to both servers (e.g. ``-- --quantize int8``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from specbench import QUESTIONS, lscpu

from batchspec.data.prompts import HUMANEVAL, chat_text, load_prompts

WORKLOAD = (("humaneval", 8), ("writing", 4), ("qa", 4), ("summarization", 4), ("math_reasoning", 4),
            ("translation", 2), ("rag", 2))
SERVERS = {"plain": ["--method", "autoregressive"], "default": []}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--questions", type=Path, default=QUESTIONS, help="SpecBench's question.jsonl")
    parser.add_argument("--clients", default="1,4,8,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="plain/default pairs")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--port", type=int, default=8031)
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if not args.questions.is_file():
        parser.error(f"no SpecBench questions at {args.questions}; pass --questions PATH")
    args.output.mkdir(parents=True, exist_ok=True)
    lscpu(args.output / "lscpu.txt")
    chats = _chats(args.questions)
    clients = [int(n) for n in args.clients.split(",")]
    cells, answers = [], {}
    for repeat in range(args.repeats):
        for n in clients:
            for name, flags in SERVERS.items():
                cell, texts = _serve(args, [*flags, *extra], chats, n)
                cells.append({"server": name, "repeat": repeat, "clients": n, **cell})
                answers.setdefault(n, {})[(name, repeat)] = texts
                print(f"specbench_serve: {name} x{n}: {cell['tokens_per_s']:.2f} tokens/s", file=sys.stderr, flush=True)
                _write(args.output, cells, clients)
    differing = _differing(answers)
    (args.output / "answers_differ.json").write_text(json.dumps(differing, indent=1))
    texts = {f"{name} x{n} repeat {repeat}": texts
             for n, runs in answers.items() for (name, repeat), texts in runs.items()}
    (args.output / "answers.json").write_text(json.dumps(texts, indent=1))
    print((args.output / "serve.md").read_text())
    if differing:
        print(f"specbench_serve: {len(differing)} answers differ between servers or loads", file=sys.stderr)
        return 1
    return 0


def _chats(questions: Path) -> list[str]:
    """The workload's 28 user messages, in order."""
    chats = []
    for source, count in WORKLOAD:
        records = (load_prompts(HUMANEVAL, limit=count) if source == "humaneval"
                   else load_prompts(questions, category=source, limit=count))
        chats += [chat_text(record) for record in records]
    return chats


def _serve(args: argparse.Namespace, flags: list[str], chats: list[str], clients: int) -> tuple[dict, list[str]]:
    """Start a server, run every chat through ``clients`` clients (:func:`_load`) after one warm-up, stop it."""
    base = f"http://127.0.0.1:{args.port}"
    command = [str(Path(sys.executable).parent / "batchspec"), "serve", "--port", str(args.port),
               "--max-batch-size", str(args.max_batch_size), "--log-level", "warning", *flags]
    server = subprocess.Popen(command)
    try:
        wait_for_health(base, server)
        with httpx.Client(timeout=600) as client:
            _stream(client, base, "Hello", args.max_tokens)  # warm-up, sharing no prefix with a chat but the template's
        return _load(base, chats, clients, args.max_tokens)
    finally:
        server.terminate()
        server.wait(120)


def wait_for_health(base: str, server: subprocess.Popen) -> None:
    for _ in range(1200):
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not come up in 10 minutes")


def _stream(client: httpx.Client, base: str, chat: str, max_tokens: int) -> tuple[float, list[float], str, int]:
    """One streamed greedy chat: when it was sent, its events' arrival times, its text and its token count."""
    body = {"messages": [{"role": "user", "content": chat}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    sent, stamps, parts, tokens = time.perf_counter(), [], [], 0
    with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"the server answered {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    stamps.append(time.perf_counter())
                    parts.append(content)
    return sent, stamps, "".join(parts), tokens


def _load(base: str, chats: list[str], clients: int, max_tokens: int) -> tuple[dict, list[str]]:
    """Every chat through ``clients`` closed-loop streaming clients: the cell's figures and the answers in order."""
    todo = list(enumerate(chats))
    lock = threading.Lock()
    results: dict[int, tuple[float, list[float], str, int]] = {}
    failures: list[BaseException] = []

    def client_loop() -> None:
        with httpx.Client(timeout=600) as client:
            while True:
                with lock:
                    if not todo or failures:
                        return
                    i, chat = todo.pop(0)
                try:
                    results[i] = _stream(client, base, chat, max_tokens)
                except Exception as error:  # the run fails below, with the first error
                    failures.append(error)
                    return

    started = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if failures:
        raise failures[0]
    first = [stamps[0] - sent for sent, stamps, _, _ in results.values() if stamps]
    gaps = [b - a for _, stamps, _, _ in results.values() for a, b in zip(stamps, stamps[1:], strict=False)]
    tokens = sum(count for *_, count in results.values())
    cell = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_s": _quantile(first, 0.5), "ttft_mean_s": statistics.fmean(first) if first else 0.0,
            "gap_p50_s": _quantile(gaps, 0.5), "gap_p99_s": _quantile(gaps, 0.99)}
    return cell, [results[i][2] for i in range(len(chats))]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _differing(answers: dict[int, dict[tuple[str, int], list[str]]]) -> list[dict]:
    """Chats whose answer is not one text on every server, load and repeat."""
    runs = [(n, key, texts) for n, by_run in answers.items() for key, texts in by_run.items()]
    if not runs:
        return []
    reference = runs[0][2]
    return [{"chat": i, "clients": n, "server": key[0], "repeat": key[1]}
            for n, key, texts in runs
            for i, (text, ref) in enumerate(zip(texts, reference, strict=True)) if text != ref]


def _rows(cells: list[dict], clients: list[int]) -> list[dict]:
    rows = []
    for n in clients:
        plain = [c for c in cells if c["clients"] == n and c["server"] == "plain"]
        default = [c for c in cells if c["clients"] == n and c["server"] == "default"]
        pairs = [(p, d) for p in plain for d in default if p["repeat"] == d["repeat"]]
        if not pairs:
            continue
        rows.append({
            "clients": n,
            "ratio": statistics.median(d["tokens_per_s"] / p["tokens_per_s"] for p, d in pairs),
            **{f"{name}_{key}": statistics.median(c[key] for c in group)
               for name, group in (("plain", plain), ("default", default))
               for key in ("tokens_per_s", "ttft_p50_s", "ttft_mean_s", "gap_p50_s", "gap_p99_s")},
        })
    return rows


def _write(output: Path, cells: list[dict], clients: list[int]) -> None:
    rows = _rows(cells, clients)
    (output / "serve.json").write_text(json.dumps({"cells": cells, "rows": rows}, indent=1))
    lines = ["| clients | plain tokens/s | default tokens/s | ratio (median of pairs) | time to first token, p50 "
             "plain / default | time to first token, mean plain / default | gap p50 plain / default | "
             "gap p99 plain / default |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['clients']} | {r['plain_tokens_per_s']:.2f} | {r['default_tokens_per_s']:.2f} | {r['ratio']:.2f}× | "
            f"{r['plain_ttft_p50_s']:.2f} / {r['default_ttft_p50_s']:.2f} s | "
            f"{r['plain_ttft_mean_s']:.2f} / {r['default_ttft_mean_s']:.2f} s | "
            f"{1000 * r['plain_gap_p50_s']:.0f} / {1000 * r['default_gap_p50_s']:.0f} ms | "
            f"{1000 * r['plain_gap_p99_s']:.0f} / {1000 * r['default_gap_p99_s']:.0f} ms |")
    (output / "serve.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
