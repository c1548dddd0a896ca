"""The real ``gemma3`` preset (Gemma 3 270M, a base model; no draft model, it drafts by prompt lookup): a family other
than the Llama-like ones, exact on the fused integer forward. Batched EqSpec and ExSpec with prompt lookup equal the
target's own greedy output, prompt by prompt (EqSpec in int8, ExSpec in int4); the forward that runs is the fused
one.

The prompts are short enough that the sliding layers' 512-position window is not reached: the window's masking is
tested on tiny models (``tests/test_integer_forward.py``), where prompts pass it. CI obtains the preset first
(``scripts/setup.sh test``), so there a missing preset fails instead of skipping.
"""

from __future__ import annotations

import pytest
from helpers import cached_or_skip

import batchspec
from batchspec.exact.integer.forward import forward_in_use
from batchspec.models.loading import load_settings, load_specs

torch = pytest.importorskip("torch")

PROMPTS = (
    "def fibonacci(n):\n", "The capital of France is", "import numpy as np\n\ndef moving_average(x, w):\n",
    "Once upon a time, in a small village,", "class Stack:\n    def __init__(self):\n",
)
MAX_NEW_TOKENS = 24
BATCH_SIZE = 4


@pytest.mark.parametrize(("width", "method"), [("int8", "eqspec"), ("int4", "exspec")])
def test_gemma3_batched_lookup_decoding_equals_its_own_greedy(reference, width, method):
    cached_or_skip("gemma3")
    ((model, tokenizer),) = load_specs(["gemma3:target"], load_settings("auto", "cpu", width, "auto", False),
                                       progress=False)
    assert model.config.model_type == "gemma3_text"
    assert forward_in_use(model) == "fused"
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    eos = model.generation_config.eos_token_id
    expected = [reference(model, ids, MAX_NEW_TOKENS, eos) for ids in prompts]
    result = batchspec.generate(model, None, prompts, method=method, proposer="ngram", batch_size=BATCH_SIZE,
                                max_new_tokens=MAX_NEW_TOKENS, check_invariants=True)
    assert result.sequences == expected, width
    assert result.stats.draft_tokens_proposed > 0
