"""``batchspec.hf_generate`` returns what transformers' ``model.generate`` returns for the same call.

The reference is transformers itself: ``model.generate`` on the same left-padded batch (greedy batched decoding
is correct there), and ``model.generate`` on each row's real tokens alone for the right-padded batches (where
transformers continues after the padding and goes wrong). The tiny float64 models make argmax ties impossible,
so every comparison is exact. Prompts contain the pad and EOS ids as real tokens: padding comes from the mask.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

import batchspec
from batchspec.hf import hf_generate

NUM_ROWS = 6
NEW_TOKENS = 24


def padded(prompts: list[list[int]], side: str, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` ids and mask of ``prompts`` padded with ``pad`` on ``side``, as a tokenizer pads them."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [B, T]
    mask = torch.zeros_like(ids)  # [B, T]
    for i, prompt in enumerate(prompts):
        cols = slice(width - len(prompt), width) if side == "left" else slice(0, len(prompt))
        ids[i, cols] = torch.tensor(prompt)
        mask[i, cols] = 1
    return ids, mask


def alone(reference, model, prompts: list[list[int]], ids: torch.Tensor, pad: int, eos) -> torch.Tensor:
    """``model.generate`` on each prompt alone (``NEW_TOKENS``, greedy), laid out after ``ids`` as a batch is."""
    news = [reference(model, prompt, NEW_TOKENS, eos) for prompt in prompts]
    longest = max(map(len, news))
    tail = torch.tensor([new + [pad] * (longest - len(new)) for new in news], dtype=torch.long)  # [B, N]
    return torch.cat([ids, tail], dim=1)  # [B, T + N]


@pytest.fixture(scope="module")
def prompts(llama, make_prompts) -> list[list[int]]:
    return make_prompts(llama, NUM_ROWS, seed=17, min_len=1, max_len=20)


def length_kwargs(kind: str, width: int) -> dict[str, int]:
    """NEW_TOKENS new tokens, asked for directly or as a total length (for the batch, whose width is ``width``)."""
    return {"max_new_tokens": NEW_TOKENS} if kind == "max_new_tokens" else {"max_length": width + NEW_TOKENS}


def eos_ids(kind: str, bundle) -> int | list[int]:
    """The model's own EOS, or a list of two EOS ids (the second one a token the target emits, not EOS or pad)."""
    if kind == "model":
        return bundle.eos_id
    return [bundle.eos_id, next(t for t in bundle.probe[0][1][3:] if t not in (bundle.eos_id, bundle.pad_id))]


def eos_kwargs(kind: str, bundle) -> dict:
    """No EOS argument (the model's generation config has it), or the list given in the call."""
    return {} if kind == "model" else {"eos_token_id": eos_ids(kind, bundle)}


@pytest.mark.parametrize("length", ["max_new_tokens", "max_length"])
@pytest.mark.parametrize("eos", ["model", "list"])
@pytest.mark.parametrize("assistant", [None, "perturbed", "unrelated"])
def test_left_padded_batch_equals_model_generate(llama, prompts, reference, assistant, eos, length):
    ids, mask = padded(prompts, "left", llama.pad_id)
    kwargs = dict(do_sample=False, **length_kwargs(length, ids.shape[1]), **eos_kwargs(eos, llama))
    expected = llama.target.generate(ids, attention_mask=mask, **kwargs)
    draft = llama.drafts[assistant] if assistant else None
    out = hf_generate(llama.target, ids, mask, assistant_model=draft, **kwargs)
    assert out.dtype == torch.long
    assert torch.equal(out, expected)
    assert torch.equal(out, alone(reference, llama.target, prompts, ids, llama.pad_id, eos_ids(eos, llama)))
    assert (out[:, ids.shape[1] :] == llama.pad_id).any(), "some row ended at EOS before the others"


