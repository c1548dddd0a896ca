"""``batchspec costs``: forward timings on tiny models and the break-even arithmetic on hand-made costs."""

from __future__ import annotations

import json

import pytest
import tiny_models
from helpers import run_cli

from batchspec.bench.costs import (
    ForwardCost,
    measure_forward_costs,
    read_bandwidth,
    speculation_costs,
    step_floors,
    weight_bytes,
)
from batchspec.exact.integer import quantize_model
from batchspec.exact.integer.linear import Int8Linear
from batchspec.exact.integer.moe import SparseMoE, split_experts
from batchspec.model_checks import forward_weights

torch = pytest.importorskip("torch")


def _hand_costs() -> list[ForwardCost]:
    seconds = {("target", 8, 1): 0.40, ("target", 8, 6): 0.70, ("target", 8, 4): 0.55, ("draft", 8, 1): 0.20}
    return [ForwardCost(m, b, n, 128, s) for (m, b, n), s in seconds.items()]


def test_break_even_arithmetic_matches_the_docstring_example():
    by_k = {s.num_draft_tokens: s for s in speculation_costs(_hand_costs(), mean_accepted_length=5.5)}
    assert sorted(by_k) == [3, 5]
    five = by_k[5]
    assert five.round_s == pytest.approx(1.70)
    assert five.break_even_accepted_length == pytest.approx(4.25)
    assert five.predicted_speedup == pytest.approx(5.5 * 0.40 / 1.70)
    assert five.break_even_draft_step_s == pytest.approx((5.5 * 0.40 - 0.70) / 5)
    three = by_k[3]
    assert three.round_s == pytest.approx(3 * 0.20 + 0.55)
    assert three.break_even_accepted_length == pytest.approx(1.15 / 0.40)


def test_without_a_measured_acceptance_only_the_break_even_length_is_given():
    (five, three) = sorted(speculation_costs(_hand_costs()), key=lambda s: -s.num_draft_tokens)
    assert five.predicted_speedup is None and five.break_even_draft_step_s is None
    assert five.break_even_accepted_length > three.break_even_accepted_length > 1.0


def _unique_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in tensors}.values())


def _weights(model) -> list:
    """Every parameter and buffer but the rotary embedding's (a step looks up one position of it)."""
    rotary = {id(t) for t in model.model.rotary_emb.buffers()}
    return [t for t in (*model.parameters(), *model.buffers()) if id(t) not in rotary]


def test_weight_bytes_are_what_a_step_reads():
    """Every parameter and buffer once, the input embedding table left out unless the output layer shares it, the
    rotary embedding's tables left out, and an int8 layer's packed weight counted."""
    untied = tiny_models.build_llama(seed=3)
    assert list(untied.model.rotary_emb.buffers()), "the test must see a rotary buffer left out"
    everything = _unique_bytes(_weights(untied))
    table = untied.get_input_embeddings().weight
    assert weight_bytes(untied) == everything - table.numel() * table.element_size()
    tied = tiny_models.build_llama(seed=3, tie_word_embeddings=True)
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    assert weight_bytes(tied) == _unique_bytes(_weights(tied))
    quantized = quantize_model(tiny_models.build_llama(seed=3))
    packed = sum(m.weight.nbytes() for m in quantized.modules() if isinstance(m, Int8Linear))
    linears = [m for m in untied.modules() if isinstance(m, torch.nn.Linear)]
    assert packed >= sum(m.weight.numel() for m in linears) > 0  # at least one byte per weight
    assert weight_bytes(quantized) >= packed
    assert weight_bytes(quantized) < weight_bytes(untied)


def test_forward_weights_are_the_products_weights_from_the_config():
    """The planner's prior for a draft's cost: the weights of every linear layer (the embedding looked up, not read),
    the output layer over a draft's first ids only where that is fewer, whatever the weights' quantization."""
    model = tiny_models.build_qwen2(seed=3)
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    hidden, rows = model.config.hidden_size, model.config.vocab_size
    assert forward_weights(model) == forward_weights(model, rows + 1) == linears
    assert forward_weights(model, 40) == linears - (rows - 40) * hidden
    assert forward_weights(quantize_model(tiny_models.build_qwen2(seed=3))) == linears


