"""The mixture of experts' exact parts (:mod:`batchspec.exact.integer.moe`): the router's softmax and top k, the
layout of transformers' sparse blocks, the bytes a forward reads, the families' refusals."""

from __future__ import annotations

import math

import pytest
import tiny_models
import torch

from batchspec.exact.integer import quantize_model
from batchspec.exact.integer.linear import QuantizedMLP
from batchspec.exact.integer.moe import SparseMoE, forward_bytes, product_bytes, route, split_experts
from batchspec.model_checks import check_model


def test_route_ranks_ties_to_the_lower_expert_and_renormalizes_over_the_chosen():
    """The docstring's example, a row of equal logits (experts 0 and 1), and weights within an ulp or two of torch's
    softmax and its renormalization."""
    logits = torch.tensor([[0.0, 0.0, math.log(2.0)], [1.5, 1.5, 1.5], [2.0, -1.0, 0.5]])  # [3, 3]
    weights, experts = route(logits, 2, normalize=False)  # [3, 2] each
    assert experts.tolist() == [[2, 0], [0, 1], [0, 2]]
    want = torch.softmax(logits, -1).gather(1, experts)
    assert torch.allclose(weights, want, rtol=1e-6, atol=0)
    normed, again = route(logits, 2, normalize=True)
    assert torch.equal(again, experts)
    assert torch.allclose(normed, want / want.sum(-1, keepdim=True), rtol=1e-6, atol=0)


def test_a_rows_route_is_its_own_in_any_batch():
    """Each row's weights and experts are the same bits alone as beside 63 other rows."""
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 4  # [64, 8]
    weights, experts = route(logits, 3, normalize=True)
    for row in (0, 17, 63):
        alone = route(logits[row : row + 1].clone(), 3, normalize=True)
        assert torch.equal(alone[0][0], weights[row]) and torch.equal(alone[1][0], experts[row])


@pytest.mark.parametrize("build", [tiny_models.build_qwen3_moe, tiny_models.build_olmoe, tiny_models.build_mixtral])
def test_the_sparse_blocks_experts_are_views_of_transformers_weights(build):
    """split_experts copies no expert weight: each expert's gate, up and down read the 3-D parameters' rows; the
    float model's logits stay within rounding of transformers' own."""
    model = build(seed=1, hidden_size=64).float()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        blocks = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
        fused = [block.experts.gate_up_proj for block in blocks]
        split_experts(model, "silu")
        got = model(ids).logits
    moes = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE)]
    assert len(moes) == len(blocks) > 0
    for moe, weight in zip(moes, fused, strict=True):
        expert = moe.experts[1]
        assert expert.gate_proj.weight.data_ptr() == weight[1].data_ptr()
        assert expert.up_proj.weight.data_ptr() == weight[1, weight.shape[1] // 2 :].data_ptr()
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("width", ["int8", "int4"])
def test_a_forward_reads_the_union_of_its_rows_experts(width):
    """forward_bytes: a one-token forward reads its own experts, a 12-token one (a verification) the union of theirs,
    never fewer; with every expert touched, every integer layer's weight."""
    model = quantize_model(tiny_models.build_olmoe(seed=2, hidden_size=64).float(), width=width)
    moes = [layer.mlp for layer in model.model.layers]
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids[:, :1])
        one, ran_one = forward_bytes(model), [moe.touched.clone() for moe in moes]
        model(ids)
        many, ran_many = forward_bytes(model), [moe.touched.clone() for moe in moes]
    assert all(int(ran.sum()) == 2 for ran in ran_one)
    assert all(bool((a <= b).all()) for a, b in zip(ran_one, ran_many, strict=True))
    expert_bytes = sum(product_bytes(m) for m in moes[0].experts[0].modules())
    assert expert_bytes > 0
    assert many - one == expert_bytes * sum(int(b.sum() - a.sum()) for a, b in zip(ran_one, ran_many, strict=True))
    for moe in moes:
        moe.touched.fill_(True)
    assert forward_bytes(model) == sum(product_bytes(m) for m in model.modules())
    assert all(isinstance(expert, QuantizedMLP) for moe in moes for expert in moe.experts)


def test_olmoe_clipping_its_projections_is_refused():
    model = tiny_models.build_olmoe(seed=1, hidden_size=64)
    model.config.clip_qkv = 8.0
    with pytest.raises(ValueError, match="clip_qkv"):
        check_model(model, "target")
