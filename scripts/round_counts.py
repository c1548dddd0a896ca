"""What each round of a served load reads, counted: the causes of the long gaps between streamed events.

Drives the engine in process the way ``batchspec serve`` does (its settings: chunked prefill ``auto``, the online
scheduler of ``--method``), under ``N`` closed-loop clients over :mod:`specbench_serve`'s 28 chats (each client
sends its next chat as soon as its last answer ends), and records per round: the rows that decode, the prompt
columns the target read (its chunks), the columns the draft read apart (with the target's chunks, or catching
rows up before it drafts), the columns per row its first forward read, its forwards, the verification's width
and the round's wall seconds. A gap between a row's events is the rounds between them; the rounds of the longest
gaps are printed with their counts, then one JSON line of totals. Timings are noisy on a shared host; the counts
are not.

    .venv/bin/python scripts/round_counts.py --preset smollm2 --clients 8
    .venv/bin/python scripts/round_counts.py --preset qwen2.5-coder --quantize int8 --clients 8
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from specbench import QUESTIONS
from specbench_serve import _chats

import batchspec.engine.core as core
from batchspec.engine import Sequence, drive, make_scheduler
from batchspec.models.choice import ModelChoice
from batchspec.run import build_run, load_run, resolve_run
from batchspec.server.settings import serving_settings


@dataclass
class Round:
    """One round's counts (columns are token positions: rows x columns)."""

    rows: int = 0
    target_read: int = 0  # prompt columns the target read (chunks)
    draft_read: int = 0  # columns the draft read along with the target's chunks
    draft_catch_up: int = 0  # columns the draft read apart, catching rows up before it drafts
    draft_width: int = 0  # columns per row of the draft's first forward (0: it did not run)
    forwards: int = 0
    k: int = 0
    seconds: float = 0.0

    @property
    def first_forward(self) -> int:
        """Token positions the draft's first forward read."""
        return self.rows * self.draft_width


@dataclass
class Counter:
    """Wraps the engine's readings and the planner's records to count every round."""

    engine: core.Engine
    rounds: list[Round] = field(default_factory=list)

    def install(self) -> None:
        engine = self.engine
        reading, observe, step, decode = core.catch_up, engine.planner.observe, engine.step, engine.decode

        def counted_catch_up(rows, readers, runner, **read):
            done = reading(rows, readers, runner, **read)
            self.rounds[-1].target_read += done.tokens.get(False, 0)
            apart = all(reader.is_draft for reader in readers)
            if apart:
                self.rounds[-1].draft_catch_up += done.tokens.get(True, 0)
            else:
                self.rounds[-1].draft_read += done.tokens.get(True, 0)
            return done

        def counted_observe(rows, record):
            self.rounds[-1].draft_width, self.rounds[-1].forwards = record.draft_width, record.forwards
            self.rounds[-1].k = record.k
            return observe(rows, record)

        def counted_step(rows, **kwargs):
            self.rounds.append(Round())
            started = time.perf_counter()
            step(rows, **kwargs)
            self.rounds[-1].seconds = time.perf_counter() - started

        def counted_decode(rows, **kwargs):
            self.rounds[-1].rows = len(rows)
            return decode(rows, **kwargs)

        core.catch_up = counted_catch_up
        self.engine.decode = counted_decode
        self.engine.planner.observe = counted_observe
        self.engine.step = counted_step


