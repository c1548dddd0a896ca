"""The exact int8 forward (``--quantize int8``, :mod:`batchspec.int8`).

* Arithmetic: each building block computes what it claims (quantization, exp, fixed-order sums, the vector-path
  SiLU, exact integer products, also through the two-halves path CPUs without VNNI take).
* The property the mode exists for: a row's logits are bit-identical whatever else is in the forward (other rows,
  left padding, how many new tokens a forward takes), against the row run alone one token at a time.
* Through batchspec: every method and proposer equals the quantized model's own ``generate`` exactly, seeded
  sampling gives each prompt the same tokens at any batch size and k, and sampled tokens follow the quantized
  target's distribution (chi-square).
"""

from __future__ import annotations

import copy
import os
import platform
import subprocess
import sys

import pytest
import tiny_models
import torch
from helpers import exact_joint, joint_pvalue
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ragged import alone_one_token_at_a_time, ragged_forwards

import batchspec
from batchspec.engine.sampling import SamplingParams
from batchspec.int8 import check_quantize, product, quantization, quantize_model
from batchspec.int8.arithmetic import exp2_nonpositive, quantize_rows, row_sum, silu_
from batchspec.int8.attention import exact_attention
from batchspec.int8.linear import Int8Linear
from batchspec.int8.product import KERNELS, activation_codes, int_product, pack_weight, product_kernel, split_weight
from batchspec.int8.smoothing import calibration_ids, smooth_model

KINDS = ("llama", "qwen2", "qwen3", "mistral")


@pytest.fixture(scope="module")
def quantized(bundles) -> dict[str, tuple]:
    """``kind -> (int8 target, int8 perturbed draft, bundle)``: copies of the float64 tiny models, quantized."""
    out = {}
    for kind in KINDS:
        bundle = bundles[kind]
        target = quantize_model(copy.deepcopy(bundle.target))
        draft = quantize_model(copy.deepcopy(bundle.drafts["perturbed"]))
        out[kind] = (target, draft, bundle)
    return out


@pytest.fixture(scope="module")
def quantized_float32(bundles) -> dict[str, torch.nn.Module]:
    """``kind -> int8 target`` made from a float32 copy, its layers on both product kernels where this CPU has the
    onednn one exactly: the MLP and output layers on ``onednn``, the attention's smaller projections on ``_int_mm``
    (so one shared quantization feeds both)."""
    out = {}
    for kind in KINDS:
        model = copy.deepcopy(bundles[kind].target).float()
        gate = model.model.layers[0].mlp.gate_proj.weight
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(product, "ONEDNN_MIN_WEIGHT", gate.numel())
            out[kind] = quantize_model(model)
    return out


# ------------------------------------------------------------------------------------------------ arithmetic


def test_quantize_rows_worked_example():
    q, scale = quantize_rows(torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]], dtype=torch.float64))
    assert q.tolist() == [[64.0, -127.0, 32.0], [0.0, 0.0, 0.0]]
    assert scale.tolist() == [[1.0 / 127], [1.0]]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-8), (torch.float32, 4e-6)])
def test_exp2_nonpositive_is_accurate(dtype, tolerance):
    t = -torch.linspace(0, 120, 100_001, dtype=torch.float64).to(dtype)
    want = torch.exp2(t.double())
    got = exp2_nonpositive(t.clone()).double()
    assert ((got - want).abs() / want).max().item() < tolerance
    assert exp2_nonpositive(torch.tensor([0.0, -1.0, -3.0], dtype=dtype)).tolist() == [1.0, 0.5, 0.125]


def test_row_sum_order_is_a_pairwise_tree():
    a, b, c = 1e16, 1.0, -1e16
    # the tree adds a + c first, then b: exactly 1.0, where a left-to-right sum loses b
    assert row_sum(torch.tensor([[a, b, c]], dtype=torch.float64)).item() == 1.0
    assert (a + b) + c == 0.0


def test_silu_gives_a_row_the_same_values_alone_and_in_a_batch():
    """In a batch, a row of 50 values starts at any offset of torch's vector steps, and its values take the vector
    path or the scalar tail depending on it: about one value in eight that changes path changes its last bit. The
    vector-path silu gives every one of 4,000 rows the values it gets alone, in the padded and the in-place path."""
    torch.manual_seed(0)
    for width in (50, 128):
        rows = torch.randn(4000, width) * 4
        batched = silu_(rows.clone())
        alone = torch.cat([silu_(row[None].clone()) for row in rows])
        assert torch.equal(batched, alone), width
        assert torch.allclose(batched, torch.nn.functional.silu(rows), rtol=1e-6, atol=1e-6)


