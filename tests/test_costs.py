"""``batchspec costs``: forward timings on tiny models and the break-even arithmetic on hand-made costs."""

from __future__ import annotations

import json

import pytest
import tiny_models
from fabricated import tiny_tokenizer
from helpers import run_cli

from batchspec.bench.costs import (
    ForwardCost,
    measure_forward_costs,
    read_bandwidth,
    read_bytes,
    speculation_costs,
    step_floors,
    union_reads,
    weight_bytes,
)
from batchspec.engine import BatchKVCache, BatchState, ModelRunner
from batchspec.exact.integer import quantize_model
from batchspec.exact.integer.forward import integer_forward
from batchspec.exact.integer.linear import Int8Linear
from batchspec.exact.integer.moe import SparseMoE, split_experts
from batchspec.model_checks import forward_weights, mixture_of

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
        mixture = mixture_of(model)
        assert (mixture.experts, mixture.top_k) == (len(blocks[0].experts), model.config.num_experts_per_tok)
        assert mixture.share == len(blocks) * model.config.num_experts_per_tok * expert / want
    assert mixture_of(tiny_models.build_qwen2(seed=3)) is None


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


def _hand_routed_olmoe() -> torch.nn.Module:
    """OLMoE (8 experts, top 2, three sparse layers) in int8, routed by hand: layer 0's attention adds nothing (its
    o_proj zero), token ``t``'s embedding is 1 at dimension ``t % 8`` and 0 elsewhere, and layer 0's router gives
    expert ``e`` dimension ``e``: token ``t`` runs expert ``t % 8`` and, of the others' equal logits, the lowest (0,
    or 1 beside 0). Every later router is zero: every token runs experts 0 and 1 there."""
    model = tiny_models.build_olmoe(seed=2, hidden_size=64).float()
    layers, table = model.model.layers, model.model.embed_tokens.weight  # table: [V, H]
    with torch.no_grad():
        table.zero_()
        table[torch.arange(table.shape[0]), torch.arange(table.shape[0]) % 8] = 1.0
        layers[0].self_attn.o_proj.weight.zero_()
        for layer in layers:
            layer.mlp.gate.weight.zero_()
        layers[0].mlp.gate.weight[:, :8] = 4 * torch.eye(8)  # [E, H]
    return quantize_model(model)


def _by_hand(tokens: list[int]) -> tuple[int, ...]:
    """The experts each of :func:`_hand_routed_olmoe`'s blocks runs for ``tokens``."""
    first = {t % 8 for t in tokens} | {1 if t % 8 == 0 else 0 for t in tokens}
    return len(first), 2, 2


@torch.inference_mode()
def test_the_union_reported_is_the_experts_a_hand_routed_forward_touched():
    """A verification-shaped forward (2 rows of 3 tokens after 4 cached ones) of the hand-routed model, through the
    runner (the fused forward where the native kernels run): each block ran the experts its tokens chose, and
    union_reads reports them, the bytes they make and the union uniform routing of 6 tokens would give."""
    model = _hand_routed_olmoe()
    ids = torch.tensor([[40, 41, 42, 43, 3, 11, 5], [44, 45, 46, 47, 8, 9, 10]])  # [B, C + n]: 4 cached, 3 new
    runner, cache = ModelRunner(torch.device("cpu")), BatchKVCache.for_model(model)
    batch = BatchState.dense(ids, cache)
    runner.read(model, batch, cache, ids[:, :4])
    runner.logits(model, batch, cache, ids[:, 4:], keep=3)
    ran, read = read_bytes(model)
    assert ran == _by_hand([3, 11, 5, 8, 9, 10]) == (5, 2, 2)  # layer 0: {3, 5, 0, 1, 2}
    fused = integer_forward(model)
    if fused is not None:  # the blocks' flags are views of the fused forward's
        assert fused.touched.sum(-1).tolist() == list(ran)
    blocks = [layer.mlp for layer in model.model.layers]
    expert = weight_bytes(blocks[0].experts[0])
    assert read == weight_bytes(model) - (3 * 8 - sum(ran)) * expert
    (report,) = union_reads([ForwardCost("target", 2, 3, 4, 0.01, ran, read)], model, 1e9)
    assert report.experts_run == 3.0 and report.bytes_read == read
    assert report.expected_union == pytest.approx(8 * (1 - 0.75**6))
    assert report.expected_bytes == weight_bytes(model) - round(3 * (8 - report.expected_union) * expert)
    assert report.floor_s == pytest.approx(read / 1e9) and report.over_floor == pytest.approx(0.01 * 1e9 / read)


def test_measured_costs_keep_the_experts_each_forward_ran():
    """measure_forward_costs on the hand-routed mixture: every forward keeps the experts its blocks ran and their
    bytes; one token of one row runs its top 2 in every block (the union expected of one token), and the one-token
    step's floor is those bytes, not every expert's. A dense model's costs report no union."""
    model = _hand_routed_olmoe()
    costs = measure_forward_costs(model, model, (1, 2), (3,), context=4, repeats=1)
    every, expert = weight_bytes(model), weight_bytes(model.model.layers[0].mlp.experts[0])
    for cost in costs:
        assert len(cost.experts) == 3 and cost.experts[1:] == (2, 2) and 2 <= cost.experts[0] <= 8
        assert cost.bytes_read == every - (3 * 8 - sum(cost.experts)) * expert
    reads = union_reads(costs, model, 1e9)
    assert [(r.batch_size, r.new_tokens) for r in reads] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    assert reads[0].experts_run == 2.0 == pytest.approx(reads[0].expected_union)
    floors = step_floors(costs, {"target": every, "draft": every}, 1e9)
    assert floors[0].weight_bytes == costs[0].bytes_read < every
    dense = tiny_models.build_llama(seed=3)
    assert union_reads(measure_forward_costs(dense, dense, (1,), (1,), context=2, repeats=1), dense, 1e9) == []


def test_costs_command_reports_a_mixtures_forwards_against_their_union(tmp_path):
    """An int8 OLMoE target (its own draft): costs.json and the table hold every target width against the experts
    it ran; a one-token step of one row ran its top 2 of 8 in each block, the union expected of one token."""
    for name in ("target", "draft"):
        tiny_models.build_olmoe(seed=2, hidden_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=2).to(
            torch.bfloat16).save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    models = ["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--quantize", "int8"]
    result = run_cli("costs", *models, "--batch-sizes", "1,2", "--draft-lengths", "3", "--context", "8",
                     "--repeats", "1", "-o", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    reads = json.loads((tmp_path / "out" / "costs.json").read_text())["union_reads"]
    assert [(r["batch_size"], r["new_tokens"]) for r in reads] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    assert reads[0]["experts_run"] == 2.0 == pytest.approx(reads[0]["expected_union"])
    assert all(2.0 <= r["experts_run"] <= 8.0 and r["bytes_read"] > 0 for r in reads)
    assert "| experts run | expected union |" in result.stdout and "| 2 | 4 | " in result.stdout