class Clients:
    """``clients`` closed-loop clients over ``prompts``: hooks for :func:`~batchspec.engine.drive`, which also keep
    each row's event rounds (a round in which it gained tokens)."""

    def __init__(self, prompts: list[list[int]], clients: int, max_tokens: int, counter: Counter) -> None:
        self.queue = deque(enumerate(prompts))
        self.free, self.max_tokens, self.counter = clients, max_tokens, counter
        self.events: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def admit(self, scheduler) -> bool:
        while self.free and self.queue:
            index, prompt = self.queue.popleft()
            scheduler.add(Sequence(index, prompt, self.max_tokens))
            self.free -= 1
        return scheduler.waiting + scheduler.running > 0

    def ran(self, rows: list[Sequence], finished: list[Sequence]) -> None:
        for row in rows:
            if len(row.output) > self.lengths.get(row.index, 0):
                self.events.setdefault(row.index, []).append(len(self.counter.rounds) - 1)
                self.lengths[row.index] = len(row.output)
        self.free += len(finished)

    def failed(self, rows: list[Sequence], error: Exception) -> None:
        raise error

    def gaps(self) -> list[tuple[float, int, int]]:
        """Every gap between two events of a row: its seconds and the rounds it spans (after ``a``, up to ``b``)."""
        rounds = self.counter.rounds
        out = []
        for marks in self.events.values():
            for a, b in zip(marks, marks[1:], strict=False):
                out.append((sum(r.seconds for r in rounds[a + 1 : b + 1]), a + 1, b))
        return sorted(out, reverse=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2")
    parser.add_argument("--quantize", default="none")
    parser.add_argument("--method", default="eqspec")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--chats", type=int, default=28)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--show", type=int, default=12, help="longest gaps printed")
    args = parser.parse_args()
    run = resolve_run(serving_settings(method=args.method, batch_size=args.max_batch_size),
                      ModelChoice(preset=args.preset, quantize=args.quantize))
    models = load_run(run, progress=False)
    engine = build_run(run, models.target, models.draft)
    prompts = [_encode(models.tokenizer, chat) for chat in _chats(QUESTIONS)[: args.chats]]
    counter = Counter(engine)
    counter.install()
    clients = Clients(prompts, args.clients, args.max_tokens, counter)
    with torch.inference_mode():
        drive(engine, make_scheduler(engine.config, online=True), clients)
    _report(counter.rounds, clients.gaps(), args.show)
    return 0


def _encode(tokenizer, chat: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": chat}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _report(rounds: list[Round], gaps: list[tuple[float, int, int]], show: int) -> None:
    """The longest gaps with their rounds' counts, then the totals as one JSON line."""
    print("gap_s  round  rows  target_read  draft_read  catch_up  draft_width  first_forward  forwards  k  round_s")
    for seconds, a, b in gaps[:show]:
        for i in range(a, b + 1):
            r = rounds[i]
            print(f"{seconds:5.3f}  {i:5d}  {r.rows:4d}  {r.target_read:11d}  {r.draft_read:10d}  {r.draft_catch_up:8d}"
                  f"  {r.draft_width:11d}"
                  f"  {r.first_forward:13d}  {r.forwards:8d}  {r.k:d}  {r.seconds:.3f}")
    print("longest rounds:")
    for i in sorted(range(len(rounds)), key=lambda i: -rounds[i].seconds)[:show]:
        r = rounds[i]
        print(f"  round {i}: {r.seconds:.3f} s, {r.rows} rows, target read {r.target_read},"
              f" catch-up {r.draft_catch_up}, first forward {r.draft_width} x {r.rows}, {r.forwards} forwards, k {r.k}")
    decoding = [r for r in rounds if r.rows]
    p99 = gaps[max(0, len(gaps) // 100 - 1)][0] if gaps else 0.0
    p50 = gaps[len(gaps) // 2][0] if gaps else 0.0
    print(json.dumps({
        "rounds": len(rounds), "decoding_rounds": len(decoding), "gaps": len(gaps), "gap_p50_s": round(p50, 4),
        "gap_p99_s": round(p99, 4),
        "max_draft_read_decoding": max((r.draft_read for r in decoding), default=0),
        "max_target_read_decoding": max((r.target_read for r in decoding), default=0),
        "max_draft_width": max((r.draft_width for r in decoding), default=0),
        "max_draft_catch_up_decoding": max((r.draft_catch_up for r in decoding), default=0),
        "rounds_draft_read_over_64": sum(r.draft_read > 64 for r in decoding),
        "rounds_catch_up_over_64": sum(r.draft_catch_up > 64 for r in decoding),
        "rounds_first_forward_over_64": sum(r.first_forward > 64 for r in decoding),
        "draft_rounds": sum(r.forwards > 0 for r in decoding),
        "draft_read_total": sum(r.draft_read for r in rounds),
        "draft_catch_up_total": sum(r.draft_catch_up for r in rounds),
        "target_read_total": sum(r.target_read for r in rounds),
    }))


if __name__ == "__main__":
    raise SystemExit(main())