def _extreme_operands(rows: int, inner: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    a = torch.randint(-127, 128, (rows, inner), dtype=torch.int8, generator=generator)
    w = torch.randint(-127, 128, (cols, inner), dtype=torch.int8, generator=generator)
    a[0], w[0], w[1] = 127, 127, -127
    return a, w


@pytest.mark.parametrize("rows, inner, cols", [(1, 64, 32), (5, 256, 96), (33, 1536, 40), (48, 8960, 24)])
def test_every_product_kernel_gives_the_exact_sum_rounded_once(rows, inner, cols):
    """Each kernel this CPU runs gives the exact integer sums (float64 holds them), rounded once to float32: the
    onednn kernel (where the CPU has it exactly), ``_int_mm`` and its halves; 8960 inputs take sums past 2**24."""
    a, w = _extreme_operands(rows, inner, cols)
    exact = a.double() @ w.double().T  # [N, O]
    assert exact.abs().max().item() > 2**24 or inner < 8960
    kernels = [k for k in KERNELS if k != "onednn" or product_kernel(torch.float32) == "onednn"]
    for kernel in kernels:
        weight = pack_weight(w, kernel)
        codes = activation_codes(a.float(), kernel)
        assert torch.equal(int_product(codes, weight, torch.float32), exact.float()), kernel
    high, low = split_weight(w)
    assert high.abs().max().item() <= 64 and set(low.unique().tolist()) <= {0, 1}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="oneDNN's ISA cap is an x86 setting")
def test_a_cpu_without_vnni_gets_the_same_bits():
    """oneDNN capped at AVX2 (no VNNI) saturates on full-range int8; the layer detects it and takes the two-halves
    path, whose output equals this process's bit for bit."""
    script = (
        "import sys, torch\n"
        "from batchspec.int8.product import int_mm_saturates, product_kernel\n"
        "from batchspec.int8.linear import Int8Linear\n"
        "torch.manual_seed(0)\n"
        "layer = Int8Linear(torch.nn.Linear(256, 96))\n"
        "x = torch.randn(9, 256)\n"
        "torch.save({'saturates': int_mm_saturates(), 'kernel': product_kernel(), 'y': layer(x)}, sys.argv[1])\n"
    )
    results = {}
    for isa in ("AVX2", "DEFAULT"):
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"batchspec_int8_{isa}_{os.getpid()}.pt")
        env = dict(os.environ, ONEDNN_MAX_CPU_ISA=isa) if isa != "DEFAULT" else dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(sys.path)
        subprocess.run([sys.executable, "-c", script, path], env=env, check=True, timeout=120)
        results[isa] = torch.load(path)
        os.remove(path)
    assert results["AVX2"]["saturates"], "oneDNN capped at AVX2 should saturate on full-range int8"
    assert results["AVX2"]["kernel"] == "int_mm_split"
    assert torch.equal(results["AVX2"]["y"], results["DEFAULT"]["y"])


def test_exact_attention_is_close_to_softmax_attention():
    torch.manual_seed(1)
    query, key, value = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    visible = torch.ones(2, 1, 3, 9, dtype=torch.bool).tril(diagonal=6)
    visible[1, :, :, :2] = False  # left padding of row 1
    got = exact_attention(query, key, value, visible, scaling=0.25)
    expanded = [t.repeat_interleave(2, dim=1) for t in (key, value)]
    want = torch.nn.functional.scaled_dot_product_attention(
        query, *expanded, attn_mask=visible, scale=0.25
    ).transpose(1, 2)
    assert got.shape == want.shape == (2, 3, 4, 16)
    assert (got - want).abs().max().item() < 2e-3


