"""The int8 model's bits do not depend on the CPU: every native build this host runs (AVX-512 VNNI, AVX-VNNI, AVX2,
portable C),
the torch path without them (``BATCHSPEC_CPU_ISA=none``), torch's own scalar dispatch (``ATEN_CPU_CAPABILITY=default``)
and any thread count give the same logits.

Each build is forced with :func:`batchspec.exact.integer.native.using` (or the environment variable in a subprocess)
among
the builds this CPU runs: an AVX-512 host runs all four, an AVX2-only host the ``avx2`` and ``portable`` builds, any
other CPU ``portable``; a build the CPU lacks is skipped with its reason, never emulated.

* Kernels: each build's product, quantization, RMSNorm, SiLU and attention give the torch path's bits (hypothesis).
* Values that are not finite: a row holding a NaN or an inf quantizes to scale NaN and codes 0 in every quantizer, its
  products are NaN in every column and a query that sees such a token is NaN, the same bits on every build and the
  torch path, the finite rows beside them as they are alone.
* The floating-point environment: flush-to-zero and denormals-are-zero set on the calling thread change no bit of any
  call, with 1 and 2 threads.
* Models: tiny float32 Llama, Qwen2, Qwen3 and Mistral models quantized under each build have the same int8 weights,
  and their logits, prompts read and decoded in a ragged batch of 8 and alone, are the same bits under every build
  and with 1, 2 and 16 threads.
"""

from __future__ import annotations

import copy
import ctypes
import os
import subprocess
import sys

import pytest
import tiny_models
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ragged import ragged_forwards

from batchspec.exact.integer import int4, native, plan, quantize_model
from batchspec.exact.integer.arithmetic import (
    ACTIVATIONS,
    EXP2_COEFFICIENTS,
    exact_gelu_tanh,
    exact_silu,
    quantize_rows,
)
from batchspec.exact.integer.attention import _quantized, exact_attention, pack
from batchspec.exact.integer.linear import Int4Linear, Int8Linear, gated, quantize_activations, quantize_gated
from batchspec.exact.integer.model import exact_rms_norm

BUILDS = [pytest.param(name, marks=pytest.mark.skipif(name not in native.host_isas(), reason=f"this CPU lacks {name}"))
          for name in native.ISAS]
