"""Argument validation and unsupported-model rejection of batchspec.generate."""

from __future__ import annotations

import copy
from dataclasses import fields

import pytest
import tiny_models
import torch
from transformers import (
    AutoModelForSeq2SeqLM,
    BartConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
    T5Config,
)

from batchspec.config import SpecConfig
from batchspec.engine.state import Sequence

PROMPTS = [[3, 4, 5], [7], [1, 2, 3, 4, 5, 6, 7, 8]]


def _gen(bs, bundle, draft="identical", prompts=PROMPTS, **kw):
    d = bundle.drafts[draft] if isinstance(draft, str) else draft
    kw.setdefault("max_new_tokens", 4)
    kw.setdefault("num_draft_tokens", 2)
    kw.setdefault("check_invariants", True)
    return bs.generate(bundle.target, d, prompts, **kw)


# --------------------------------------------------------------------------------------------------
# argument errors


@pytest.mark.parametrize("method", ["eqspec", "autoregressive"])
@pytest.mark.parametrize(
    "prompts",
    [[[]], [[1, 2], []], [[5], [6, 7], [], [8]]],
    ids=["only-empty", "empty-last", "empty-middle"],
)
def test_empty_prompt_rejected(method, prompts, bs, llama):
    with pytest.raises(ValueError, match="(?i)prompt"):
        _gen(bs, llama, prompts=prompts, method=method)


@pytest.mark.parametrize("method", ["eqspec", "autoregressive"])
@pytest.mark.parametrize("value", [-1, -100, 2.5, True])
@pytest.mark.parametrize("prompts", [PROMPTS, []], ids=["prompts", "no-prompts"])
def test_bad_max_new_tokens_rejected(method, value, prompts, bs, llama):
    with pytest.raises(ValueError, match="max_new_tokens must be (an integer|>= 0)"):
        _gen(bs, llama, method=method, max_new_tokens=value, prompts=prompts)


@pytest.mark.parametrize(("value", "message"), [(-1, ">= 0; got -1"), (2.0, "an integer; got 2.0"),
                                              (None, "an integer; got None")])
def test_a_sequence_checks_its_budget(value, message):
    with pytest.raises(ValueError, match=f"max_new_tokens must be {message}"):
        Sequence(0, [1, 2], value)
    assert Sequence(0, [1, 2], 0).remaining == 0


def test_the_budget_is_the_sequences_alone():
    assert "max_new_tokens" not in {f.name for f in fields(SpecConfig)}
    with pytest.raises(TypeError, match="max_new_tokens"):
        SpecConfig(max_new_tokens=4)


@pytest.mark.parametrize("method", ["eqspec", "autoregressive"])
@pytest.mark.parametrize("value", [0, -3])
def test_bad_batch_size_rejected(method, value, bs, llama):
    with pytest.raises(ValueError, match="batch_size"):
        _gen(bs, llama, method=method, batch_size=value)


@pytest.mark.parametrize("value", [0, -1])
def test_bad_num_draft_tokens_rejected(value, bs, llama):
    with pytest.raises(ValueError, match="num_draft_tokens"):
        _gen(bs, llama, method="eqspec", num_draft_tokens=value)


@pytest.mark.parametrize("method", ["beam", "", "EQSPEC-typo", "speculative"])
def test_unknown_method_rejected(method, bs, llama):
    with pytest.raises(ValueError, match="method"):
        _gen(bs, llama, method=method)


@pytest.mark.parametrize("proposer", ["draft", "hybrid"])
def test_draft_model_proposers_without_a_draft_rejected(proposer, bs, llama):
    with pytest.raises(ValueError, match=f"proposer '{proposer}' needs a draft model"):
        bs.generate(llama.target, None, PROMPTS, proposer=proposer, max_new_tokens=4)


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_without_a_draft_speculation_looks_up_drafts(method, bs, llama, reference):
    res = bs.generate(llama.target, None, PROMPTS, method=method, max_new_tokens=5, check_invariants=True)
    assert res.sequences == [reference(llama.target, p, 5, llama.eos_id) for p in PROMPTS]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"proposer": "medusa"}, "proposer"),
        ({"num_draft_tokens": "many"}, "num_draft_tokens"),
        ({"num_draft_tokens": 0}, "num_draft_tokens"),
        ({"max_draft_tokens": 0}, "max_draft_tokens"),
        ({"ngram_min": 0}, "ngram_min"),
        ({"ngram_min": 3, "ngram_max": 2}, "ngram_max"),
    ],
)
def test_proposer_arguments_validated(kwargs, name, bs, llama):
    with pytest.raises(ValueError, match=name):
        bs.generate(llama.target, llama.drafts["perturbed"], PROMPTS, max_new_tokens=4, **kwargs)


def test_autoregressive_without_draft_ok(bs, llama, reference):
    res = bs.generate(
        llama.target, None, PROMPTS, method="autoregressive", max_new_tokens=5, check_invariants=True
    )
    assert res.sequences == [reference(llama.target, p, 5, llama.eos_id) for p in PROMPTS]


# --------------------------------------------------------------------------------------------------
# degenerate but valid inputs


@pytest.mark.parametrize("method", ["eqspec", "autoregressive"])
def test_empty_prompt_list(method, bs, llama):
    res = _gen(bs, llama, prompts=[], method=method)
    assert res.sequences == []
    assert res.finish_reasons == []
    assert res.stats.generated_tokens == 0


@pytest.mark.parametrize("method", ["eqspec", "autoregressive"])
@pytest.mark.parametrize("target", tiny_models.TARGET_KINDS)
def test_max_new_tokens_zero(method, target, bs, bundles):
    bundle = bundles[target]
    prompts = PROMPTS + [[bundle.eos_id], [bundle.pad_id, bundle.pad_id, 9]]
    res = _gen(bs, bundle, prompts=prompts, method=method, max_new_tokens=0, batch_size=2)
    assert res.sequences == [[] for _ in prompts]
    assert len(res.finish_reasons) == len(prompts)
    assert all(r == "length" for r in res.finish_reasons)
    assert res.stats.generated_tokens == 0


