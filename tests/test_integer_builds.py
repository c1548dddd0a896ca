"""The int8 model's bits do not depend on the CPU: every native build this host runs (AVX-512 VNNI, AVX-VNNI, AVX2),
the torch path without them (``BATCHSPEC_CPU_ISA=none``), torch's own scalar dispatch (``ATEN_CPU_CAPABILITY=default``)
and any thread count give the same logits.

Each build is forced with :func:`batchspec.exact.integer.native.using` (or the environment variable in a subprocess)
among
the builds this CPU runs: an AVX-512 host runs all three, an AVX2-only host the ``avx2`` build; a build the CPU lacks is
skipped with its reason, never emulated.

* Kernels: each build's product, quantization, RMSNorm, SiLU and attention give the torch path's bits (hypothesis).
* Models: tiny float32 Llama, Qwen2, Qwen3 and Mistral models quantized under each build have the same int8 weights,
  and their logits, prompts read and decoded in a ragged batch of 8 and alone, are the same bits under every build
  and with 1, 2 and 16 threads.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import tiny_models
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ragged import ragged_forwards

from batchspec.exact.integer import native, quantize_model
from batchspec.exact.integer.arithmetic import EXP2_COEFFICIENTS, exact_silu, quantize_rows
from batchspec.exact.integer.attention import exact_attention, pack
from batchspec.exact.integer.linear import Int8Linear, gated
from batchspec.exact.integer.model import exact_rms_norm

BUILDS = [pytest.param(name, marks=pytest.mark.skipif(name not in native.host_isas(), reason=f"this CPU lacks {name}"))
          for name in native.ISAS]
KINDS = ("llama", "qwen2", "qwen3", "mistral")
THREADS = (1, 2, 16)


# rows whose largest magnitude is subnormal or just above it: top / levels is subnormal, and 1 / (top / levels) would
# overflow to inf, making a zero's code 0 * inf (NaN)
TINY_ROWS = torch.tensor([[-3.62e-39, 0.0, 5e-40, 0.0], [1e-45, -0.0, 0.0, 0.0], [1.4e-36, -7e-37, 0.0, 1e-38],
                          [0.0, 0.0, 0.0, 0.0]])  # [4, 4]


def test_tiny_rows_quantize_to_finite_codes_and_zeros_to_zero():
    """The scale is at least the smallest normal float (arithmetic.quantize_rows): a zero's code is 0 however small
    its row, every code is finite, and values below half of 2**-126 are 0."""
    for levels in (127, 32767):
        q, scale = quantize_rows(TINY_ROWS.clone(), levels)  # [4, 4], [4, 1]
        assert torch.isfinite(q).all() and torch.isfinite(1.0 / scale).all()
        assert torch.equal(q[TINY_ROWS == 0], torch.zeros(int((TINY_ROWS == 0).sum())))
        assert q[0, 0] == 0 and q[2, 0] == 119  # below half the smallest scale; 1.4e-36 / 2**-126, rounded


@pytest.mark.parametrize("isa", BUILDS)
def test_tiny_rows_give_each_build_the_torch_paths_codes(isa):
    """Every build quantizes rows of subnormal magnitude as the torch path does: int8 codes, 15-bit codes and the
    int4 product's blocked codes and sub-block sums."""
    from batchspec.exact.integer.int4 import quantize_blocks

    with native.using("none"):
        q8, s8 = quantize_rows(TINY_ROWS.clone())
        wide = [t.double() for t in quantize_rows(TINY_ROWS.clone(), 32767)]  # float32's, as attention takes them
        blocked = quantize_blocks(TINY_ROWS.clone(), 256)
    with native.using(isa):
        codes, scale = native.quantize(TINY_ROWS.clone())
        assert torch.equal(codes[:, :4].int() - 128, q8.int()) and torch.equal(scale, s8)
        assert all(torch.equal(a, b) for a, b in zip(native.quantize_wide(TINY_ROWS.clone(), 32767), wide,
                                                       strict=True))
        assert all(torch.equal(a, b) for a, b in zip(native.quantize_blocks(TINY_ROWS.clone(), 256), blocked,
                                                       strict=True))


