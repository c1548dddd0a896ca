"""Penalties, logit bias, grammars and logprobs (:mod:`batchspec.engine.shaping`, ``grammar``, ``logprobs``).

Each is part of the distribution a request asks for, so the property is the one batchspec exists for: with the int8
forward, greedy output with the shaping equals plain decoding with the same shaping, token for token, in every
method and proposer, against an independent reference (a full forward per token, the shaping applied by hand, or
a matcher of llguidance's own); logprobs are the same bits alone and in any batch; and sampled tokens still follow
the shaped distribution (chi-square).
"""

from __future__ import annotations

import copy
import json

import pytest
import tiny_models
import torch
from helpers import cached_or_skip, engine_for, exact_joint, joint_pvalue

import batchspec
from batchspec.config import SamplingParams
from batchspec.engine.exactmath import exp_nonpositive, log, ordered_sum
from batchspec.engine.grammar import GrammarCompiler, GrammarError, unpack
from batchspec.engine.penalties import Penalties
from batchspec.engine.prefill import prompt_logprobs
from batchspec.exact.integer import quantize_model

PENALTIES = Penalties(presence=0.6, frequency=0.35, repetition=1.4, logit_bias=((5, 1.5), (7, -4.0), (11, 0.25)))
METHODS = [("eqspec", "draft", 3), ("exspec", "hybrid", 2), ("eqspec", "ngram", 4), ("eqspec", "hybrid", "auto")]


@pytest.fixture(scope="module")
def pair(bundles):
    bundle = bundles["qwen2"]
    target, draft = bundle.target, bundle.drafts["perturbed"]
    return quantize_model(copy.deepcopy(target)), quantize_model(copy.deepcopy(draft)), bundle


def log_softmax_bits(logits: torch.Tensor) -> torch.Tensor:
    """``[n, V]`` the logprobs :mod:`batchspec.engine.logprobs` defines for ``logits`` ``[n, V]``, term by term:
    ``(x - max) - log(total)``, ``total`` the left-to-right sum of ``exp(x - max)``; torch's ``log_softmax``, whose
    last bits depend on the CPU's instruction set, is within 1e-12 of it."""
    x = logits.double()  # [n, V]
    shifted = x - x.amax(dim=-1, keepdim=True)  # [n, V]
    logprobs = shifted - log(ordered_sum(exp_nonpositive(shifted)))  # [n, V]
    torch.testing.assert_close(logprobs, torch.log_softmax(x, dim=-1), rtol=0, atol=1e-12)
    return logprobs


def penalised_by_hand(logits: list[float], prompt: list[int], output: list[int], p: Penalties) -> list[float]:
    """The penalties of the module's docstring, one token at a time in Python floats."""
    bias = dict(p.logit_bias)
    shaped = []
    for token, value in enumerate(logits):
        count = output.count(token)
        if count or token in prompt:
            value = value / p.repetition if value > 0 else value * p.repetition
        value = value - p.frequency * count
        value = value - p.presence * (count > 0)
        shaped.append(value + bias.get(token, 0.0))
    return shaped


@torch.no_grad()
def reference(target, prompt: list[int], steps: int, eos: int, shaped) -> list[int]:
    """Greedy decoding of ``prompt`` alone, one full forward per token, the logits passed through ``shaped``."""
    output: list[int] = []
    while len(output) < steps and (not output or output[-1] != eos):
        logits = target(torch.tensor([prompt + output])).logits[0, -1].tolist()
        output.append(int(torch.tensor(shaped(logits, output)).argmax()))
    return output


@pytest.mark.parametrize("method, proposer, k", METHODS)
def test_penalised_greedy_output_is_plain_penalised_decoding(method, proposer, k, pair):
    target, draft, bundle = pair
    prompts = [prompt + prompt[:5] for prompt, _ in bundle.probe[:5]]  # repeats: lookups find drafts
    result = batchspec.generate(
        target, draft, prompts, method=method, proposer=proposer, batch_size=3, max_new_tokens=16,
        num_draft_tokens=k, eos_token_id=bundle.eos_id, pad_token_id=bundle.pad_id, penalties=PENALTIES,
        check_invariants=True,
    )
    for prompt, got in zip(prompts, result.sequences, strict=True):
        expected = reference(target, prompt, 16, bundle.eos_id,
                             lambda logits, out, prompt=prompt: penalised_by_hand(logits, prompt, out, PENALTIES))
        assert got == expected
    plain = batchspec.generate(target, None, prompts, method="autoregressive", max_new_tokens=16,
                               eos_token_id=bundle.eos_id, pad_token_id=bundle.pad_id)
    assert plain.sequences != result.sequences  # the penalties changed something


