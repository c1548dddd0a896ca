"""How well the draft-length planner predicts acceptance: for every draft it proposed, the chance it priced the draft
at against whether the target accepted it, by source (lookup or draft model) and place (a run's first draft or a
later one), and the tokens it expected from a round's drafts against those that came.

The planner (``batchspec.engine.draft_length.AdaptiveLength``) is wrapped, not changed: each round's lengths, the
shares they were priced with and the chains it planned on are kept, and its record of the round says what was
accepted. A planner whose predictions run high drafts too much; one whose run low, too little.

    .venv/bin/python scripts/planner_calibration.py --category coding --batch-size 1
    .venv/bin/python scripts/planner_calibration.py --category writing --batch-size 4 --quantize int4 --json out.json

SpecBench's prompts are read from ../shared/data/spec_bench/question.jsonl (or --questions).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from batchspec import generate
from batchspec.data.prompts import format_prompts, load_prompts
from batchspec.engine import draft_length
from batchspec.models.loading import load_settings, load_specs

QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


class Calibration:
    """Wraps ``AdaptiveLength.lengths`` and ``observe`` to keep, per proposed draft that was tested, (source, place,
    the chance it was priced at, accepted), and per round the tokens expected and got."""

    def __init__(self) -> None:
        self.drafts: list[tuple[str, str, float, int]] = []
        self.expected = self.got = 0.0
        self._pending: tuple | None = None

    def install(self) -> None:
        lengths, observe = draft_length.AdaptiveLength.lengths, draft_length.AdaptiveLength.observe
        calibration = self

        def wrapped_lengths(planner, rows, reach, sampled, **options):
            chosen = lengths(planner, rows, reach, sampled, **options)
            shares = [planner._shares(row, alone=len(rows) == 1) for row in rows]
            calibration._pending = (chosen, list(reach.lookups), shares, reach.uses_draft_model)
            return chosen

        def wrapped_observe(planner, rows, record):
            calibration.count(record)
            return observe(planner, rows, record)

        draft_length.AdaptiveLength.lengths = wrapped_lengths
        draft_length.AdaptiveLength.observe = wrapped_observe

    def count(self, record) -> None:
        chosen, lookups, shares, model = self._pending
        for n, found, share, accepted in zip(chosen, lookups, shares, record.accepted, strict=True):
            self.expected += sum(draft_length._gains(n, found, share, model))
            self.got += accepted
            for j in range(min(accepted + 1, n)):
                source = "lookup" if j < found else "model"
                place = "first" if j in (0, found) else "later"
                chance = getattr(share, f"{source}_{place}")
                self.drafts.append((source, place, chance, int(j < accepted)))

    def report(self) -> dict:
        groups = defaultdict(list)
        for source, place, chance, accepted in self.drafts:
            groups[f"{source} {place}"].append((chance, accepted))
        by_group = {name: {"tested": len(items), "priced": sum(c for c, _ in items) / len(items),
                           "accepted": sum(a for _, a in items) / len(items)} for name, items in sorted(groups.items())}
        return {"expected_tokens": self.expected, "got_tokens": self.got, "drafts": by_group}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--category", default="coding")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--quantize", default="int8")
    parser.add_argument("--questions", type=Path, default=QUESTIONS)
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()
    if not args.questions.is_file():
        parser.error(f"no SpecBench questions at {args.questions}; pass --questions PATH")
    settings = load_settings("auto", "cpu", args.quantize, "auto", False)
    (target, tokenizer), (draft, _) = load_specs(["qwen2.5-coder:target", "qwen2.5-coder:draft"], settings,
                                                 progress=False)
    prompts = format_prompts(load_prompts(str(args.questions), category=args.category, limit=args.limit), tokenizer)
    calibration = Calibration()
    calibration.install()
    result = generate(target, draft, prompts, method="eqspec", batch_size=args.batch_size,
                      max_new_tokens=args.max_new_tokens)
    report = {"category": args.category, "batch_size": args.batch_size, "wall_s": result.stats.wall_s,
              "mean_accepted": result.stats.mean_accepted_length, **calibration.report()}
    print(f"{args.category}, B = {args.batch_size}: {report['wall_s']:.2f} s, {report['mean_accepted']:.2f} tokens a "
          f"round; drafts expected to give {report['expected_tokens']:.1f} tokens, gave {report['got_tokens']:.0f}")
    for name, group in report["drafts"].items():
        print(f"  {name:13s} {group['tested']:5d} tested, priced {group['priced']:.3f}, "
              f"accepted {group['accepted']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