def test_the_builds_table_gives_each_cpu_its_flags_and_each_compiler_its_library(monkeypatch):
    """One row per build: its source exists, a CPU gets the first variant whose features it has (AVX-VNNI's VEX form,
    else AVX-512 VNNI's EVEX form of the 256-bit build; nothing without F16C); every build pins the floating-point
    model, and another compiler version builds another library."""
    assert tuple(build.name for build in native.BUILDS) == native.ISAS
    assert all((native._SOURCES / build.source).is_file() for build in native.BUILDS)
    zen4 = frozenset({"avx2", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
    assert native._build_flags("avxvnni", zen4) == ("-mavx2", "-mavx512vl", "-mavx512vnni", "-mf16c")
    assert native._build_flags("avxvnni", frozenset({"avx2", "f16c", "avx_vnni"})) == ("-mavx2", "-mavxvnni", "-mf16c")
    assert native._build_flags("avx512vnni", frozenset({"avx2", "f16c"})) is None
    assert native._build_flags("avx2", frozenset({"avx2"})) is None
    monkeypatch.setattr(native, "_cpu_flags", lambda: zen4)
    _, flags, _, library = native._build_plan("avx2")
    assert {"-fno-fast-math", "-ffp-contract=off"} <= set(flags)
    monkeypatch.setattr(native, "_compiler_version", lambda name: "cc (a later release) 99.1")
    assert native._build_plan("avx2")[3] != library


def test_a_build_the_cpu_lacks_or_an_unknown_name_is_refused(monkeypatch):
    """A build is forced only among those the CPU runs (here an AVX2-only CPU, by its flags): one the CPU lacks, or
    a name that is none of them, is a ValueError naming what is possible, never an emulation."""
    monkeypatch.setattr(native, "_cpu_flags", lambda: frozenset({"avx", "avx2", "fma", "f16c"}))
    native.host_isas.cache_clear()
    native._default.cache_clear()
    try:
        assert native.host_isas() == ("avx2",)
        with pytest.raises(ValueError, match="this CPU runs avx2"), native.using("avx512vnni"):
            pass
        with pytest.raises(ValueError, match="one of avx512vnni, avxvnni, avx2, none"), native.using("avx1024"):
            pass
        with native.using("none"):
            assert native.isa() == "none" and not native.available()
    finally:
        native.host_isas.cache_clear()
        native._default.cache_clear()


@pytest.mark.parametrize("isa", BUILDS)
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 20), inner=st.integers(1, 300), outputs=st.integers(1, 150), seed=st.integers(0, 2**16),
    log_scale=st.integers(-20, 20),
)
def test_each_build_gives_the_torch_paths_bits(isa, rows, inner, outputs, seed, log_scale):
    """Quantization, the scaled product with bias and residual, RMSNorm (alone and before quantization), the SiLU and
    the gated activation's quantization: each build's bits are the torch path's, for any shape and magnitude."""
    generator = torch.Generator().manual_seed(seed)
    x, up = (torch.randn(2, rows, inner, generator=generator) * 2.0**log_scale).unbind()  # [N, K] each
    weight = torch.rand(inner, generator=generator) + 0.5
    w = torch.randint(-127, 128, (outputs, inner), dtype=torch.int8, generator=generator)
    w_scale, bias = torch.rand(outputs, generator=generator), torch.randn(outputs, generator=generator)
    residual = torch.randn(rows, outputs, generator=generator)
    q, scale = quantize_rows(x)
    want = ((q.double() @ w.double().T).float() * scale * w_scale + bias) + residual  # [N, O]
    with native.using("none"):
        torch_path = [exact_rms_norm(x, weight, 1e-6), exact_silu(x), gated(x.clone(), up)]
    with native.using(isa):
        codes, native_scale = native.quantize(x)
        assert torch.equal(native_scale, scale) and torch.equal(codes[:, :inner], (q + 128).to(torch.uint8))
        assert torch.equal(native.linear(codes, *native.pack(w), scale, w_scale, bias, residual), want)
        assert torch.equal(native.rms_norm(x, weight, 1e-6), torch_path[0])
        assert torch.equal(torch.cat(native.norm_quantize(x, weight, 1e-6), 1),
                           torch.cat(native.quantize(torch_path[0]), 1))
        assert torch.equal(native.silu(x, EXP2_COEFFICIENTS), torch_path[1])
        assert torch.equal(torch.cat(native.quantize_gated(x, up, EXP2_COEFFICIENTS), 1),
                           torch.cat(native.quantize(torch_path[2]), 1))


@pytest.mark.parametrize("isa", BUILDS)
@settings(max_examples=20, deadline=None)
@given(
    kv_heads=st.integers(1, 2), group=st.integers(1, 3), queries=st.integers(1, 70), extra=st.integers(0, 140),
    size=st.sampled_from([5, 32, 64, 128]), seed=st.integers(0, 2**16),
)
def test_each_builds_attention_gives_the_torch_paths_bits(isa, kv_heads, group, queries, extra, size, seed):
    """The exact attention over the packed int16 cache: each build's bits are the torch path's, for GQA groups,
    partial visibility, more keys than one int32 flush of the weighted sum (64) and more queries than one block."""
    generator = torch.Generator().manual_seed(seed)
    heads, length = kv_heads * group, queries + extra
    query = torch.randn(2, heads, queries, size, generator=generator)
    key, value = (pack(torch.randn(2, kv_heads, length, size, generator=generator)) for _ in "kv")
    visible = torch.rand(2, 1, queries, length, generator=generator) < 0.8
    with native.using("none"):
        want = exact_attention(query, key, value, visible, scaling=size**-0.5)
    with native.using(isa):
        assert torch.equal(exact_attention(query, key, value, visible, scaling=size**-0.5), want)