def test_a_large_bias_forces_its_token(pair):
    target, draft, bundle = pair
    prompts = [prompt for prompt, _ in bundle.probe[:4]]
    forced = batchspec.generate(target, draft, prompts, batch_size=4, max_new_tokens=6, eos_token_id=bundle.eos_id,
                                penalties=Penalties(logit_bias=((13, 100.0),)))
    assert forced.sequences == [[13] * 6] * 4


@pytest.mark.parametrize("method, proposer, k", METHODS[:2])
def test_logprobs_are_the_same_bits_alone_and_batched(method, proposer, k, pair):
    target, draft, bundle = pair
    prompts = [prompt for prompt, _ in bundle.probe[:5]]
    common = {"max_new_tokens": 12, "eos_token_id": bundle.eos_id, "pad_token_id": bundle.pad_id, "logprobs": 3}
    alone = batchspec.generate(target, None, prompts, method="autoregressive", batch_size=1, **common)
    batched = batchspec.generate(target, draft, prompts, method=method, proposer=proposer, batch_size=5,
                                 num_draft_tokens=k, **common)
    assert batched.sequences == alone.sequences
    assert batched.logprobs == alone.logprobs
    with torch.no_grad():
        for prompt, tokens, logprobs in zip(prompts, alone.sequences, alone.logprobs, strict=True):
            full = target(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]  # [n, V]
            expected = log_softmax_bits(full)  # [n, V]
            assert [lp.token for lp in logprobs] == tokens
            assert [lp.logprob for lp in logprobs] == expected.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
            assert all(len(lp.top) == 3 and lp.top[0][0] == token for lp, token in zip(logprobs, tokens, strict=True))


def test_prompt_logprobs_are_the_bits_of_the_same_tokens_generated(pair):
    """Completions' ``echo``: a prompt that ends with tokens the model generated gives those tokens the logprobs they
    had when generated (int8: the same bits, read alone in chunks or while a batch decodes), and every earlier
    prompt token the log-softmax of one full forward."""
    target, draft, bundle = pair
    prompts = [prompt for prompt, _ in bundle.probe[:4]]
    common = {"eos_token_id": [], "pad_token_id": bundle.pad_id}
    generated = batchspec.generate(target, None, prompts, method="autoregressive", batch_size=1, max_new_tokens=6,
                                   logprobs=3, **common)
    echoed = [prompt + tokens for prompt, tokens in zip(prompts, generated.sequences, strict=True)]
    scored_only = batchspec.generate(target, draft, echoed, max_new_tokens=0, prompt_logprobs=3, **common)
    while_decoding = batchspec.generate(target, draft, echoed, batch_size=4, max_new_tokens=5, num_draft_tokens=3,
                                        prompt_logprobs=3, **common)
    engine = engine_for(target, None, batchspec.SpecConfig(method="autoregressive"))
    for i, (prompt, prompt_and_output) in enumerate(zip(prompts, echoed, strict=True)):
        scores = scored_only.prompt_logprobs[i]
        assert scores == while_decoding.prompt_logprobs[i]
        assert scores == prompt_logprobs(target, engine.runner, prompt_and_output, 3, chunk=3)
        assert [lp.token for lp in scores] == prompt_and_output[1:]
        assert scores[len(prompt) - 1 :] == generated.logprobs[i]
        with torch.no_grad():
            full = log_softmax_bits(target(torch.tensor([prompt_and_output])).logits[0, :-1])  # [S - 1, V]
        chosen = full.gather(1, torch.tensor(prompt_and_output[1:])[:, None])[:, 0]  # [S - 1]
        assert [lp.logprob for lp in scores] == chosen.tolist()
    assert batchspec.generate(target, None, [[5]], max_new_tokens=0, prompt_logprobs=0).prompt_logprobs == [[]]


