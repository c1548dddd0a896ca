"""The exact int4 forward (``--quantize int4``, :mod:`batchspec.exact.integer.int4`): 4-bit weights, 8-bit activations.

* Weights: a GGUF file's Q4_0, Q4_1 and Q4_K blocks are held as they are (expanded, they equal gguf's own
  dequantization element for element); a float weight rounds to the nearest point of the grid; the packed layout.
* Kernels: each native build's activation quantization and product give the torch path's bits (hypothesis: shapes,
  magnitudes, super-blocks of 1 and 8 sub-blocks, partial ones, bias, residual, stacked outputs).
* The model: every row's logits are the same bits alone and in a ragged batch, on every build and thread count and
  on the torch path; batchspec's output is the int4 model's own greedy output; seeded samples do not depend on the
  batch; int4 and int8 layers mix in one model (a file's 4-bit tensors beside its others).
"""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import tiny_models
import torch
from gguf import GGMLQuantizationType, GGUFWriter, dequantize, quantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ragged import alone_one_token_at_a_time, draw_ragged, ragged_forwards

from batchspec.exact.integer import native, quantization, quantize_model
from batchspec.exact.integer.arithmetic import EXP2_COEFFICIENTS
from batchspec.exact.integer.int4 import Int4Weight, from_float, from_gguf, int4_product, quantize_blocks
from batchspec.exact.integer.linear import Int4Linear, Int8Linear, gated
from batchspec.exact.integer.model import exact_rms_norm
from batchspec.models.gguf_weights import GgufOrigin, GgufWeights

BUILDS = [pytest.param(name, marks=pytest.mark.skipif(name not in native.host_isas(), reason=f"this CPU lacks {name}"))
          for name in native.ISAS]
KINDS = ("llama", "qwen2", "qwen3", "mistral")
BUILDERS = {"llama": tiny_models.build_llama, "qwen2": tiny_models.build_qwen2, "qwen3": tiny_models.build_qwen3,
            "mistral": tiny_models.build_mistral}


@pytest.fixture(scope="module")
def int4_models() -> dict[str, torch.nn.Module]:
    """``kind -> int4 model``: the tiny float32 targets, every linear layer but the output rounded to int4."""
    return {kind: quantize_model(BUILDERS[kind](seed=5).float(), width="int4") for kind in KINDS}


# ------------------------------------------------------------------------------------------------ weights