@pytest.fixture(scope="module")
def float32_models() -> dict[str, torch.nn.Module]:
    """``kind -> tiny float32 target`` (Qwen2's projections have biases, Qwen3's heads their own norms)."""
    builders = {"llama": tiny_models.build_llama, "qwen2": tiny_models.build_qwen2, "qwen3": tiny_models.build_qwen3,
                "mistral": tiny_models.build_mistral}
    return {kind: builders[kind](seed=5).float() for kind in KINDS}


def _int8_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What quantization decided: the int8 model's tensors (smoothed norms, scales, biases) and each layer's int8
    weight, whichever layout its kernel reads."""
    state = dict(model.state_dict())
    state.update({f"{name}.int8": _int8_values(m) for name, m in model.named_modules() if isinstance(m, Int8Linear)})
    return state


def _int8_values(layer: Int8Linear) -> torch.Tensor:
    """The layer's int8 weight ``[O, K]`` recovered from whichever layout it has."""
    if layer.weight.kernel == "native":
        panels = layer.weight.tensors[0]  # [P, G, 64, 4]
        return panels.transpose(1, 2).reshape(-1, panels.shape[1] * 4)[: layer.out_features, : layer.in_features]
    if layer.weight.kernel == "int_mm":
        return layer.weight.tensors[0].T
    if layer.weight.kernel == "int_mm_split":
        high, low = layer.weight.tensors
        return (high * 2 + low).T
    raise AssertionError(f"no int8 values to compare for the {layer.weight.kernel} layout")


def _logits(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each row's logits of its own tokens: 8 prompts of 1 to 30 tokens read as a ragged batch, then decoded 1, 3 and
    1 tokens at a time; and the first row read and decoded alone."""
    rows = tiny_models.random_prompts(8, seed=11, min_len=6, max_len=36)
    prefix = [max(1, len(row) - 5) for row in rows]
    batched = ragged_forwards(model, rows, prefix, [1, 3, 1])
    return [*batched, *ragged_forwards(model, rows[:1], prefix[:1], [1, 3, 1])]


@pytest.mark.parametrize("kind", KINDS)
def test_the_int8_model_is_the_same_bits_on_every_build_and_thread_count(kind, float32_models):
    """Quantized under each build this CPU runs and under the torch path, the int8 weights and norms are the same
    bits; every build and the torch path give the same logits with 1, 2 and 16 threads."""
    threads = torch.get_num_threads()
    models = {}
    for isa in (*native.host_isas(), "none"):
        with native.using(isa):
            models[isa] = quantize_model(copy.deepcopy(float32_models[kind]))
    want_state = _int8_state(models["none"])
    for isa, model in models.items():
        state = _int8_state(model)
        assert state.keys() == want_state.keys(), isa
        assert all(torch.equal(state[name], want_state[name]) for name in state), isa
    want = None
    try:
        for isa in (*native.host_isas(), "none"):
            for count in THREADS:
                torch.set_num_threads(count)
                with native.using(isa):
                    got = _logits(models[isa])
                want = want or got
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (isa, count)
    finally:
        torch.set_num_threads(threads)


def test_torchs_own_scalar_dispatch_and_another_blas_change_nothing(tmp_path, float32_models):
    """A subprocess with torch's kernels at their scalar code (``ATEN_CPU_CAPABILITY=default``), oneDNN and MKL
    capped at AVX2 and the slowest native build this CPU runs quantizes the same saved float32 model and gives this
    process's logits bit for bit."""
    float32_models["qwen2"].save_pretrained(tmp_path / "model")
    script = (
        "import sys, torch, transformers\n"
        "sys.path.insert(0, sys.argv[3])\n"
        "from ragged import ragged_forwards\n"
        "import tiny_models\n"
        "from batchspec.exact.integer import native, quantize_model\n"
        "model = quantize_model(transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]).float())\n"
        "rows = tiny_models.random_prompts(8, seed=11, min_len=6, max_len=36)\n"
        "prefix = [max(1, len(row) - 5) for row in rows]\n"
        "torch.save({'isa': native.isa(), 'logits': ragged_forwards(model, rows, prefix, [1, 3, 1])}, sys.argv[2])\n"
    )
    slowest = native.host_isas()[-1] if native.host_isas() else "none"
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", ONEDNN_MAX_CPU_ISA="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2",
               BATCHSPEC_CPU_ISA=slowest, PYTHONPATH=os.pathsep.join(sys.path))
    out = tmp_path / "logits.pt"
    tests = os.path.dirname(__file__)
    subprocess.run([sys.executable, "-c", script, tmp_path / "model", out, tests], env=env, check=True, timeout=300)
    other = torch.load(out)
    model = quantize_model(copy.deepcopy(float32_models["qwen2"]))
    rows = tiny_models.random_prompts(8, seed=11, min_len=6, max_len=36)
    want = ragged_forwards(model, rows, [max(1, len(row) - 5) for row in rows], [1, 3, 1])
    assert other["isa"] == slowest
    assert all(torch.equal(a, b) for a, b in zip(other["logits"], want, strict=True))