def test_a_mixture_of_experts_forward_weights_are_its_routers_and_top_ks_experts():
    """Qwen3-MoE (its second layer dense) and Mixtral: every linear layer but the experts, and in each sparse layer
    its router and num_experts_per_tok experts (of the same size), the float model's and the integer one's alike."""
    for build in (tiny_models.build_qwen3_moe, tiny_models.build_mixtral):
        model = build(seed=3)
        split_experts(model, "silu")
        blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
        experts = {id(m) for block in blocks for m in block.experts.modules()}
        linears = sum(m.weight.numel() for m in model.modules()
                      if isinstance(m, torch.nn.Linear) and id(m) not in experts)
        expert = sum(m.weight.numel() for m in blocks[0].experts[0].modules() if isinstance(m, torch.nn.Linear))
        want = linears + len(blocks) * model.config.num_experts_per_tok * expert
        assert len(blocks) == (2 if build is tiny_models.build_qwen3_moe else 3)
        assert forward_weights(model) == want == forward_weights(quantize_model(build(seed=3).float()))


def test_a_step_against_its_floor():
    """The module docstring's example: 1.58 GB of weights at 50 GB/s is a 31.6 ms floor; a 76 ms step reads them at
    20.8 GB/s, 2.4x the floor. Only one-token steps have a floor."""
    costs = [ForwardCost("target", 1, 1, 128, 0.076), ForwardCost("target", 1, 4, 128, 0.1),
             ForwardCost("draft", 1, 1, 128, 0.02)]
    floors = step_floors(costs, {"target": 1_580_000_000, "draft": 500_000_000}, 50e9)
    assert [(f.model, f.batch_size) for f in floors] == [("target", 1), ("draft", 1)]
    target = floors[0]
    assert target.floor_s == pytest.approx(0.0316)
    assert target.achieved == pytest.approx(20.79e9, rel=1e-3)
    assert target.over_floor == pytest.approx(0.076 / 0.0316)
    assert read_bandwidth("cpu", size=1 << 22, repeats=1) > 0


def test_measured_costs_cover_every_batch_size_and_width(bundles):
    bundle = bundles["llama"]
    costs = measure_forward_costs(bundle.target, bundle.drafts["perturbed"], (1, 3), (2, 4), context=8, repeats=1)
    keys = {(c.model, c.batch_size, c.new_tokens) for c in costs}
    assert keys == {(m, b, n) for b in (1, 3) for m, n in (("target", 1), ("target", 3), ("target", 5), ("draft", 1))}
    assert all(c.seconds > 0 and c.context == 8 for c in costs)
    assert [(s.batch_size, s.num_draft_tokens) for s in speculation_costs(costs)] == [(1, 2), (1, 4), (3, 2), (3, 4)]
    with pytest.raises(ValueError, match=">= 1"):
        measure_forward_costs(bundle.target, bundle.target, (1,), (0,))


def test_costs_command_writes_json_and_table(tiny_dirs, tmp_path):  # noqa: F811
    models = ["--target", str(tiny_dirs / "target"), "--draft", str(tiny_dirs / "draft")]  # --dtype auto
    result = run_cli(
        "costs", *models, "--batch-sizes", "1,2", "--draft-lengths", "3", "--context", "8", "--repeats", "1",
        "--mean-accepted-length", "2.5", "-o", str(tmp_path),
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "costs.json").read_text())
    assert len(report["forward_costs"]) == 2 * 3 and len(report["speculation"]) == 2
    assert report["dtype"] == "float32" and "(float32, " in result.stdout
    assert all(s["predicted_speedup"] > 0 for s in report["speculation"])
    assert "| 2 | 3 |" in result.stdout
    assert [(f["model"], f["batch_size"]) for f in report["step_floors"]] == [
        ("target", 1), ("draft", 1), ("target", 2), ("draft", 2)]
    assert all(f["over_floor"] > 0 and f["weight_bytes"] > 0 for f in report["step_floors"])
    assert "| read GB/s | x floor |" in result.stdout
    bad = run_cli("costs", *models, "--draft-lengths", "3,x", "-o", str(tmp_path))
    assert bad.exit_code == 1 and "--draft-lengths must be comma-separated integers" in bad.output