@pytest.mark.parametrize("length", ["max_new_tokens", "max_length"])
@pytest.mark.parametrize("eos", ["model", "list"])
@pytest.mark.parametrize("assistant", [None, "perturbed"])
def test_right_padded_batch_equals_each_row_alone(qwen2, make_prompts, reference, assistant, eos, length):
    prompts = make_prompts(qwen2, NUM_ROWS, seed=23, min_len=1, max_len=20)
    ids, mask = padded(prompts, "right", qwen2.pad_id)
    kwargs = dict(**length_kwargs(length, ids.shape[1]), **eos_kwargs(eos, qwen2))
    draft = qwen2.drafts[assistant] if assistant else None
    out = hf_generate(qwen2.target, ids, mask, assistant_model=draft, **kwargs)
    assert torch.equal(out[:, : ids.shape[1]], ids), "the prompt part is returned as given, right padding included"
    assert torch.equal(out, alone(reference, qwen2.target, prompts, ids, qwen2.pad_id, eos_ids(eos, qwen2)))
    left_ids, left_mask = padded(prompts, "left", qwen2.pad_id)
    left = qwen2.target.generate(left_ids, attention_mask=left_mask, do_sample=False, **kwargs)
    assert torch.equal(out[:, ids.shape[1] :], left[:, ids.shape[1] :])


def test_single_row_equals_transformers_assisted_generation(llama, prompts):
    row = torch.tensor([prompts[2]])  # [1, t]
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = llama.target.generate(row, assistant_model=llama.drafts["perturbed"], **kwargs)
    assert torch.equal(hf_generate(llama.target, row, assistant_model=llama.drafts["perturbed"], **kwargs), expected)


def test_generation_config_and_overrides_resolve_as_in_transformers(llama, prompts):
    ids, mask = padded(prompts, "left", llama.pad_id)
    config = GenerationConfig(max_new_tokens=3, do_sample=False, pad_token_id=llama.eos_id, min_p=0.5)
    cases = [dict(generation_config=config), dict(generation_config=config, max_new_tokens=9), dict(max_length=30)]
    for case in cases:
        expected = llama.target.generate(ids, attention_mask=mask, **case)
        assert torch.equal(hf_generate(llama.target, ids, mask, assistant_model=llama.drafts["identical"], **case),
                           expected), case
    no_pad = GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=llama.eos_id, pad_token_id=None)
    filled = hf_generate(llama.target, ids, mask, generation_config=no_pad, pad_token_id=None)
    expected = llama.target.generate(ids, attention_mask=mask, generation_config=no_pad, pad_token_id=None)
    assert torch.equal(filled, expected)
    assert (filled[:, ids.shape[1] :] == llama.eos_id).sum() > NUM_ROWS, "finished rows are filled with EOS"


def test_no_attention_mask_means_every_token_is_real(llama, prompts, reference):
    row = torch.tensor([[llama.pad_id, llama.pad_id, *prompts[0]]])  # [1, t]: leading pad ids are real tokens here
    expected = alone(reference, llama.target, [row[0].tolist()], row, llama.pad_id, llama.eos_id)
    assert torch.equal(hf_generate(llama.target, row, max_new_tokens=NEW_TOKENS), expected)


def test_sampling_repeats_under_a_torch_seed_and_top_k_1_is_greedy(llama, prompts):
    ids, mask = padded(prompts, "left", llama.pad_id)
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(hf_generate(llama.target, ids, mask, assistant_model=llama.drafts["perturbed"],
                                do_sample=True, temperature=1.3, max_new_tokens=8))
    assert torch.equal(runs[0], runs[1])
    greedy = llama.target.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert not torch.equal(runs[0], greedy)
    top1 = hf_generate(llama.target, ids, mask, assistant_model=llama.drafts["perturbed"], do_sample=True,
                       top_k=1, max_new_tokens=8)
    assert torch.equal(top1, greedy)


