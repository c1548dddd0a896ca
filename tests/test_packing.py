"""CPU kernels: float32 linear layers on oneDNN with prepacked weights (``batchspec.models.packing``).

Packing changes only the summation order of float32 products, so logits stay within float32 rounding of the
default kernels, unpacking restores the exact modules, and greedy speculative output on packed models is still
the packed target's own greedy output (transformers' ``generate`` on the same model as the reference).
"""

from __future__ import annotations

import copy

import pytest
import tiny_models
import torch

from batchspec.models import use_kernels
from batchspec.models.packing import PackedLinear, can_pack, kernels_in_use, pack_linears, unpack_linears

pytestmark = pytest.mark.skipif(
    not can_pack(torch.nn.Linear(2, 2)), reason="this PyTorch has no oneDNN linear kernels"
)


@pytest.fixture(scope="module")
def float32_llama(bundles):
    """The tiny Llama bundle's target and perturbed draft in float32 (unpacked copies)."""
    bundle = bundles["llama"]
    target = copy.deepcopy(bundle.target).float()
    draft = copy.deepcopy(bundle.drafts["perturbed"]).float()
    return bundle, target, draft


def _logits(model, ids: torch.Tensor) -> torch.Tensor:  # ids: [B, T] -> [B, T, V]
    with torch.inference_mode():
        return model(ids).logits


def test_packed_logits_stay_within_float32_rounding_and_unpacking_restores_them(float32_llama):
    _, target, _ = float32_llama
    model = copy.deepcopy(target)
    ids = torch.tensor(tiny_models.random_prompts(3, seed=1, min_len=9, max_len=9))  # [3, 9]
    before = _logits(model, ids)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert pack_linears(model) == linears > 0
    assert kernels_in_use(model) == "packed"
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    packed = _logits(model, ids)
    assert torch.allclose(packed, before, rtol=1e-5, atol=1e-5)
    assert unpack_linears(model) == linears
    assert kernels_in_use(model) == "default"
    assert torch.equal(_logits(model, ids), before)


def test_use_kernels_choices(float32_llama, bundles):
    _, target, _ = float32_llama
    model = copy.deepcopy(target)
    assert use_kernels(model, "default") is False and kernels_in_use(model) == "default"
    assert use_kernels(model, "auto") is True and kernels_in_use(model) == "packed"
    float64 = bundles["llama"].target  # float64: no packed kernels, auto leaves it alone, packed refuses
    assert use_kernels(float64, "auto") is False and kernels_in_use(float64) == "default"
    with pytest.raises(ValueError, match="float32 model on the CPU"):
        use_kernels(float64, "packed")
    with pytest.raises(ValueError, match="Unsupported kernels"):
        use_kernels(model, "fast")


def test_tied_output_embeddings_keep_their_weight(float32_llama):
    """The packed lm_head still has a weight of the vocabulary's rows for the vocabulary checks; a tied one's values
    live on in the input embedding."""
    _, target, _ = float32_llama
    model = copy.deepcopy(target)
    rows = model.get_output_embeddings().weight.shape[0]
    pack_linears(model)
    head = model.get_output_embeddings()
    assert isinstance(head, PackedLinear)
    assert head.weight.shape[0] == rows == tiny_models.VOCAB_SIZE
    assert torch.equal(head.weight, model.get_input_embeddings().weight) == model.config.tie_word_embeddings


def test_packing_holds_each_weight_once(float32_llama):
    """After packing, no float32 linear weight is held beside its packed copy: the parameters left are the
    embedding's and the norms'."""
    _, target, _ = float32_llama
    model = copy.deepcopy(target)
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    embedding = id(model.get_input_embeddings().weight)
    pack_linears(model)
    assert not {id(p) for p in model.parameters()} & (linear_weights - {embedding})


@pytest.mark.parametrize(("method", "proposer"), [("eqspec", "draft"), ("exspec", "hybrid"), ("eqspec", "ngram")])
def test_greedy_output_on_packed_models_is_the_packed_targets_own(method, proposer, float32_llama, bs,
                                                                  make_prompts, check):
    bundle, target, draft = float32_llama
    target, draft = copy.deepcopy(target), copy.deepcopy(draft)
    pack_linears(target)
    pack_linears(draft)
    prompts = make_prompts(bundle, 6, seed=11)
    result = bs.generate(
        target, None if proposer == "ngram" else draft, prompts, method=method, proposer=proposer, batch_size=4,
        window_size=5 if method == "exspec" else None, max_new_tokens=17, num_draft_tokens=3,
        eos_token_id=bundle.eos_id, pad_token_id=bundle.pad_id, check_invariants=True,
    )
    refs = [_reference(target, p, 17, bundle) for p in prompts]
    check.result_matches(result, prompts, refs, 17, bundle.eos_id)


def _reference(target, prompt: list[int], max_new_tokens: int, bundle) -> list[int]:
    """transformers' greedy ``generate`` on the packed target alone (batch size 1), cut after EOS."""
    ids = torch.tensor([prompt])  # [1, T]
    with torch.inference_mode():
        out = target.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
            eos_token_id=bundle.eos_id, pad_token_id=bundle.pad_id,
        )
    new = out[0, ids.shape[1]:].tolist()
    return new[: new.index(bundle.eos_id) + 1] if bundle.eos_id in new else new