def _random_q4_k(outputs: int, blocks: int, seed: int) -> np.ndarray:
    """Random Q4_K rows: finite float16 d and dmin, random scale bytes and nibbles (``[O, 144 B]`` uint8)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (outputs, blocks, 144), dtype=np.uint8)
    scales = (rng.standard_normal((outputs, blocks, 2)) * 0.01).astype(np.float16)
    raw[..., :4] = scales.view(np.uint8).reshape(outputs, blocks, 4)
    return raw.reshape(outputs, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_a_gguf_files_blocks_are_held_as_they_are(kind):
    """The int4 weight of a GGUF tensor's blocks, expanded, is gguf's own dequantization of them, element for
    element (Q4_0 and Q4_1 quantized by gguf from random floats; Q4_K random bytes, as gguf cannot write it)."""
    qtype = GGMLQuantizationType[kind]
    if kind == "Q4_K":
        raw = _random_q4_k(24, 3, seed=1)
    else:
        raw = quantize(np.random.default_rng(2).standard_normal((24, 96)).astype(np.float32), qtype)
    want = torch.from_numpy(dequantize(raw, qtype))  # [24, K]
    weight = from_gguf(kind, raw, want.shape[1])
    assert torch.equal(weight.values(), want)
    assert weight.subs == (8 if kind == "Q4_K" else 1) and int(weight.nibbles.max()) <= 15


def test_other_gguf_types_are_not_int4():
    with pytest.raises(ValueError, match="Q6_K"):
        from_gguf("Q6_K", np.zeros((2, 210), dtype=np.uint8), 256)


@pytest.mark.parametrize("inner", [32, 100, 256, 900])
def test_a_float_weight_rounds_to_its_nearest_grid_point(inner):
    """Each weight is within half a step of its sub-block's grid (plus the float16 and 8-bit roundings of the step
    and the min), and every integer is in range."""
    weight = torch.randn(40, inner, generator=torch.Generator().manual_seed(inner)) * 0.05
    four = from_float(weight)
    error = (four.values() - weight).abs().view(40, -1)  # [O, K]
    step = weight.abs().amax(1, keepdim=True) * 2 / 15  # the coarsest sub-block step a row can have
    assert float((error / step).max()) < 0.6
    assert int(four.nibbles.max()) <= 15 and int(four.scales.max()) <= 255 and int(four.mins.max()) <= 255
    assert four.nibbles.shape == (40, -(-inner // 32) * 32) and four.d.shape == (40, -(-inner // 256))


def test_packed_layout_worked_example():
    """A 1 x 40 weight in super-blocks of 8 sub-blocks: one panel, one super-block of 2 sub-blocks: d, dmin (16
    float16 each), sc [2, 16], mn [1, 16, 2], then nibbles [2, 4, 16, 4]; input 8 g + i low, 8 g + 4 + i high."""
    nibbles = torch.zeros(1, 64, dtype=torch.uint8)
    nibbles[0, 9], nibbles[0, 13], nibbles[0, 32] = 7, 5, 3  # sub-block 0, g = 1, i = 1 low and high; sub-block 1
    weight = Int4Weight(nibbles, torch.tensor([[2, 3]], dtype=torch.uint8), torch.tensor([[4, 6]], dtype=torch.uint8),
                        torch.tensor([[1.5]]).half(), torch.tensor([[0.25]]).half(), 8, 40)
    packed = weight.packed()[0]
    assert packed.numel() == 64 + 32 * 2 + 256 * 2
    assert float(packed[:2].view(torch.float16)) == 1.5 and float(packed[32:34].view(torch.float16)) == 0.25
    assert packed[64:68].tolist() == [2, 0, 0, 0] and packed[64 + 16] == 3  # sc of output 0, sub-blocks 0 and 1
    assert packed[96:98].tolist() == [4, 6]  # mn of output 0, sub-blocks 0 and 1 interleaved
    nibble_bytes = packed[128:]
    assert nibble_bytes[64 + 1] == 7 | (5 << 4)  # sub-block 0, g = 1, output 0, i = 1
    assert nibble_bytes[256] == 3  # sub-block 1, g = 0, output 0, i = 0
    assert torch.equal(weight.values()[0, [9, 13, 32]], torch.tensor([1.5 * 2 * 7 - 1, 1.5 * 2 * 5 - 1, 13.5 - 1.5]))


# ------------------------------------------------------------------------------------------------ kernels


def _weight(outputs: int, inner: int, subs: int, generator: torch.Generator) -> Int4Weight:
    """A random int4 weight with full-range nibbles, scales and mins (``subs`` sub-blocks a super-block)."""
    sub_blocks = -(-inner // 32)
    blocks = -(-sub_blocks // subs)
    nibbles = torch.randint(0, 16, (outputs, 32 * sub_blocks), dtype=torch.uint8, generator=generator)
    nibbles[:, inner:] = 0
    if subs == 1:
        scales = mins = torch.ones(outputs, sub_blocks, dtype=torch.uint8)
    else:
        scales, mins = (torch.randint(0, 256, (outputs, sub_blocks), dtype=torch.uint8, generator=generator)
                        for _ in range(2))
    d, dmin = (torch.randn(outputs, blocks, generator=generator).mul_(0.01).half() for _ in range(2))
    return Int4Weight(nibbles, scales, mins, d, dmin, subs, inner)


@pytest.mark.parametrize("isa", BUILDS)
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 20), inner=st.integers(1, 600), outputs=st.integers(1, 70), subs=st.sampled_from([1, 2, 8]),
    seed=st.integers(0, 2**16), log_scale=st.integers(-20, 20), extras=st.booleans(),
)
def test_each_build_gives_the_torch_paths_bits(isa, rows, inner, outputs, subs, seed, log_scale, extras):
    """The blocked quantization (alone, after RMSNorm, of the gated activation) and the product with bias and
    residual: each build's bits are the torch path's, for any shape, partial super-block and magnitude."""
    generator = torch.Generator().manual_seed(seed)
    x, up = (torch.randn(2, rows, inner, generator=generator) * 2.0**log_scale).unbind()  # [N, K] each
    x[0, 0] = 0.0
    norm = torch.rand(inner, generator=generator) + 0.5
    weight = _weight(outputs, inner, subs, generator)
    bias = torch.randn(outputs, generator=generator) if extras else None
    residual = torch.randn(rows, outputs, generator=generator) if extras else None
    with native.using("none"):
        blocked = quantize_blocks(x, weight.block)
        want = int4_product(blocked, weight, bias)
        want = want if residual is None else residual + want
        normed = quantize_blocks(exact_rms_norm(x, norm, 1e-6), weight.block)
        gate = quantize_blocks(gated(x.clone(), up), weight.block)
    with native.using(isa):
        assert all(torch.equal(a, b) for a, b in zip(native.quantize_blocks(x, weight.block), blocked, strict=True))
        got = native.linear4(blocked, weight.packed(), inner, subs, outputs, bias, residual=residual)[0]
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in
                   zip(native.norm_quantize_blocks(x, norm, 1e-6, weight.block), normed, strict=True))
        assert all(torch.equal(a, b) for a, b in
                   zip(native.quantize_gated_blocks(x, up, EXP2_COEFFICIENTS, weight.block), gate, strict=True))


@pytest.mark.parametrize("isa", BUILDS)
def test_stacked_int4_outputs_are_each_layers_own(isa):
    """One pass over two weights stacked (q and k as one product) gives each layer's output in its own tensor."""
    generator = torch.Generator().manual_seed(3)
    first, second = _weight(48, 300, 8, generator), _weight(20, 300, 8, generator)
    x = torch.randn(5, 300, generator=generator)
    with native.using(isa):
        blocked = native.quantize_blocks(x, 256)
        stacked = torch.cat([first.packed(), second.packed()])
        outs = native.linear4(blocked, stacked, 300, 8, 68, widths=(48, 20))
        assert torch.equal(outs[0], native.linear4(blocked, first.packed(), 300, 8, 48)[0])
        assert torch.equal(outs[1], native.linear4(blocked, second.packed(), 300, 8, 20)[0])


