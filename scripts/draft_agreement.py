"""How well candidate drafts would do on SpecBench, measured without running speculation: each draft's agreement
with the target's own greedy answers, teacher-forced (issue 76: "a draft that costs at most a tenth of the target":
measure each way, then pick)::

    .venv/bin/python scripts/draft_agreement.py --references runs/results/specbench --out agreement.json
    .venv/bin/python scripts/draft_agreement.py --references runs/results/specbench --layers 24,16 --other ''

``--references`` is a ``scripts/specbench.py`` output folder: each category's ``reference.json`` holds the target's
greedy answers (transformers' own ``generate``, one prompt at a time), in the order of the category's first prompts.
Each prompt is formatted as the bench formats it (the target's chat template).

**Same tokenizer** (``--draft``, the preset's draft): the draft reads the prompt and the whole answer in one forward;
at each answer position its argmax either equals the target's next token or not. Along a correct prefix that argmax is
what the draft would propose there, so a greedy chain of ``k`` drafts from position ``t`` is accepted for ``min(L_t,
k)`` tokens, ``L_t`` the run of agreements from ``t``, and the round gains one more (the target's own). The mean
accepted length ``E_k`` (tokens a round) follows exactly, for a draft alone at a fixed ``k``, by walking the answer
round by round. ``--layers 24,16,12`` also measures the draft cut to that many layers (the first and last kept, the
others evenly spaced): a draft of fewer layers, untrained.

**Another tokenizer** (``--other``, e.g. the ``smollm2`` preset's target, SmolLM2-135M): universal assisted generation
drafts in the other model's tokens and hands the target their text. Here the prompt and answer are decoded to text and
re-read by the other tokenizer; agreement is counted per token of that tokenization, ``E_k`` in its tokens, and
``target_per_token`` (target tokens per other token over the answers) converts them. That ignores what re-tokenizing at
a round's edge costs, so it is an upper bound on what the other draft gets.

Models run in bfloat16 through transformers (their argmax can differ from the int8 forward's at near ties). Output:
per draft and category the agreement and ``E_k`` for ``--k``; JSON on stdout or ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchspec.data.prompts import format_prompts, load_prompts
from batchspec.models.obtain import obtain_preset

QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


def runs(match: list[bool]) -> list[int]:
    """``L_t``: how many answer positions from ``t`` on the draft agrees with in a row."""
    out = [0] * (len(match) + 1)
    for t in range(len(match) - 1, -1, -1):
        out[t] = out[t + 1] + 1 if match[t] else 0
    return out


def accepted_length(matches: list[list[bool]], k: int) -> float:
    """Tokens a round (accepted drafts and the target's own) of greedy chains of ``k`` drafts, over all answers."""
    tokens = rounds = 0
    for match in matches:
        agree, position = runs(match), 0
        while position < len(match):
            position += min(agree[position], k) + 1
            rounds += 1
        tokens += len(match)
    return tokens / max(rounds, 1)


def workload(references: Path, questions: Path, tokenizer, categories: list[str]) -> list[tuple[str, list, list]]:
    """``(category, prompt ids, answer ids)`` for every answer in ``references``."""
    out = []
    for category in categories:
        answers = json.loads((references / category / "reference.json").read_text())["sequences"]
        records = load_prompts(questions, category=category, limit=len(answers))
        out += [(category, prompt, answer) for prompt, answer in
                zip(format_prompts(records, tokenizer), answers, strict=True)]
    return out


@torch.inference_mode()
def agreement(model, prompt: list[int], answer: list[int]) -> list[bool]:
    """Per answer position, whether ``model``'s argmax after the prompt and the answer before it is the answer's
    token."""
    logits = model(torch.tensor([prompt + answer]), use_cache=False).logits[0]  # [P+A, V]
    guesses = logits[len(prompt) - 1 : len(prompt) + len(answer) - 1].argmax(-1)  # [A]
    return (guesses == torch.tensor(answer)).tolist()


def cut(model, keep: int):
    """``model`` with ``keep`` of its layers: the first and last, the others evenly spaced."""
    layers = model.model.layers
    total = len(layers)
    if not 2 <= keep <= total:
        raise ValueError(f"--layers: keep 2 to {total} layers, got {keep}")
    chosen = sorted({round(i * (total - 1) / (keep - 1)) for i in range(keep)})
    model.model.layers = torch.nn.ModuleList(layers[i] for i in chosen)
    model.config.num_hidden_layers = len(chosen)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in chosen]
    return model, chosen