KINDS = ("llama", "qwen2", "qwen3", "mistral", "smollm3", "granite", "olmo2", "phi3", "glm4", "gemma3", "gemma2",
         "ministral", "qwen3_moe", "olmoe", "mixtral")
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
def test_each_builds_structs_are_the_ones_plan_mirrors(isa):
    """plan.py's ctypes structs have decoder.h's sizes and offsets as this build's compiler laid them out; a mirror
    with two fields swapped, or one field short, is refused with both offsets named."""
    with native.using(isa):
        laid_out = native.layout()
    plan.check_layout(laid_out)
    assert {kind for kind, _ in laid_out} == {mirror._c_name_ for mirror in plan.MIRRORS}

    class Swapped(ctypes.Structure):
        _c_name_ = "product_t"
        _fields_ = [(name, kind) for name, kind in plan.Product._fields_]
        _fields_[0], _fields_[1] = _fields_[1], _fields_[0]

    class Short(ctypes.Structure):
        _c_name_ = "layer_t"
        _fields_ = plan.Layer._fields_[:-1]

    with pytest.raises(RuntimeError, match="bits at 8 here, 0 in C"):
        plan.check_layout(laid_out, (Swapped,))
    with pytest.raises(RuntimeError, match=f"{plan.Layer._fields_[-1][0]} at None here"):
        plan.check_layout(laid_out, (Short,))


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
    else AVX-512 VNNI's EVEX form of the 256-bit build; nothing without F16C; the portable build on any CPU, with no
    instruction-set flags); every build pins the floating-point model, and another compiler version builds another
    library."""
    assert tuple(build.name for build in native.BUILDS) == native.ISAS
    assert all((native._SOURCES / build.source).is_file() for build in native.BUILDS)
    zen4 = frozenset({"avx2", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
    assert native._build_flags("avxvnni", zen4) == ("-mavx2", "-mavx512vl", "-mavx512vnni", "-mf16c")
    assert native._build_flags("avxvnni", frozenset({"avx2", "f16c", "avx_vnni"})) == ("-mavx2", "-mavxvnni", "-mf16c")
    assert native._build_flags("avx512vnni", frozenset({"avx2", "f16c"})) is None
    assert native._build_flags("amx", zen4) is None
    assert native._build_flags("amx", zen4 | {"amx_tile", "amx_int8"})[-2:] == ("-mamx-tile", "-mamx-int8")
    assert native._build_flags("avx2", frozenset({"avx2"})) is None
    assert native._build_flags("neon", frozenset({"fp", "asimd", "asimddp"})) == ("-march=armv8.2-a+dotprod",)
    assert native._build_flags("neon", zen4) is None and native._build_flags("neon", frozenset({"asimd"})) is None
    assert native.BUILDS[-1].name == "portable" and native._build_flags("portable", frozenset()) == ()
    monkeypatch.setattr(native, "_cpu_flags", lambda: zen4)
    _, flags, _, library = native._build_plan("avx2")
    assert {"-fno-fast-math", "-ffp-contract=off"} <= set(flags)
    monkeypatch.setattr(native, "_compiler_version", lambda name: "cc (a later release) 99.1")
    assert native._build_plan("avx2")[3] != library


def test_a_build_the_cpu_lacks_or_an_unknown_name_is_refused(monkeypatch):
    """A build is forced only among those the CPU runs (here an AVX2-only CPU, by its flags): one the CPU lacks, or
    a name that is none of them, is a ValueError naming what is possible, never an emulation. A CPU with none of the
    SIMD builds' features (any other architecture: no x86 flags) runs the portable build, first."""
    monkeypatch.setattr(native, "_cpu_flags", lambda: frozenset({"avx", "avx2", "fma", "f16c"}))
    native.host_isas.cache_clear()
    native._default.cache_clear()
    try:
        assert native.host_isas() == ("avx2", "portable")
        with pytest.raises(ValueError, match="this CPU runs avx2, portable"), native.using("avx512vnni"):
            pass
        known = "one of amx, avx512vnni, avxvnni, avx2, neon, portable, none"
        with pytest.raises(ValueError, match=known), native.using("x"):
            pass
        with pytest.raises(ValueError, match="this CPU runs avx2, portable"), native.using("neon"):
            pass
        with native.using("none"):
            assert native.isa() == "none" and not native.available()
        monkeypatch.setattr(native, "_cpu_flags", lambda: frozenset())
        native.host_isas.cache_clear()
        assert native.host_isas() == ("portable",)
        with pytest.raises(ValueError, match="this CPU runs portable"), native.using("avx2"):
            pass
    finally:
        native.host_isas.cache_clear()
        native._default.cache_clear()


AARCH64_CPUINFO = ["processor\t: 0", "BogoMIPS\t: 243.75",
                   "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc "
                   "dcpop asimddp", "CPU implementer\t: 0x41"]
X86_CPUINFO = ["processor\t: 0", "model name\t: AMD EPYC", "flags\t\t: fpu sse2 avx avx2 f16c avx512f avx512bw "
               "avx512vl avx512_vnni", "bugs\t\t: sysret_ss_attrs"]