# float16 bit patterns at the edges: subnormals (2**-24 up to the largest), the smallest normals, the largest finite,
# zeros, one and a half, both signs
EXTREME_HALVES = (0x0001, 0x0002, 0x0155, 0x03FF, 0x0400, 0x0401, 0x7BFF, 0x0000, 0x8000, 0x8001, 0x83FF, 0xFBFF,
                  0x3C00, 0x3800, 0x0200)


@pytest.mark.parametrize("isa", BUILDS)
def test_every_float16_pattern_reads_as_torch_reads_it(isa):
    """The kernels' float16 -> float32 conversion by bit operations (``csrc/scalar.h``'s half_to_float, with which the
    portable build reads d and dmin; the SIMD builds use F16C) gives torch's bits for all 65,536 patterns: zeros,
    subnormals, normals, infinities, and NaNs quieted with their payload kept (as torch's conversion of a float16
    tensor and ``vcvtph2ps`` quiet them)."""
    halves = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(torch.float16)  # [65536], every pattern
    with native.using(isa):
        got = native.half_to_float(halves)
    assert torch.equal(got.view(torch.int32), halves.float().view(torch.int32))


@pytest.mark.parametrize("subs", [1, 8])
@pytest.mark.parametrize("isa", BUILDS)
def test_extreme_float16_scales_give_the_torch_paths_bits(isa, subs):
    """An int4 weight whose d and dmin are subnormal halves, the smallest and largest normal ones, zeros of both signs
    and negatives: each build's product (the portable build converting them by bit operations) is the torch path's."""
    generator = torch.Generator().manual_seed(8)
    weight = _weight(40, 600, subs, generator)
    extremes = torch.tensor(EXTREME_HALVES, dtype=torch.int32).to(torch.int16).view(torch.float16)

    def scales() -> torch.Tensor:  # [O, B]
        return extremes[torch.randint(0, len(extremes), weight.d.shape, generator=generator)]

    weight = dataclasses.replace(weight, d=scales(), dmin=scales())
    x = torch.randn(7, 600, generator=generator)
    with native.using("none"):
        blocked = quantize_blocks(x, weight.block)
        want = int4_product(blocked, weight, None)
    with native.using(isa):
        assert torch.equal(native.linear4(blocked, weight.packed(), 600, subs, 40)[0], want)


@pytest.mark.skipif(not native.available(), reason="this CPU or machine does not run the native kernels")
def test_the_int4_kernel_refuses_what_does_not_fit():
    generator = torch.Generator().manual_seed(4)
    weight = _weight(20, 64, 8, generator)
    blocked = native.quantize_blocks(torch.randn(3, 64, generator=generator), 256)
    with pytest.raises(ValueError, match="do not fit"):
        native.linear4(blocked, weight.packed(), 96, 8, 20)  # another inner size
    with pytest.raises(ValueError, match="do not fit"):
        native.linear4(blocked, weight.packed(), 64, 8, 40)  # more outputs than the panels hold
    with pytest.raises(ValueError, match="block quantization takes"):
        native.quantize_blocks(torch.randn(3, 64), 48)