def summary(matches: dict[str, list[list[bool]]], ks: list[int], per_token: dict[str, float] | None = None) -> dict:
    """Per category: agreement, ``E_k`` for each ``k`` (and the target tokens per draft token, for another
    tokenizer)."""
    out = {}
    for category, rows in matches.items():
        cell = {"agreement": round(sum(map(sum, rows)) / max(sum(map(len, rows)), 1), 3)}
        cell.update({f"E{k}": round(accepted_length(rows, k), 2) for k in ks})
        if per_token is not None:
            cell["target_per_token"] = round(per_token[category], 3)
        out[category] = cell
    return out


def same_tokenizer(path: Path, items, layers: list[int], ks: list[int]) -> list[dict]:
    """The draft at ``path`` whole and cut to each of ``layers``, on every answer."""
    results = []
    for keep in layers or [0]:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        chosen = list(range(model.config.num_hidden_layers))
        if keep:
            model, chosen = cut(model, keep)
        matches: dict[str, list[list[bool]]] = {}
        for category, prompt, answer in items:
            matches.setdefault(category, []).append(agreement(model, prompt, answer))
        results.append({"draft": str(path), "layers": chosen, "categories": summary(matches, ks)})
        print(f"draft_agreement: {path.name}, {len(chosen)} layers done", file=sys.stderr)
    return results


def other_tokenizer(path: Path, items, target_tokenizer, ks: list[int]) -> dict:
    """The draft at ``path``, of another tokenizer, on every answer's text (see the module docstring)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    matches: dict[str, list[list[bool]]] = {}
    counts: dict[str, list[int]] = {}
    for category, prompt, answer in items:
        prompt_text = target_tokenizer.decode(prompt)
        ids = tokenizer.encode(prompt_text + target_tokenizer.decode(answer), add_special_tokens=False)
        alone = tokenizer.encode(prompt_text, add_special_tokens=False)
        start = len(alone) if ids[: len(alone)] == alone else len(alone) - 1  # else a token spans the edge
        matches.setdefault(category, []).append(agreement(model, ids[:start], ids[start:]))
        target_tokens, other_tokens = counts.setdefault(category, [0, 0])
        counts[category] = [target_tokens + len(answer), other_tokens + len(ids) - start]
    per_token = {category: t / max(o, 1) for category, (t, o) in counts.items()}
    return {"draft": str(path), "tokenizer": "other", "categories": summary(matches, ks, per_token)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--references", type=Path, required=True, help="a scripts/specbench.py output folder")
    parser.add_argument("--questions", type=Path, default=QUESTIONS, help="SpecBench's question.jsonl")
    parser.add_argument("--preset", default="qwen2.5-coder", help="its target's tokenizer and its draft")
    parser.add_argument("--layers", default="", help="also the draft cut to these layer counts, e.g. 16,12")
    parser.add_argument("--other", default="smollm2", help="a preset whose target drafts through text ('': none)")
    parser.add_argument("--k", default="1,2,3,4,6", help="draft lengths for E_k")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    categories = sorted(p.parent.name for p in args.references.glob("*/reference.json"))
    if not categories:
        parser.error(f"no */reference.json under {args.references}: run scripts/specbench.py first")
    ks = [int(k) for k in args.k.split(",")]
    pair = obtain_preset(args.preset)
    tokenizer = AutoTokenizer.from_pretrained(pair.target_dir)
    items = workload(args.references, args.questions, tokenizer, categories)
    layers = [int(n) for n in args.layers.split(",") if n]
    if pair.draft_dir is None:
        parser.error(f"preset {args.preset} has no draft model")
    results = same_tokenizer(pair.draft_dir, items, layers, ks)
    if args.other:
        results.append(other_tokenizer(obtain_preset(args.other).target_dir, items, tokenizer, ks))
    text = json.dumps({"answers": len(items), "results": results}, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