def test_each_architecture_reads_its_own_feature_line_and_runs_only_its_own_builds(monkeypatch):
    """/proc/cpuinfo lists an x86-64 CPU's features on its ``flags`` line and an aarch64 CPU's on its ``Features``
    line: each machine reads only its own, so an aarch64 CPU with the dot product runs ``neon`` then ``portable``
    (never an x86 build), an x86-64 CPU never ``neon``, and forcing ``neon`` on x86-64 is refused as any build the
    CPU lacks is."""
    assert "asimddp" in native._features(AARCH64_CPUINFO, "aarch64")
    assert native._features(X86_CPUINFO, "aarch64") == frozenset()
    assert native._features(AARCH64_CPUINFO, "x86_64") == frozenset() == native._features(X86_CPUINFO, "riscv64")
    assert {"avx2", "avx512_vnni"} <= native._features(X86_CPUINFO, "x86_64")
    hosts = {}
    try:
        for machine, lines in (("aarch64", AARCH64_CPUINFO), ("x86_64", X86_CPUINFO)):
            flags = native._features(lines, machine)
            monkeypatch.setattr(native, "_cpu_flags", lambda flags=flags: flags)
            native.host_isas.cache_clear()
            hosts[machine] = native.host_isas()
        assert hosts == {"aarch64": ("neon", "portable"), "x86_64": ("avx512vnni", "avxvnni", "avx2", "portable")}
        with pytest.raises(ValueError, match="this CPU runs avx512vnni, avxvnni, avx2, portable"), native.using("neon"):
            pass
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
    """Quantization, the scaled product with bias and residual, RMSNorm (alone and before quantization), the SiLU, the
    GELU with tanh and the gated activations' quantization (int8 and int4's blocks): each build's bits are the torch
    path's, for any shape and magnitude."""
    generator = torch.Generator().manual_seed(seed)
    x, up = (torch.randn(2, rows, inner, generator=generator) * 2.0**log_scale).unbind()  # [N, K] each
    weight = torch.rand(inner, generator=generator) + 0.5
    w = torch.randint(-127, 128, (outputs, inner), dtype=torch.int8, generator=generator)
    w_scale, bias = torch.rand(outputs, generator=generator), torch.randn(outputs, generator=generator)
    residual = torch.randn(rows, outputs, generator=generator)
    q, scale = quantize_rows(x)
    want = ((q.double() @ w.double().T).float() * scale * w_scale + bias) + residual  # [N, O]
    with native.using("none"):
        torch_path = [exact_rms_norm(x, weight, 1e-6), exact_silu(x), gated(x.clone(), up), exact_gelu_tanh(x),
                      gated(x.clone(), up, "gelu_pytorch_tanh")]
    with native.using(isa):
        codes, native_scale = native.quantize(x)
        assert torch.equal(native_scale, scale) and torch.equal(codes[:, :inner], (q + 128).to(torch.uint8))
        assert torch.equal(native.linear(codes, *native.pack(w), scale, w_scale, bias, residual), want)
        assert torch.equal(native.rms_norm(x, weight, 1e-6), torch_path[0])
        assert torch.equal(torch.cat(native.norm_quantize(x, weight, 1e-6), 1),
                           torch.cat(native.quantize(torch_path[0]), 1))
        assert torch.equal(native.activation(x, EXP2_COEFFICIENTS, ACTIVATIONS["silu"]), torch_path[1])
        assert torch.equal(torch.cat(native.quantize_gated(x, up, EXP2_COEFFICIENTS), 1),
                           torch.cat(native.quantize(torch_path[2]), 1))
        gelu = ACTIVATIONS["gelu_pytorch_tanh"]
        assert torch.equal(native.activation(x, EXP2_COEFFICIENTS, gelu), torch_path[3])
        assert torch.equal(torch.cat(native.quantize_gated(x, up, EXP2_COEFFICIENTS, gelu), 1),
                           torch.cat(native.quantize(torch_path[4]), 1))
        for got, want in zip(native.quantize_gated_blocks(x, up, EXP2_COEFFICIENTS, 32, gelu),
                             native.quantize_blocks(torch_path[4], 32), strict=True):
            assert torch.equal(got, want)