# ------------------------------------------------------------------------------------------------ the model


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.parametrize("kind", KINDS)
def test_every_int4_row_is_bit_identical_to_itself_alone(kind, int4_models, data):
    """Rows of different lengths, left-padded, in forwards of 1..5 new tokens, give each row exactly the logits it
    gets alone, one token at a time."""
    model = int4_models[kind]
    rows, prefix, steps = draw_ragged(data, model.config.vocab_size, max_batch=4, max_length=20)
    for row, got in zip(rows, ragged_forwards(model, rows, prefix, steps), strict=True):
        assert torch.equal(got, alone_one_token_at_a_time(model, row))


def test_an_int4_model_swaps_every_layer_but_the_output_and_each_stays_close():
    """Every linear layer but the output becomes int4; each computes its float layer's product within the grid's
    rounding (a random Gaussian weight in 4 bits: about 8% of the product's norm)."""
    model = BUILDERS["qwen2"](seed=5).float()
    four = quantize_model(copy.deepcopy(model), width="int4")
    assert quantization(four) == "int4" and isinstance(four.lm_head, Int8Linear)
    x = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for name in ("q_proj", "k_proj", "v_proj"):
        layer, dense = getattr(four.model.layers[1].self_attn, name), getattr(model.model.layers[1].self_attn, name)
        assert isinstance(layer, Int4Linear)
        with torch.no_grad():
            want, got = dense(x), layer(x)
        assert float((got - want).norm() / want.norm()) < 0.12


def test_int4_takes_float32_models_only(bundles):
    with pytest.raises(ValueError, match="int4 needs a float32 model"):
        quantize_model(copy.deepcopy(bundles["llama"].target), width="int4")  # float64


def test_a_sources_4_bit_weights_beside_its_others(bundles):
    """With a source (a GGUF file's), a layer it gives an int4 weight is int4 with exactly that weight, one it gives
    None is int8: the q, k, v and gate, up products then read one input in both forms, and the model is still
    exact (its rows equal themselves alone)."""
    model = BUILDERS["llama"](seed=6).float()
    given_weights = {}

    def source(name: str) -> Int4Weight | None:
        if name.endswith(("v_proj", "down_proj")) and ".0." in name:
            return None
        given_weights[name] = from_float(model.get_submodule(name).weight)
        return given_weights[name]

    four = quantize_model(model, width="int4", source=SimpleNamespace(int4=source, embedding=lambda *_: None))
    first = four.model.layers[0]
    assert isinstance(first.self_attn.v_proj, Int8Linear) and isinstance(first.mlp.down_proj, Int8Linear)
    assert isinstance(first.self_attn.q_proj, Int4Linear) and isinstance(four.model.layers[1].mlp.down_proj, Int4Linear)
    layer = four.model.layers[1].mlp.up_proj
    assert torch.equal(layer.packed, given_weights["model.layers.1.mlp.up_proj"].packed())
    rows = tiny_models.random_prompts(5, seed=3, min_len=4, max_len=20)
    prefix = [max(1, len(row) - 4) for row in rows]
    for row, got in zip(rows, ragged_forwards(four, rows, prefix, [2, 1, 1]), strict=True):
        assert torch.equal(got, alone_one_token_at_a_time(four, row))


def test_a_draft_rounds_to_int4_what_its_file_holds_otherwise():
    """``round_rest`` (a draft's ``--draft-quantize int4``): the layers the source has no int4 weight for are the
    float weight rounded to int4 rather than int8; the source's own weights are kept; the output layer stays int8."""
    model = BUILDERS["llama"](seed=6).float()

    def source(name: str) -> Int4Weight | None:
        return None if name.endswith("v_proj") else from_float(model.get_submodule(name).weight)

    four = quantize_model(model, width="int4", source=SimpleNamespace(int4=source, embedding=lambda *_: None),
                          round_rest=True)
    first = four.model.layers[0]
    assert isinstance(first.self_attn.v_proj, Int4Linear) and isinstance(first.self_attn.q_proj, Int4Linear)
    assert isinstance(four.lm_head, Int8Linear)