def test_prompt_lookup_drafts_with_ngrams(llama, prompts):
    ids, mask = padded(prompts, "left", llama.pad_id)
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    out = hf_generate(llama.target, ids, mask, prompt_lookup_num_tokens=3, **kwargs)
    assert torch.equal(out, llama.target.generate(ids, attention_mask=mask, **kwargs))


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (dict(num_beams=2), "num_beams=2"),
        (dict(repetition_penalty=1.3, min_new_tokens=4), "min_new_tokens=4, repetition_penalty=1.3"),
        (dict(generation_config=GenerationConfig(no_repeat_ngram_size=2)), "no_repeat_ngram_size=2"),
        (dict(output_scores=True, return_dict_in_generate=True), "output_scores=True, return_dict_in_generate=True"),
        (dict(logits_processor=LogitsProcessorList()), "logits_processor"),
        (dict(stopping_criteria=StoppingCriteriaList(), streamer=object()), "stopping_criteria, streamer"),
        (dict(do_sample=True, min_p=0.2), "min_p=0.2"),
        (dict(stop_strings=["\n"]), "stop_strings=['\\n']"),
    ],
)
def test_unsupported_arguments_are_named(llama, prompts, kwargs, named):
    ids, mask = padded(prompts, "left", llama.pad_id)
    with pytest.raises(ValueError, match=r"^hf_generate does not support (.*)") as error:
        hf_generate(llama.target, ids, mask, max_new_tokens=4, **kwargs)
    assert str(error.value).startswith(f"hf_generate does not support {named}:")


def test_settings_that_change_nothing_are_accepted(llama, prompts):
    ids, mask = padded(prompts, "left", llama.pad_id)
    kwargs = dict(max_new_tokens=6, do_sample=False)
    expected = llama.target.generate(ids, attention_mask=mask, **kwargs)
    harmless = dict(logits_processor=None, streamer=None, min_p=0.3, top_k=3, num_assistant_tokens_schedule="heuristic",
                    use_cache=True, num_assistant_tokens=2, repetition_penalty=1.0)
    out = hf_generate(llama.target, ids, mask, assistant_model=llama.drafts["unrelated"], **kwargs, **harmless)
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m, ids, mask: hf_generate(m, ids[0], mask[0], max_new_tokens=2), r"\[batch, length\] integer tensor"),
        (lambda m, ids, mask: hf_generate(m, ids, mask[:, 1:], max_new_tokens=2), r"attention_mask has shape"),
        (lambda m, ids, mask: hf_generate(m, ids, mask * 2, max_new_tokens=2), r"only 0 \(padding\) and 1"),
        (lambda m, ids, mask: hf_generate(m, ids, mask.index_fill(0, torch.tensor([3]), 0), max_new_tokens=2),
         r"row 3 of attention_mask has no real token"),
        (lambda m, ids, mask: hf_generate(m, ids, mask, max_length=ids.shape[1]), r"max_length \d+ leaves no room"),
        (lambda m, ids, mask: hf_generate(m, ids, mask, max_new_tokens=0), r"max_new_tokens` must be greater than 0"),
        (lambda m, ids, mask: hf_generate(m, ids, mask, do_sample=True, temperature=0.0, max_new_tokens=2),
         r"temperature must be a strictly positive float"),
        (lambda m, ids, mask: hf_generate(m, ids, mask, assistant_model=m, prompt_lookup_num_tokens=3,
                                          max_new_tokens=2), r"either assistant_model or prompt_lookup_num_tokens"),
    ],
)
def test_bad_inputs_raise_a_clear_error(llama, prompts, call, message):
    ids, mask = padded(prompts, "left", llama.pad_id)
    with pytest.raises(ValueError, match=message):
        call(llama.target, ids, mask)


def test_batched_assisted_generation_is_what_transformers_refuses(llama, prompts):
    ids, mask = padded(prompts, "left", llama.pad_id)
    with pytest.raises(ValueError, match="assisted generate is only supported for batch_size = 1"):
        llama.target.generate(ids, attention_mask=mask, assistant_model=llama.drafts["perturbed"], max_new_tokens=4)
    out = batchspec.hf_generate(llama.target, ids, mask, assistant_model=llama.drafts["perturbed"], max_new_tokens=4)
    assert out.shape == (NUM_ROWS, ids.shape[1] + 4)