def test_sampled_pairs_follow_the_penalised_distribution():
    """Chi-square of the first two sampled tokens against the int8 target's joint distribution, penalised."""
    shape = {"vocab_size": 10, "initializer_range": 0.2, "hidden_size": 32, "intermediate_size": 64}
    target = tiny_models.build_llama(seed=11, **shape)
    draft = quantize_model(tiny_models.perturbed_copy(target, 0.2, seed=12))
    target = quantize_model(target)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 1]
    penalties = Penalties(presence=0.5, frequency=0.8, repetition=1.5, logit_bias=((2, 1.0),))
    result = batchspec.generate(target, draft, [prompt] * 3000, method="eqspec", proposer="draft", batch_size=250,
                                max_new_tokens=3, num_draft_tokens=2, eos_token_id=[], seed=5, temperature=1.0,
                                penalties=penalties)
    assert 0.05 < result.stats.acceptance_rate < 0.95
    joint = exact_joint(target, prompt, SamplingParams(temperature=1.0),
                        shaped=lambda logits, out: torch.tensor(penalised_by_hand(logits.tolist(), prompt, out,
                                                                                  penalties), dtype=logits.dtype))
    assert joint_pvalue([s[:2] for s in result.sequences], joint) > 1e-3


# ------------------------------------------------------------------------------------------------ grammars

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cached_or_skip("smollm2").target_dir)


@pytest.fixture(scope="module")
def word_pair(tokenizer):
    """A tiny int8 target and draft over smollm2's vocabulary."""
    shape = {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "initializer_range": 0.5}
    target = tiny_models.build_llama(seed=3, **shape)
    draft = quantize_model(tiny_models.perturbed_copy(target, 0.3, seed=4))
    return quantize_model(target), draft


def test_counts_worked_example():
    from batchspec.engine.shaping import _counts

    assert _counts([[1, 1], [0]], 2).tolist() == [[0, 2], [1, 0]]


def test_unpack_worked_example():
    assert unpack(torch.tensor([5], dtype=torch.int32), 4).tolist() == [True, False, True, False]
    assert unpack(torch.tensor([-1, 1], dtype=torch.int32), 34).tolist() == [True] * 33 + [False]


def test_a_schema_llguidance_cannot_compile_is_refused_with_its_reason(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    with pytest.raises(GrammarError, match="."):
        compiler.json_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    with pytest.raises(GrammarError):
        compiler.lark("start: (")


@pytest.fixture(scope="module")
def constrained(tokenizer, word_pair):
    """The grammar, the prompts and each prompt's constrained greedy output by an independent reference: a full
    forward per token, masked by a matcher of llguidance's own that is fed the output token by token."""
    target, _ = word_pair
    compiler = GrammarCompiler(tokenizer, target.config.vocab_size)
    grammar = compiler.json_schema(SCHEMA)
    prompts = [tokenizer("Answer in JSON: " + text)["input_ids"] for text in ("yes", "{ } { }", "n=4")]

    def expected(prompt: list[int]) -> list[int]:
        matcher = compiler.matcher(grammar.source)

        def masked(logits: list[float], output: list[int]) -> list[float]:
            if output:
                assert matcher.consume_token(output[-1])
            words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
            allowed = unpack(words, len(logits)).tolist()
            return [value if ok else -float("inf") for value, ok in zip(logits, allowed, strict=True)]

        return reference(target, prompt, 16, tokenizer.eos_token_id, masked)

    return grammar, prompts, [expected(prompt) for prompt in prompts]


@pytest.mark.parametrize("method, proposer, k", METHODS[:3])
def test_constrained_greedy_output_is_plain_constrained_decoding(method, proposer, k, tokenizer, word_pair,
                                                                 constrained):
    target, draft = word_pair
    grammar, prompts, expected = constrained
    eos = tokenizer.eos_token_id
    result = batchspec.generate(target, draft, prompts, method=method, proposer=proposer, batch_size=3,
                                max_new_tokens=16, num_draft_tokens=k, eos_token_id=eos, grammar=grammar)
    assert result.sequences == expected
    finished = [tokenizer.decode(tokens[:-1]) for tokens in expected if tokens[-1] == eos]
    assert finished  # the references include a completed object
    for text in finished:
        parsed = json.loads(text)
        assert set(parsed) == {"n", "ok"} and isinstance(parsed["n"], int) and isinstance(parsed["ok"], bool)
    assert all(tokenizer.decode(tokens).startswith('{"n":') for tokens in expected)


def test_the_draft_model_drafts_only_what_the_grammar_allows(tokenizer, word_pair, constrained):
    """With a draft equal to the target, guided drafts are the target's own constrained choices: all accepted."""
    target, _ = word_pair
    grammar, prompts, expected = constrained
    result = batchspec.generate(target, copy.deepcopy(target), prompts, proposer="draft", batch_size=3,
                                max_new_tokens=16, num_draft_tokens=4, eos_token_id=tokenizer.eos_token_id,
                                grammar=grammar)
    assert result.sequences == expected
    assert result.stats.draft_tokens_proposed > 0
    assert result.stats.acceptance_rate == 1.0