def test_amx_is_a_build_only_where_linux_grants_the_tiles(monkeypatch):
    """A CPU listing AMX runs the ``amx`` build only where Linux grants the process the tiles' state: refused, the
    tiles' features are dropped from the CPU's flags (so ``amx`` is not a build here, and forcing it is refused), and a
    CPU without AMX is never asked."""
    spr = frozenset({"avx2", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"})
    assert not native._tiles_permitted(spr - native._TILE_FEATURES)
    monkeypatch.setattr(native, "_features", lambda lines, machine: spr)
    monkeypatch.setattr(native.platform, "system", lambda: "Linux")
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    for granted, builds in ((True, ("amx", "avx512vnni")), (False, ("avx512vnni", "avxvnni"))):
        monkeypatch.setattr(native, "_tiles_permitted", lambda flags, granted=granted: granted)
        native._cpu_flags.cache_clear()
        native.host_isas.cache_clear()
        try:
            assert native.host_isas()[:2] == builds
            if not granted:
                assert not native._cpu_flags() & native._TILE_FEATURES
                with pytest.raises(ValueError, match="this CPU runs avx512vnni, avxvnni"), native.using("amx"):
                    pass
        finally:
            native._cpu_flags.cache_clear()
            native.host_isas.cache_clear()
            native._default.cache_clear()


TILED = pytest.mark.skipif("amx" not in native.host_isas(), reason="this CPU lacks AMX-INT8 (or Linux refuses it)")


@TILED
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), tiles=st.integers(1, 5), extra=st.sampled_from([0, 4, 60]),
       widths=st.sampled_from([(64,), (1,), (150,), (64, 86), (128, 64, 3)]), seed=st.integers(0, 2**16),
       residual=st.booleans())
def test_the_tiled_product_gives_the_vector_products_bits(rows, tiles, extra, widths, seed, residual):
    """The ``amx`` build's int8 product (row blocks on AMX tiles where the inner size is whole tiles' rows of 64 codes,
    the vector kernel where it is not) gives the exact product's bits and ``avx512vnni``'s: any row count (whole tiles
    of 16 rows and a part), stacked layers' outputs (a panel's part past the last output unwritten), the bias and the
    residual, and the largest magnitudes (codes of +-127 times weights of +-127)."""
    generator = torch.Generator().manual_seed(seed)
    inner, outputs = 64 * tiles + extra, sum(widths)
    q = torch.randint(-127, 128, (rows, inner), generator=generator).float()  # [N, K]
    q[0] = 127.0
    w = torch.randint(-127, 128, (outputs, inner), dtype=torch.int8, generator=generator)  # [O, K]
    w[0] = -127
    scale, w_scale = torch.rand(rows, 1, generator=generator), torch.rand(outputs, generator=generator)
    bias = torch.randn(outputs, generator=generator)
    add = torch.randn(rows, outputs, generator=generator) if residual and len(widths) == 1 else None
    want = (q.double() @ w.double().T).float() * scale * w_scale + bias  # [N, O]
    want = want + add if add is not None else want
    codes, panels = native.codes(q), native.pack(w)
    got = {}
    for isa in ("amx", "avx512vnni"):
        with native.using(isa):
            got[isa] = torch.cat(native.linear_parts(codes, *panels, scale, w_scale, bias, widths, add), 1)
    assert torch.equal(got["amx"], want) and torch.equal(got["avx512vnni"], want)


