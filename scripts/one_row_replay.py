"""The adaptive planner at one row (B = 1) on SpecBench, replayed without the host's noise (issue 76)::

    .venv/bin/python scripts/one_row_replay.py --output runs/replay [--data runs/replay/data.json] [--fixed 1,2,3,4]

A change to the planner moves the default by a few percent, and the same cell here moves by 30% between minutes; so
this replays the planner over what the models do instead of timing them. First, from the models (skipped with
``--data``, the ``data.json`` an earlier run wrote):

1. the target's greedy answers to each category's first ``--limit`` prompts (first turn, chat template), plain;
2. the draft's choice at every answer position (:func:`one_row_bound.draft_choices`, its own forward over its
   drafting vocabulary): along a correct prefix, what it proposes there;
3. forward costs at one row after 200 cached columns (:func:`one_row_bound.forward_costs`): the target's and the
   draft's of 1 to 256 tokens (:class:`Costs` interpolates between them).

Then each category runs through the engine's own planner (:func:`~batchspec.engine.draft_length.planner_for`) and the
hybrid proposer's rules, one prompt after another as ``generate`` runs them at ``batch_size=1``: a round's drafts are
the row's lookup chain (``NgramProposer``), past it the draft model's choices, and past a model draft a lookup on the
device (``lookup_on_device`` over a suffix of ``past_model_n_min`` tokens) where it finds one, which takes the place
without a forward. The target accepts the longest prefix equal to its answer (every replayed answer must be the
target's). A round costs ``c_t(1 + n)`` and its draft forwards ``c_d(width)``, the first reading what the draft
lacks (the whole prompt where it never ran); reading a prompt costs ``c_t(P)``, and ``c_d(P)`` more where the draft
reads prompts along (a fixed ``k``). Plain decoding: ``c_t(P)`` and ``c_t(1)`` a token. Host work is left out (about
a millisecond a round, 2-4% of a step). The planner observes the modelled seconds as the engine's measured ones.

Writes ``replay.json`` and ``replay.md`` (tokens/s over plain's and tokens a round, per category and policy) to
``--output``, with ``data.json`` and ``lscpu.txt`` where it ran the models.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from one_row_bound import draft_choices, forward_costs
from specbench import CATEGORIES, QUESTIONS, lscpu

from batchspec import generate
from batchspec.config import SpecConfig
from batchspec.data.prompts import format_prompts, load_prompts
from batchspec.engine.draft_length import RoundRecord, planner_for
from batchspec.engine.lookup import lookup_on_device
from batchspec.engine.proposers.draft import past_model_n_min
from batchspec.engine.proposers.ngram import NgramProposer
from batchspec.engine.state import FINISH_EOS, FINISH_LENGTH, Sequence
from batchspec.model_checks import forward_weights
from batchspec.models.loading import load_pair

TARGET_WIDTHS = (*range(1, 12), 16, 32, 64, 128, 256)
DRAFT_WIDTHS = (1, 2, 3, 4, 6, 8, 16, 32, 64, 128, 256)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--data", type=Path, help="a data.json an earlier run wrote (no model is run)")
    parser.add_argument("--questions", type=Path, default=QUESTIONS, help="SpecBench's question.jsonl")
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--fixed", default="1,2,3,4", help="fixed drafts a round to replay besides 'auto'")
    parser.add_argument("--quantize", default="int8")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    if args.data is None:
        if not args.questions.is_file():
            parser.error(f"no SpecBench questions at {args.questions}; pass --questions PATH")
        lscpu(args.output / "lscpu.txt")
        data = gather(args)
        (args.output / "data.json").write_text(json.dumps(data) + "\n")
    else:
        data = json.loads(args.data.read_text())
    costs = Costs.measured(data["costs"])
    policies = ["auto", *(int(k) for k in args.fixed.split(",") if k)]
    report = {"costs": costs.summary(), "policies": {}}
    for policy in policies:
        cells = {category: replay(cell, policy, costs, data) for category, cell in data["categories"].items()}
        report["policies"][str(policy)] = {"categories": cells, "overall": _overall(cells.values())}
        print(f"one_row_replay: {policy}: {report['policies'][str(policy)]['overall']}", file=sys.stderr)
    (args.output / "replay.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.output / "replay.md").write_text(_table(report))
    print(_table(report))
    return 0


def gather(args: argparse.Namespace) -> dict:
    """The models' part: each category's prompts, the target's answers and the draft's choices; the forward costs;
    the draft's share of the weights a forward multiplies by (the planner's prior for its cost) and the EOS id."""
    pair = load_pair("qwen2.5-coder", quantize=args.quantize, progress=False)
    vocabulary = SpecConfig().draft_vocabulary
    categories = {}
    for category in args.categories.split(","):
        prompts = format_prompts(load_prompts(args.questions, category=category, limit=args.limit), pair.tokenizer)
        result = generate(pair.target, pair.draft, prompts, max_new_tokens=args.max_new_tokens, batch_size=8,
                          method="autoregressive", eos_token_id=pair.tokenizer.eos_token_id)
        answers = [list(sequence) for sequence in result.sequences]
        choices = [draft_choices(pair.draft, prompt, answer, vocabulary)
                   for prompt, answer in zip(prompts, answers, strict=True)]
        categories[category] = {"prompts": prompts, "answers": answers, "choices": choices}
        print(f"one_row_replay: {category}: answers and choices", file=sys.stderr, flush=True)
    return {"categories": categories, "costs": forward_costs(pair, vocabulary, TARGET_WIDTHS, DRAFT_WIDTHS),
            "draft_share": forward_weights(pair.draft, vocabulary) / forward_weights(pair.target),
            "eos": pair.tokenizer.eos_token_id, "max_new_tokens": args.max_new_tokens}


@dataclass(frozen=True)
class Costs:
    """Seconds of a forward of ``n`` tokens at one row, as measured: between two measured widths on the line through
    them, past the widest on the line through the two widest. (Not one fitted line: the int8 forward's seconds rise in
    steps, e.g. 45 ms for 1-3 tokens and 57 for 4-6 on 2 vCPUs of a Zen 4, and a line through them prices a plain
    step 9% low.)"""

    target: tuple[tuple[int, float], ...]
    draft: tuple[tuple[int, float], ...]

    @classmethod
    def measured(cls, measured: dict[str, dict]) -> Costs:
        points = {model: tuple(sorted((int(n), seconds) for n, seconds in widths.items()))
                  for model, widths in measured.items()}
        return cls(points["target"], points["draft"])

    def t(self, n: int) -> float:
        return _interpolated(self.target, n)

    def d(self, n: int) -> float:
        return _interpolated(self.draft, n)

    def summary(self) -> dict:
        return {"target_1_s": self.t(1), "draft_1_s": self.d(1), "target_256_s": self.t(256),
                "draft_256_s": self.d(256)}


def _interpolated(points: tuple[tuple[int, float], ...], n: int) -> float:
    """The seconds at width ``n`` on the line through the two measured ``points`` around it (the two widest past
    them; the narrowest below them)."""
    right = next((i for i, (width, _) in enumerate(points) if width >= n), len(points) - 1)
    (n0, s0), (n1, s1) = points[max(right - 1, 0)], points[max(right, 1)]
    return s0 + (s1 - s0) * (n - n0) / (n1 - n0)


def replay(cell: dict, policy: int | str, costs: Costs, data: dict) -> dict:
    """One category at one row under ``policy`` (``"auto"`` or a fixed ``k``): seconds, plain decoding's seconds,
    tokens and rounds."""
    config = SpecConfig(num_draft_tokens=policy)
    planner = planner_for(config, data["draft_share"], ragged=True)
    lookup = NgramProposer(config.ngram_min, config.ngram_max)
    total = {"seconds": 0.0, "plain_s": 0.0, "tokens": 0, "rounds": 0}
    for prompt, answer, choices in zip(cell["prompts"], cell["answers"], cell["choices"], strict=True):
        read = costs.t(len(prompt))
        planner.read(len(prompt), read, draft=False)
        total["plain_s"] += read + len(answer) * costs.t(1)
        total["seconds"] += read
        held = 0  # columns the draft's cache holds
        if planner.drafting:  # a fixed k: the draft reads the prompt along
            total["seconds"] += costs.d(len(prompt))
            planner.read(len(prompt), costs.d(len(prompt)), draft=True)
            held = len(prompt)
        row = Sequence(0, list(prompt), data["max_new_tokens"])
        while not row.finished:
            seconds, held = _round(row, planner, lookup, (answer, choices, held), costs)
            _finish(row, data["eos"])
            total["seconds"] += seconds
            total["rounds"] += 1
        if row.output != answer:
            raise RuntimeError("a replayed answer differs from the target's")
        total["tokens"] += len(answer)
    return {**total, "ratio": total["plain_s"] / total["seconds"], "per_round": total["tokens"] / total["rounds"]}


def _round(row: Sequence, planner, lookup: NgramProposer, state: tuple[list[int], list[int], int],
           costs: Costs) -> tuple[float, int]:
    """One round of ``row``: planned, proposed, accepted against the answer, observed by the planner. ``state``: the
    answer, the draft's choices and the columns the draft holds. Returns the round's seconds and the columns held."""
    answer, choices, held = state
    at, content = len(row.output), row.content_len
    reach = replace(lookup.reach([row], planner.limit), uses_draft_model=True, lag=[content - 1 - held])
    n = planner.lengths([row], reach, False)[0]
    drafts, forwards = _drafts(row, lookup, n, (answer, choices), content - held)
    accepted = 0
    while accepted < n and at + accepted < len(answer) and drafts[accepted] == answer[at + accepted]:
        accepted += 1
    gained = answer[at : at + accepted + 1]
    first = reach.first[0]
    draft_s = sum(costs.d(width) for _, width in forwards)
    seconds = costs.t(1 + n) + draft_s
    chained = [[j < reach.lookups[0] for j in range(n + 1)]]
    shadow = [None if n or first is None else first == gained[0]]
    row.output.extend(gained)
    planner.observe([row], RoundRecord([n], [accepted], chained, shadow, n, len(forwards), seconds, draft_s,
                                       draft_width=forwards[0][1] if forwards else 0))
    if forwards:  # the draft read the content and the drafts before the last position it drafted
        held = content + min(accepted, forwards[-1][0])
    return seconds, held


def _drafts(row: Sequence, lookup: NgramProposer, n: int, truth: tuple[list[int], list[int]],
            lacking: int) -> tuple[list[int], list[tuple[int, int]]]:
    """The ``n`` drafts of the round and its draft forwards (the position each drafts, the columns it reads), as the
    hybrid proposer makes them: the chain's lookups, then at each position the device lookup past a model draft
    (:func:`~batchspec.engine.proposers.draft.past_model_n_min`) or else a forward of the draft over the columns it
    lacks and the lookups since (its choice where every draft before it is the answer's token; after a wrong draft
    nothing is accepted, and -1 stands for it)."""
    answer, choices = truth
    at = len(row.output)
    chain = lookup.chains([row], n + 1)[0] if n else []
    drafts: list[int] = []
    forwards: list[tuple[int, int]] = []
    width = lacking
    for j in range(n):
        token = chain[j] if j < len(chain) else _looked_up(row, drafts, lookup) if j > len(chain) else None
        if token is None:
            right = at + j < len(answer) and drafts == answer[at : at + j]
            token = choices[at + j] if right else -1
            forwards.append((j, width))
            width = 0
        drafts.append(token)
        width += 1
    return drafts, forwards


def _looked_up(row: Sequence, drafts: list[int], lookup: NgramProposer) -> int | None:
    """The device lookup of the position after ``drafts`` (None: no suffix of ``past_model_n_min`` tokens)."""
    text = torch.tensor([row.content + drafts])  # [1, T]
    n_min = past_model_n_min(lookup.n_min, lookup.n_max)
    token, hit = lookup_on_device(text, torch.zeros(1, dtype=torch.long), n_min, lookup.n_max)  # [1], [1]
    return int(token[0]) if bool(hit[0]) else None


def _finish(row: Sequence, eos: int) -> None:
    if row.output and row.output[-1] == eos:
        row.finish_reason = FINISH_EOS
    elif row.remaining <= 0:
        row.finish_reason = FINISH_LENGTH


def _overall(cells) -> dict:
    cells = list(cells)
    seconds, plain = sum(c["seconds"] for c in cells), sum(c["plain_s"] for c in cells)
    return {"ratio": round(plain / seconds, 3), "per_round": round(sum(c["tokens"] for c in cells)
                                                                  / sum(c["rounds"] for c in cells), 2)}


def _table(report: dict) -> str:
    policies = report["policies"]
    categories = list(next(iter(policies.values()))["categories"])
    lines = ["| policy | overall | " + " | ".join(categories) + " |", "| --- " * (len(categories) + 2) + "|"]
    for policy, result in policies.items():
        cells = [f"{c['ratio']:.2f}x ({c['per_round']:.2f})" for c in result["categories"].values()]
        overall = result["overall"]
        lines.append(f"| {policy} | {overall['ratio']:.3f}x ({overall['per_round']:.2f}) | " + " | ".join(cells) + " |")
    costs = report["costs"]
    lines.append("")
    lines.append(f"Replayed tokens/s over plain decoding's (tokens a round); costs: target "
                 f"{costs['target_1_s'] * 1e3:.1f} ms a token, draft {costs['draft_1_s'] * 1e3:.1f} ms.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