@pytest.mark.parametrize("method", ["eqspec", "autoregressive"])
def test_batch_size_larger_than_prompt_count(method, bs, llama, reference):
    res = _gen(bs, llama, method=method, batch_size=64, max_new_tokens=6)
    assert res.sequences == [reference(llama.target, p, 6, llama.eos_id) for p in PROMPTS]


def test_autoregressive_ignores_draft(bs, llama, qwen2, reference):
    """With method="autoregressive" the draft is ignored, even one that eqspec would reject."""
    bad_draft = _different_vocab_draft()
    for draft in (bad_draft, qwen2.target, llama.drafts["unrelated"]):
        res = bs.generate(
            llama.target, draft, PROMPTS, method="autoregressive", max_new_tokens=5, check_invariants=True
        )
        assert res.sequences == [reference(llama.target, p, 5, llama.eos_id) for p in PROMPTS]
        assert res.stats.draft_tokens_proposed == 0


def test_inputs_not_mutated(bs, llama):
    prompts = [list(p) for p in PROMPTS]
    before = copy.deepcopy(prompts)
    eos = [llama.eos_id, llama.pad_id]
    eos_before = list(eos)
    _gen(bs, llama, prompts=prompts, eos_token_id=eos)
    assert prompts == before
    assert eos == eos_before
    assert llama.target.generation_config.eos_token_id == llama.eos_id


# --------------------------------------------------------------------------------------------------
# unsupported models


def _encoder_decoder(kind: str):
    torch.manual_seed(0)
    if kind == "t5":
        cfg = T5Config(vocab_size=tiny_models.VOCAB_SIZE, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                       num_decoder_layers=1, num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    else:
        cfg = BartConfig(vocab_size=tiny_models.VOCAB_SIZE, d_model=32, encoder_layers=1, decoder_layers=1,
                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                         max_position_embeddings=128)
    model = AutoModelForSeq2SeqLM.from_config(cfg).to(torch.float64).eval()
    assert model.config.is_encoder_decoder
    return model


def _sliding_window_qwen2():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=tiny_models.VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=512,
                      use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert "sliding_attention" in cfg.layer_types
    return Qwen2ForCausalLM(cfg).to(torch.float64).eval()


def _gpt_neox_model():
    """A family batchspec does not run: its error lists the ones it does."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=tiny_models.VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=512)
    return GPTNeoXForCausalLM(cfg).to(torch.float64).eval()


def _bidirectional_gemma3():
    """Gemma 3 attending both ways (an encoder's use of it), which batchspec does not decode."""
    model = tiny_models.build_gemma3(seed=0)
    model.config.use_bidirectional_attention = True
    return model


def _different_vocab_draft(vocab_size: int = tiny_models.VOCAB_SIZE + 32):
    return tiny_models.build_llama(seed=5, vocab_size=vocab_size)


# each unsupported model and the word its error names
UNSUPPORTED = {
    "t5": (lambda: _encoder_decoder("t5"), "encoder"),
    "bart": (lambda: _encoder_decoder("bart"), "encoder"),
    "qwen2-sliding": (_sliding_window_qwen2, "sliding"),
    "gpt_neox": (_gpt_neox_model, "'gpt_neox' is not supported; supported families: llama, .*smollm3, granite"),
    "gemma3-bidirectional": (_bidirectional_gemma3, "uses bidirectional attention"),
}


@pytest.mark.parametrize("kind", list(UNSUPPORTED))
@pytest.mark.parametrize("role", ["target", "draft", "target-alone"])
def test_unsupported_model_rejected(kind, role, bs, llama):
    build, reason = UNSUPPORTED[kind]
    model = build()
    target, draft, method = {
        "target": (model, llama.target, "eqspec"),
        "draft": (llama.target, model, "eqspec"),
        "target-alone": (model, None, "autoregressive"),
    }[role]
    with pytest.raises(ValueError, match=f"(?i){reason}"):
        bs.generate(target, draft, PROMPTS, method=method, max_new_tokens=4, check_invariants=True)


@pytest.mark.parametrize("vocab_size", [tiny_models.VOCAB_SIZE + 32, tiny_models.VOCAB_SIZE - 16])
def test_vocab_mismatch_rejected(vocab_size, bs, llama):
    draft = _different_vocab_draft(vocab_size)
    with pytest.raises(ValueError, match="(?i)vocab"):
        bs.generate(llama.target, draft, PROMPTS, method="eqspec", max_new_tokens=4, check_invariants=True)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_request_past_its_familys_context_is_rejected(role, bs, llama):
    """Phi-3 with LongRoPE is decoded within its original_max_position_embeddings (256 of the tiny model's 512
    positions; batchspec.families.phi3): a prompt and its new tokens that fit are decoded, one position more is
    refused before any work, whichever of target and draft it is."""
    phi3 = tiny_models.build_phi3(seed=1)
    target, draft = (phi3, llama.target) if role == "target" else (llama.target, phi3)
    prompts = [[3] * 250, [5, 6]]
    fitting = bs.generate(target, draft, prompts, method="eqspec", max_new_tokens=6, num_draft_tokens=2)
    assert [len(row) for row in fitting.sequences] == [6, 6]
    with pytest.raises(ValueError, match=r"prompts\[0\] \(250 tokens\) and max_new_tokens=7 take more than the 256"):
        bs.generate(target, draft, prompts, method="eqspec", max_new_tokens=7, num_draft_tokens=2)
