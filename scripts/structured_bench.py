"""Structured outputs on a real model: every object parses and validates, and what the grammar costs; prints JSON.

    python scripts/structured_bench.py [--preset qwen2.5-coder] [--objects 200] [--batch-size 8] [--out FILE]

Four schemas of the kind an agent fills (a tool call's arguments, a plan, a record, a review comment), written as
pydantic models; each prompt asks, through the chat template, for one object of one schema about one subject. The
same prompts are generated twice with ``batchspec.generate`` (greedy, the default method and proposer): with the
schema's grammar (``GrammarCompiler.json_schema``), then without. Reported: how many constrained outputs parse and
validate against their pydantic model, tokens/s of both runs and their ratio, over the whole run and over decoding
alone (the prompts are the same, but constrained answers are shorter, so prompt reading weighs more in them).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

import batchspec
from batchspec.engine.grammar import GrammarCompiler
from batchspec.memory import keep_freed_memory
from batchspec.models import load_pair

SUBJECTS = ["Paris", "a bakery", "Tokyo", "a bug in a parser", "the Moon landing", "a chess club", "Lagos", "a garden",
            "a database migration", "Reykjavik", "a wedding", "a robot vacuum", "Lima", "a marathon", "a library",
            "a podcast", "Nairobi", "a kernel panic", "a school trip", "Oslo", "a coffee shop", "a hackathon",
            "Quito", "a power outage", "a bike repair"]


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict structured outputs

    location: str = Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


class Step(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: int
    action: str = Field(max_length=60)


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    goal: str = Field(max_length=80)
    steps: list[Step] = Field(min_length=1, max_length=4)
    done: bool


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=130)
    email: str = Field(max_length=60)
    tags: list[str] = Field(max_length=4)


class Review(BaseModel):
    model_config = ConfigDict(extra="forbid")

    file: str = Field(max_length=40)
    line: int = Field(ge=1)
    severity: Literal["info", "warning", "error"]
    comment: str = Field(max_length=100)


SCHEMAS = {
    "weather": (Weather, "the arguments of a weather-forecast tool call for a trip related to {}"),
    "plan": (Plan, "a short plan of steps for organising something about {}"),
    "person": (Person, "a fictional contact record for someone connected with {}"),
    "review": (Review, "a code-review comment on a program about {}"),
}


def prompts(tokenizer, objects: int) -> list[tuple[str, list[int]]]:
    """``objects`` (schema name, token ids) pairs, cycling through the schemas and the subjects."""
    out = []
    for i in range(objects):
        name = list(SCHEMAS)[i % len(SCHEMAS)]
        model, task = SCHEMAS[name]
        subject = SUBJECTS[(i // len(SCHEMAS)) % len(SUBJECTS)]
        text = (f"Reply with only a JSON object, {task.format(subject)}, following this JSON schema: "
                f"{json.dumps(model.model_json_schema())}")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        out.append((name, list(ids["input_ids"] if hasattr(ids, "keys") else ids)))
    return out


def run(pair, items, grammars, batch_size: int, max_new_tokens: int) -> tuple[list[list[int]], float, float]:
    """Outputs, seconds, and seconds spent reading prompts; with ``grammars`` each schema's prompts are generated
    under its grammar (one call per schema, so the rows of a call share it)."""
    outputs: dict[int, list[int]] = {}
    prefill = 0.0
    started = time.perf_counter()
    for name in SCHEMAS:
        index = [i for i, (n, _) in enumerate(items) if n == name]
        result = batchspec.generate(
            pair.target, pair.draft, [items[i][1] for i in index], batch_size=batch_size,
            max_new_tokens=max_new_tokens, grammar=None if grammars is None else grammars[name],
        )
        outputs.update(zip(index, result.sequences, strict=True))
        prefill += result.stats.prefill_s
    return [outputs[i] for i in range(len(items))], time.perf_counter() - started, prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-coder")
    parser.add_argument("--objects", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--out")
    args = parser.parse_args()
    pair = load_pair(args.preset, progress=False)
    keep_freed_memory()
    tokenizer = pair.tokenizer
    eos = pair.target.generation_config.eos_token_id
    compiler = GrammarCompiler(tokenizer, pair.target.config.vocab_size, [eos] if isinstance(eos, int) else eos)
    grammars = {name: compiler.json_schema(model.model_json_schema()) for name, (model, _) in SCHEMAS.items()}
    items = prompts(tokenizer, args.objects)
    constrained, with_s, with_prefill = run(pair, items, grammars, args.batch_size, args.max_new_tokens)
    free, without_s, without_prefill = run(pair, items, None, args.batch_size, args.max_new_tokens)
    valid, failures = 0, []
    for (name, _), tokens in zip(items, constrained, strict=True):
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        try:
            SCHEMAS[name][0].model_validate_json(text)
            valid += 1
        except ValidationError as error:
            failures.append({"schema": name, "text": text, "error": str(error).splitlines()[0]})
    free_valid = sum(_valid(SCHEMAS[n][0], tokenizer.decode(t, skip_special_tokens=True))
                     for (n, _), t in zip(items, free, strict=True))
    tokens_with, tokens_without = sum(map(len, constrained)), sum(map(len, free))
    report = {
        "preset": args.preset, "objects": len(items), "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens, "valid_with_schema": valid, "valid_without_schema": free_valid,
        "tokens_with_schema": tokens_with, "seconds_with_schema": with_s,
        "tokens_per_s_with_schema": tokens_with / with_s,
        "tokens_without_schema": tokens_without, "seconds_without_schema": without_s,
        "tokens_per_s_without_schema": tokens_without / without_s,
        "ratio": (tokens_with / with_s) / (tokens_without / without_s),
        "prefill_s_with_schema": with_prefill, "prefill_s_without_schema": without_prefill,
        "decode_ratio": (tokens_with / (with_s - with_prefill)) / (tokens_without / (without_s - without_prefill)),
        "failures": failures[:5],
        "examples": [tokenizer.decode(t, skip_special_tokens=True) for t in constrained[: len(SCHEMAS)]],
    }
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


def _valid(model: type[BaseModel], text: str) -> bool:
    try:
        model.model_validate_json(text)
        return True
    except ValidationError:
        return False


if __name__ == "__main__":
    main()