def test_a_query_that_sees_nothing_outputs_zeros():
    query, key, value = torch.randn(1, 2, 2, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    visible = torch.tensor([[[[False] * 4, [True] * 4]]])
    out = exact_attention(query, key, value, visible, scaling=1.0)
    assert torch.equal(out[0, 0], torch.zeros(2, 8)) and out[0, 1].abs().sum() > 0


# ------------------------------------------------------------------------------------------------ the model


def test_float32_layers_take_both_kernels_where_onednn_is_exact(quantized_float32):
    kernels = {m.weight.kernel for m in quantized_float32["llama"].modules() if isinstance(m, Int8Linear)}
    assert kernels == ({"onednn", "int_mm"} if product_kernel(torch.float32) == "onednn" else {product_kernel()})


def test_quantize_swaps_every_layer_and_stays_close(bundles):
    bundle = bundles["llama"]
    model = quantize_model(copy.deepcopy(bundle.target))
    assert quantization(model) == "int8" and quantization(bundle.target) == "none"
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    ids = torch.tensor([bundle.probe[0][0]])
    with torch.no_grad():
        dense, exact = bundle.target(ids).logits, model(ids).logits
    assert (exact - dense).abs().max().item() < 0.1 * dense.abs().max().item()


@pytest.mark.parametrize("kind", KINDS)
def test_smoothing_leaves_the_float_model_unchanged(kind, bundles):
    """Smoothing moves scale between activations and weights: the float64 model computes the same logits."""
    model = copy.deepcopy(bundles[kind].target)
    ids = torch.tensor([bundles[kind].probe[0][0]])
    with torch.no_grad():
        before = model(ids).logits
        rescaled = smooth_model(model, calibration_ids(None, model.config.vocab_size))
        after = model(ids).logits
    assert rescaled == 6 * model.config.num_hidden_layers
    assert torch.allclose(after, before, rtol=1e-9, atol=1e-9)
    norm = model.model.layers[0].input_layernorm.weight
    assert not torch.equal(norm, bundles[kind].target.model.layers[0].input_layernorm.weight)


def test_check_quantize_names_the_choices():
    assert check_quantize("int8") == "int8"
    with pytest.raises(ValueError, match="auto, none, int8"):
        check_quantize("int4")


def test_quantize_refuses_what_it_cannot_make_exact(bundles):
    with pytest.raises(ValueError, match="float32"):
        quantize_model(copy.deepcopy(bundles["llama"].target).to(torch.bfloat16))
    gelu = tiny_models.build_llama(seed=5, hidden_act="gelu")
    with pytest.raises(ValueError, match="SiLU"):
        quantize_model(gelu)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_row_is_bit_identical_to_itself_alone(kind, dtype, quantized, quantized_float32, data):
    """The property: rows of different lengths, left-padded, in forwards of 1..5 new tokens, give each row exactly
    the logits it gets alone, one token at a time; in float64, and in float32 on both product kernels."""
    model = quantized[kind][0] if dtype == "float64" else quantized_float32[kind]
    batch = data.draw(st.integers(1, 4), label="batch")
    lengths = data.draw(st.lists(st.integers(2, 24), min_size=batch, max_size=batch), label="lengths")
    prefix = [data.draw(st.integers(1, n - 1), label="prefix") for n in lengths]
    longest_tail = max(n - p for n, p in zip(lengths, prefix, strict=True))
    steps = []
    while sum(steps) < longest_tail:
        steps.append(data.draw(st.integers(1, 5), label="step"))
    seed = data.draw(st.integers(0, 2**16), label="seed")
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    rows = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    batched = ragged_forwards(model, rows, prefix, steps)
    for row, got in zip(rows, batched, strict=True):
        assert torch.equal(got, alone_one_token_at_a_time(model, row))


# ------------------------------------------------------------------------------------------------ through batchspec


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "method, proposer, k",
    [("eqspec", "draft", 3), ("exspec", "draft", 2), ("eqspec", "ngram", 4), ("eqspec", "hybrid", "auto"),
     ("exspec", "hybrid", 3), ("autoregressive", None, 1)],
)
def test_batched_output_equals_the_quantized_models_own(kind, method, proposer, k, quantized, bs, reference):
    target, draft, bundle = quantized[kind]
    prompts = [prompt for prompt, _ in bundle.probe[:6]]
    result = bs.generate(
        target, draft, prompts, method=method, proposer=proposer, batch_size=4, max_new_tokens=24,
        num_draft_tokens=k, eos_token_id=bundle.eos_id, pad_token_id=bundle.pad_id, check_invariants=True,
    )
    assert result.sequences == [reference(target, prompt, 24, bundle.eos_id) for prompt in prompts]


@pytest.mark.parametrize("method, proposer", [("eqspec", "draft"), ("exspec", "hybrid"), ("eqspec", "ngram")])
def test_seeded_samples_do_not_depend_on_the_batch_or_k(method, proposer, quantized, bs):
    """Each prompt decoded alone (batch size 1, k = 3) and in batches with other k draws the same tokens."""
    target, draft, bundle = quantized["qwen2"]
    prompts = [prompt + prompt[:4] + prompt for prompt, _ in bundle.probe[:5]]  # repeats: lookups find matches
    common = {"method": method, "proposer": proposer, "max_new_tokens": 16, "temperature": 1.0, "top_p": 0.95,
              "seed": 7, "eos_token_id": bundle.eos_id, "pad_token_id": bundle.pad_id, "check_invariants": True}
    alone = bs.generate(target, draft, prompts, batch_size=1, num_draft_tokens=3, **common)
    assert alone.stats.draft_tokens_proposed > 0
    for batch_size, k in [(5, 2), (3, 5), (4, "auto")]:
        batched = bs.generate(target, draft, prompts, batch_size=batch_size, num_draft_tokens=k, **common)
        assert batched.sequences == alone.sequences


@pytest.mark.parametrize("method, proposer", [("eqspec", "draft"), ("exspec", "hybrid")])
def test_sampled_pairs_follow_the_quantized_targets_distribution(method, proposer):
    """Chi-square of the first two sampled tokens against the int8 target's own joint distribution."""
    shape = {"vocab_size": 10, "initializer_range": 0.2, "hidden_size": 32, "intermediate_size": 64}
    target = tiny_models.build_llama(seed=11, **shape)
    draft = quantize_model(tiny_models.perturbed_copy(target, 0.2, seed=12))
    target = quantize_model(target)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 1]
    sampling = {"temperature": 1.0, "top_k": 8}
    result = batchspec.generate(
        target, draft, [prompt] * 3000, method=method, proposer=proposer, batch_size=250, max_new_tokens=3,
        num_draft_tokens=2, eos_token_id=[], seed=26, **sampling,
    )
    assert 0.05 < result.stats.acceptance_rate < 0.95
    joint = exact_joint(target, prompt, SamplingParams(**sampling))
    assert joint_pvalue([s[:2] for s in result.sequences], joint) > 1e-3