@pytest.mark.parametrize("isa", BUILDS)
@settings(max_examples=20, deadline=None)
@given(
    kv_heads=st.integers(1, 2), group=st.integers(1, 3), queries=st.integers(1, 70), extra=st.integers(0, 140),
    size=st.sampled_from([5, 32, 64, 128]), seed=st.integers(0, 2**16), softcap=st.sampled_from([None, 0.3, 2.0]),
)
def test_each_builds_attention_gives_the_torch_paths_bits(isa, kv_heads, group, queries, extra, size, seed, softcap):
    """The exact attention over the packed int16 cache: each build's bits are the torch path's, for GQA groups,
    partial visibility (a row whose last queries see nothing and whose first keys no query sees: the native builds
    leave them out), more keys than one int32 flush of the weighted sum (64), more queries than one block, and scores
    soft-capped (Gemma 2's) or not."""
    generator = torch.Generator().manual_seed(seed)
    heads, length = kv_heads * group, queries + extra
    query = torch.randn(2, heads, queries, size, generator=generator)
    key, value = (pack(torch.randn(2, kv_heads, length, size, generator=generator)) for _ in "kv")
    visible = torch.rand(2, 1, queries, length, generator=generator) < 0.8
    visible[1, :, queries // 2 + 1 :] = False  # a ragged verification's unscored drafts: the last queries see nothing
    visible[1, :, :, : extra // 2] = False  # a short row's padding beside a long one: keys no query sees
    with native.using("none"):
        want = exact_attention(query, key, value, visible, scaling=size**-0.5, softcap=softcap)
    with native.using(isa):
        assert torch.equal(exact_attention(query, key, value, visible, scaling=size**-0.5, softcap=softcap), want)


@pytest.fixture(scope="module")
def float32_models() -> dict[str, torch.nn.Module]:
    """``kind -> tiny float32 target`` (Qwen2's projections have biases, Qwen3's heads their own norms; SmolLM3's layers
    without rotary, Granite's multipliers, OLMo 2's norms on the outputs; Phi-3's fused projections, partial rotary
    and LongRoPE, GLM-4's four norms and partial rotary over pairs)."""
    builders = {"llama": tiny_models.build_llama, "qwen2": tiny_models.build_qwen2, "qwen3": tiny_models.build_qwen3,
                "mistral": tiny_models.build_mistral, "smollm3": tiny_models.build_smollm3,
                "granite": tiny_models.build_granite, "olmo2": tiny_models.build_olmo2,
                "phi3": tiny_models.build_phi3, "glm4": tiny_models.build_glm4, "gemma3": tiny_models.build_gemma3,
                "gemma2": tiny_models.build_gemma2, "ministral": tiny_models.build_ministral,
                "qwen3_moe": tiny_models.build_qwen3_moe, "olmoe": tiny_models.build_olmoe,
                "mixtral": tiny_models.build_mixtral}
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



NAN, INF = float("nan"), float("inf")
NAN_BITS = 0x7FC00000  # float32 NaN as torch's float("nan") and C's NAN give it: every non-finite row's scale
PATHS = ("none", *native.host_isas())  # the torch path, then each build this CPU runs


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its floats as integers of their width, so that NaNs compare by their bits."""
    kinds = {torch.float32: torch.int32, torch.float64: torch.int64}
    return t.view(kinds[t.dtype]) if t.dtype in kinds else t


def _same_bits(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    pairs = zip(a, b, strict=True)
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y)) for x, y in pairs)


def _nan_bits(count: int, *shape: int) -> torch.Tensor:
    return torch.full((count, *shape), NAN_BITS, dtype=torch.int32)


def _not_finite_rows(inner: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """``[8, inner]`` float32 and its finite rows (0, 3, 7); the others hold a NaN (the first value), +inf (the last:
    a vector tail's last lane), -inf (a middle one), NaN everywhere, and +inf, -inf and NaN together."""
    x = torch.randn(8, inner, generator=torch.Generator().manual_seed(seed))
    x[1, 0], x[2, -1], x[4, inner // 2], x[5] = NAN, INF, -INF, NAN
    x[6, 0], x[6, -1], x[6, inner // 2] = INF, -INF, NAN
    return x, [0, 3, 7]


def _quantized_forms(x: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, block: int) -> dict[str, tuple]:
    """Every quantizer's result for rows ``x`` (the gate, with ``up``, for the MLP's; RMSNorm's ``weight`` for the
    fused ones) on the path in use: the torch path's functions, or the native calls that replace them. Integers held
    as floats are compared as values (``+ 0.0``: the torch path's rounding may give -0, the codes' 0)."""
    per_token, gate_rows = quantize_activations(x), quantize_gated(x, up)
    wide, wide_scale = _quantized(x)
    forms = {
        "per token": (per_token.values + 0.0, per_token.scale),
        "gated": (gate_rows.values + 0.0, gate_rows.scale),
        "15 bits": (wide + 0.0, wide_scale),
        "packed": (pack(x),),
        "blocks": int4.quantize_blocks(x, block),
    }
    if native.available():
        codes, scale = native.norm_quantize(x, weight, 1e-6)  # [N, 4 G], [N, 1]
        forms["normed"] = (codes[:, : x.shape[1]].float() - native.ZERO_POINT, scale)
        forms["normed blocks"] = native.norm_quantize_blocks(x, weight, 1e-6, block)
        forms["gated blocks"] = native.quantize_gated_blocks(x, up, EXP2_COEFFICIENTS, block)
    else:
        normed = exact_rms_norm(x, weight, 1e-6)
        values, scale = quantize_rows(normed)
        forms["normed"] = (values + 0.0, scale)
        forms["normed blocks"] = int4.quantize_blocks(normed, block)
        forms["gated blocks"] = int4.quantize_blocks(gated(x, up), block)
    return forms


@pytest.mark.parametrize("inner, block", [(5, 32), (37, 32), (300, 64)])
def test_a_row_that_is_not_finite_quantizes_to_a_nan_scale_and_zeros_on_every_build(inner, block):
    """Every quantizer (per token, the MLP's gated activation, the norm-fused ones, the attention's 15 bits and the
    KV cache's packing, the int4 product's blocks) gives a row holding a NaN, +inf or -inf scale NaN (the bits of
    torch's NaN) and codes 0, on the torch path and on each build, bit for bit; a finite row beside them gets what it
    gets alone. In blocks, only a block holding such a value is so quantized."""
    x, finite = _not_finite_rows(inner, seed=inner)
    generator = torch.Generator().manual_seed(1)
    up, weight = torch.randn(8, inner, generator=generator), torch.rand(inner, generator=generator) + 0.5
    broken = ~x.isfinite().all(1)  # [8]
    results = {}
    for path in PATHS:
        with native.using(path):
            results[path] = _quantized_forms(x, up, weight, block)
            alone = _quantized_forms(x[finite], up[finite], weight, block)
        for name, forms in results[path].items():
            assert _same_bits(forms, results["none"][name]), (path, name)
            assert _same_bits(tuple(t[finite] for t in forms), alone[name]), (path, name)
    torch_path, count = results["none"], int(broken.sum())
    for name in ("per token", "gated", "normed", "15 bits"):
        values, scale = torch_path[name]
        assert torch.equal(_bits(scale.float()[broken]), _nan_bits(count, 1)), name
        assert not values[broken].any() and scale[~broken].isfinite().all(), name
    codes, scales, _ = torch_path["blocks"]  # [8, 32 S], [8, B]
    padded = torch.nn.functional.pad(x, (0, scales.shape[1] * block - inner))  # [8, B * block]
    blocks_broken = ~padded.view(8, -1, block).isfinite().all(-1)  # [8, B]
    assert torch.equal(scales.isnan(), blocks_broken)
    assert torch.equal(_bits(scales[blocks_broken]), _nan_bits(int(blocks_broken.sum())))
    assert not codes[blocks_broken.repeat_interleave(block, 1)[:, : codes.shape[1]]].any()
    parities = torch_path["packed"][0][broken][:, : native.SCALE_BITS].int().bitwise_and(1)  # the scale's bits
    assert torch.equal(parities, ((NAN_BITS >> torch.arange(native.SCALE_BITS)) & 1).expand(count, -1))


def test_a_product_of_a_row_that_is_not_finite_is_nan_in_every_column_on_every_build():
    """NaN in, NaN out: the int8 and int4 products (bias, then a finite residual) of a row holding a NaN, +inf or
    -inf are NaN in every column, the bits of torch's NaN, on the torch path's kernels and on each build; a finite
    row beside them is its own output alone."""
    x, finite = _not_finite_rows(300, seed=3)
    broken = [row for row in range(8) if row not in finite]
    generator = torch.Generator().manual_seed(4)
    linear8 = torch.nn.Linear(300, 70)
    weight4, bias4 = int4.from_float(torch.randn(70, 300, generator=generator)), torch.randn(70, generator=generator)
    residual = torch.randn(8, 70, generator=generator)

    def outputs(layers: tuple, rows: list[int]) -> tuple[torch.Tensor, ...]:
        return tuple(
            out
            for layer in layers
            for out in (layer(x[rows]), layer.apply_to(quantize_activations(x[rows]), residual=residual[rows]))
        )

    want = None
    for path in PATHS:
        with native.using(path):
            layers = (Int8Linear(linear8), Int4Linear(weight4, bias4))
            outs, alone = outputs(layers, list(range(8))), outputs(layers, finite)
        assert _same_bits(tuple(out[finite] for out in outs), alone), path
        assert all(torch.equal(_bits(out[broken]), _nan_bits(len(broken), 70)) for out in outs), path
        want = want or outs
        assert _same_bits(outs, want), path


def test_a_query_that_sees_a_token_that_is_not_finite_is_nan_on_every_build():
    """The attention over a cache holding a key with a NaN and a value with an inf, a query with a NaN and a score
    beyond float32: a query that sees any of them, or is such a query and sees a key, is NaN in every channel (torch's
    NaN's bits); a query that sees none of them is what it is with those tokens finite (the others' keys and values
    hidden from it change nothing), and a query that sees nothing is zeros, on the torch path and on each build."""
    generator = torch.Generator().manual_seed(5)
    batch, kv_heads, group, queries, length, size = 2, 2, 2, 6, 10, 40
    heads = kv_heads * group
    query = torch.randn(batch, heads, queries, size, generator=generator)
    key, value = (torch.randn(batch, kv_heads, length, size, generator=generator) for _ in "kv")
    visible = torch.ones(queries, length, dtype=torch.bool).tril(length - queries).expand(batch, 1, -1, -1).clone()
    visible[1, 0, 0] = False  # [B, 1, Q, L]: causal, and batch row 1's first query sees nothing
    query[1, 3, 1], key[1, 1, 0] = 1e30, 1e30  # a finite query and key whose score overflows float32
    clean = (query.clone(), key.clone(), value.clone())
    key[0, 0, 6, 3], value[0, 1, 7, 0], query[0, 1, 2, 0], query[1, 0, 0, 5] = NAN, INF, NAN, NAN
    bad = ~torch.stack([key.isfinite().all(-1), value.isfinite().all(-1)]).all(0)  # [B, Hk, L]
    seen = visible[:, 0]  # [B, Q, L]
    nan_rows = (seen[:, None] & bad[:, torch.arange(heads) // group, None, :]).any(-1)  # [B, H, Q]
    nan_rows |= ~query.isfinite().all(-1) & seen.any(-1)[:, None]
    nan_rows[1, 3, 1] = True
    nan_rows = nan_rows.transpose(1, 2)  # [B, Q, H]
    with native.using("none"):
        reference = exact_attention(clean[0], pack(clean[1]), pack(clean[2]), visible, scaling=size**-0.5)
    want = None
    for path in PATHS:
        with native.using(path):
            out = exact_attention(query, pack(key), pack(value), visible, scaling=size**-0.5)  # [B, Q, H, D]
        assert torch.equal(_bits(out[nan_rows]), _nan_bits(int(nan_rows.sum()), size)), path
        assert torch.equal(out[~nan_rows], reference[~nan_rows]) and not out[1, 0].any(), path
        want = out if want is None else want
        assert torch.equal(_bits(out), _bits(want)), path


def _subnormal_inputs() -> dict[str, torch.Tensor]:
    """Inputs whose values, or the native calls' intermediates on them, are subnormal (nonzero below 2**-126), made
    before any flushing (torch's own operations flush too)."""
    generator = torch.Generator().manual_seed(6)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    tiny = normal(6, 70) * 1e-39  # [6, 70]: subnormal values
    weight4 = int4.from_float(normal(40, 70))
    codes4, scales4, sums4 = native.quantize_blocks(normal(6, 70), weight4.block)
    angles = normal(1, 3, 8)
    return {
        "tiny": tiny,
        "negative": -tiny.abs(),
        "small": normal(6, 70) * 1e-21,  # [6, 70]: squares subnormal
        "weight": torch.rand(70, generator=generator) + 0.5,
        "codes": native.quantize(normal(6, 70))[0],
        "w": torch.randint(-127, 128, (40, 70), dtype=torch.int8, generator=generator),
        "row scale": torch.full((6, 1), 1e-30),
        "col scale": torch.rand(40, generator=generator) * 1e-9,
        "bias": tiny[0, :40].contiguous(),
        "residual": tiny[:, :40].contiguous(),
        "packed4": weight4.packed(),
        "subs": torch.tensor(weight4.subs),
        "codes4": codes4,
        "scales4": scales4 * 1e-41,  # subnormal activation scales
        "sums4": sums4,
        "q": normal(1, 3, 2, 8) * 1e-39,
        "k": normal(1, 3, 1, 8) * 1e-39,
        "v": normal(1, 3, 1, 8) * 1e-39,
        "cos": angles.cos(),
        "sin": angles.sin(),
        "query": normal(1, 2, 3, 40),
        "keys": native.pack_kv(normal(1, 1, 9, 40) * 4.0, 32767, 40),
        "values": native.pack_kv(normal(1, 1, 9, 40) * 1e-39, 32767, 40),  # a = e * sv subnormal
    }


def _every_call_on(t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each native call on :func:`_subnormal_inputs` (no torch arithmetic around them)."""
    c = EXP2_COEFFICIENTS
    tiny, small, weight = t["tiny"], t["small"], t["weight"]
    out = [
        *native.quantize(tiny),
        *native.quantize_wide(tiny, 32767),
        *native.quantize_blocks(tiny, 64),
        native.pack_kv(tiny, 32767, 70),
        native.rms_norm(small, weight, 0.0),
        *native.norm_quantize(small, weight, 0.0),
        *native.norm_quantize_blocks(small, weight, 0.0, 32),
        native.activation(tiny, c, ACTIVATIONS["silu"]),
        native.activation(tiny, c, ACTIVATIONS["gelu_pytorch_tanh"]),
        *native.quantize_gated(tiny, small, c, ACTIVATIONS["gelu_pytorch_tanh"]),
        *native.quantize_gated(tiny, small, c),
        *native.quantize_gated_blocks(tiny, small, c, 32),
        native.exp2_nonpositive_(t["negative"].clone(), c),
        native.linear(t["codes"], *native.pack(t["w"]), t["row scale"], t["col scale"], t["bias"], t["residual"]),
        native.linear4((t["codes4"], t["scales4"], t["sums4"]), t["packed4"], 70, int(t["subs"]), 40, t["bias"])[0],
    ]
    query, keys, values = torch.empty(1, 2, 3, 8), *(torch.zeros(1, 1, 3, 32, dtype=torch.int16) for _ in "kv")
    native.rotary_into(t["q"], t["k"], t["v"], t["cos"], t["sin"], query, keys, values, 32767)
    partial = torch.empty(1, 2, 3, 8), *(torch.zeros(1, 1, 3, 32, dtype=torch.int16) for _ in "kv")  # GLM-4's
    native.rotary_into(t["q"], t["k"], t["v"], t["cos"][..., :6].contiguous(), t["sin"][..., :6].contiguous(), *partial,
                       32767, pairs=True)
    visible = torch.ones(1, 1, 3, 9, dtype=torch.bool)
    attended = native.attention(t["query"], t["keys"], t["values"], visible, 0.16, 32767, c)
    return [*out, query, keys, values, *partial, attended]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", BUILDS)
def test_flushing_subnormals_on_the_calling_thread_changes_no_bit(isa, threads):
    """``torch.set_flush_denormal(True)`` sets flush-to-zero and denormals-are-zero on the calling thread only: every
    native call computes under its own fixed floating-point environment on each of its threads (the caller and
    OpenMP's workers), so its results with subnormal values and intermediates are the same bits with it on as off,
    with 1 and 2 threads, and the caller's own setting is back after each call."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with native.using(isa):
            inputs = _subnormal_inputs()
            want = _every_call_on(inputs)
            if not torch.set_flush_denormal(True):
                pytest.skip("this CPU has no flush-to-zero setting for torch to set")
            try:
                got = _every_call_on(inputs)
                flushed = (torch.tensor([1e-39]) * 1.0).item() == 0.0
            finally:
                torch.set_flush_denormal(False)
    finally:
        torch.set_num_threads(previous)
    assert flushed
    assert len(got) == len(want) and all(_same_bits((a,), (b,)) for a, b in zip(got, want, strict=True))
