"""The real ``smollm2`` preset: batched EqSpec, ExSpec and autoregressive decoding equal the target's own greedy output.

The reference is transformers' ``generate`` on each prompt alone (batch size 1, ``do_sample=False``).
Both models run in float32, where the batched and the single-prompt forward passes agree closely
enough that no argmax near-tie flips. CI obtains the preset first (``scripts/setup.sh test`` runs
``batchspec fetch --preset smollm2``), so there a missing preset fails instead of skipping.
"""

from __future__ import annotations

import json

import pytest
from test_real_model_prep import cached_or_skip
from typer.testing import CliRunner

import batchspec
from batchspec.cli import app
from batchspec.data import format_prompts, load_prompts
from batchspec.models import loading

torch = pytest.importorskip("torch")

NUM_PROMPTS = 4
BATCH_SIZE = 4
MAX_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def smollm2():
    cached_or_skip("smollm2")
    return loading.load_pair("smollm2", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def humaneval_ids(smollm2) -> list[list[int]]:
    return format_prompts(load_prompts("humaneval", limit=NUM_PROMPTS), smollm2.tokenizer)


@pytest.fixture(scope="module")
def expected(smollm2, humaneval_ids, reference) -> list[list[int]]:
    eos = smollm2.target.generation_config.eos_token_id
    return [reference(smollm2.target, ids, MAX_NEW_TOKENS, eos) for ids in humaneval_ids]


@pytest.mark.parametrize("method", ["eqspec", "exspec", "autoregressive"])
def test_batched_generation_equals_target_greedy(smollm2, humaneval_ids, expected, method):
    result = batchspec.generate(
        smollm2.target, smollm2.draft, humaneval_ids, method=method, batch_size=BATCH_SIZE,
        max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=5, check_invariants=True,
    )
    assert result.sequences == expected
    assert result.stats.generated_tokens == sum(map(len, expected))
    if method != "autoregressive":
        assert result.stats.ragged_rounds > 0
        assert 0.2 < result.stats.acceptance_rate < 1.0


def test_cli_generate_on_the_preset(smollm2, expected, tmp_path):
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, [
        "generate", "--preset", "smollm2", "--limit", str(NUM_PROMPTS), "--batch-size", str(BATCH_SIZE),
        "--max-new-tokens", str(MAX_NEW_TOKENS), "--dtype", "float32", "--output", str(out),
    ])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["token_ids"] for row in rows] == expected
    assert "def " in rows[0]["text"]
    assert "acceptance rate" in result.stdout