def test_the_int4_model_is_the_same_bits_on_every_build_and_thread_count():
    """Quantized under each build this CPU runs and under the torch path, the int4 model's logits (a ragged batch
    decoded 1, 3 and 1 tokens at a time) are the same bits with 1, 2 and 16 threads."""
    float32 = BUILDERS["qwen3"](seed=7).float()
    rows = tiny_models.random_prompts(6, seed=11, min_len=6, max_len=30)
    prefix = [max(1, len(row) - 5) for row in rows]
    threads, want = torch.get_num_threads(), None
    try:
        for isa in (*native.host_isas(), "none"):
            with native.using(isa):
                model = quantize_model(copy.deepcopy(float32), width="int4")
                for count in (1, 2, 16):
                    torch.set_num_threads(count)
                    got = ragged_forwards(model, rows, prefix, [1, 3, 1])
                    want = want or got
                    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (isa, count)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "method, proposer, k",
    [("eqspec", "draft", 3), ("exspec", "hybrid", 2), ("eqspec", "ngram", "auto"), ("autoregressive", None, 1)],
)
def test_batched_output_equals_the_int4_models_own(method, proposer, k, int4_models, bs, reference):
    target = int4_models["qwen2"]
    draft = quantize_model(tiny_models.perturbed_copy(BUILDERS["qwen2"](seed=5), 0.1, seed=6).float(), width="int4")
    prompts = tiny_models.random_prompts(6, seed=8, max_len=30)
    result = bs.generate(target, draft, prompts, method=method, proposer=proposer, batch_size=4, max_new_tokens=20,
                         num_draft_tokens=k, check_invariants=True)
    assert result.sequences == [reference(target, prompt, 20, None) for prompt in prompts]


def test_seeded_int4_samples_do_not_depend_on_the_batch_or_k(int4_models, bs):
    target = int4_models["llama"]
    draft = quantize_model(tiny_models.perturbed_copy(BUILDERS["llama"](seed=5), 0.1, seed=6).float(), width="int4")
    prompts = [row + row[:4] + row for row in tiny_models.random_prompts(5, seed=9, min_len=4, max_len=12)]
    common = {"method": "eqspec", "proposer": "hybrid", "max_new_tokens": 14, "temperature": 1.0, "top_p": 0.95,
              "seed": 7, "check_invariants": True}
    alone = bs.generate(target, draft, prompts, batch_size=1, num_draft_tokens=3, **common)
    for batch_size, k in [(5, 2), (3, "auto")]:
        assert bs.generate(target, draft, prompts, batch_size=batch_size, num_draft_tokens=k,
                           **common).sequences == alone.sequences


def test_the_gguf_index_reads_what_ggufs_reader_reads(tmp_path):
    """:class:`GgufIndex` (the tensor table and two metadata values, the rest stepped over) gives each tensor's type,
    shape and bytes as gguf's own reader does, past metadata of every kind (strings, arrays of strings and numbers)."""
    from gguf import GGUFReader, GGUFWriter

    from batchspec.models.gguf_weights import GgufIndex

    writer = GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    writer.add_block_count(2)
    writer.add_token_list(["<s>", "a", "bc", "déf"])
    writer.add_array("test.numbers", [1.5, 2.5])
    writer.add_uint64("test.big", 2**40)
    rng = np.random.default_rng(0)
    writer.add_tensor("blk.0.attn_q.weight", quantize(rng.standard_normal((8, 64)).astype(np.float32),
                                                      GGMLQuantizationType.Q4_0), raw_dtype=GGMLQuantizationType.Q4_0)
    writer.add_tensor("blk.0.ffn_norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.add_tensor("blk.1.ffn_up.weight", quantize(rng.standard_normal((16, 64)).astype(np.float32),
                                                      GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    index = GgufIndex(tmp_path / "tiny.gguf")
    assert index.arch == "llama" and index.blocks == 2
    for tensor in GGUFReader(str(tmp_path / "tiny.gguf")).tensors:
        ours = index.tensors[tensor.name]
        assert ours.kind == tensor.tensor_type.name and ours.shape == tuple(int(d) for d in reversed(tensor.shape))
        assert np.array_equal(ours.read().reshape(-1), np.asarray(tensor.data).reshape(-1).view(np.uint8))


@pytest.mark.parametrize("arch", ["phi3", "glm4"])
def test_a_gguf_file_of_a_family_with_fused_projections_is_refused(arch, tmp_path):
    """Phi-3's and GLM-4's GGUF files hold their fused projections as llama.cpp lays them out, which the integer model
    (its projections split from a checkpoint's, batchspec.exact.integer.model.split_fused) does not read: refused
    with a sentence that names the safetensors checkpoint."""
    path = tmp_path / f"{arch}.gguf"
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="load its safetensors checkpoint instead"):
        GgufWeights(GgufOrigin(path), torch.nn.Linear(1, 1))
