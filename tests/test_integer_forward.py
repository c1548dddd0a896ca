"""The int8 model's own forward (:mod:`batchspec.exact.integer.forward`) against transformers' forward of the same
model.

* Its fused native calls give the bits of the torch code they replace (rotary embedding and KV packing, norm then
  quantization, products with a residual, stacked products).
* The forward gives transformers' forward's logits and KV cache bit for bit: ragged, left-padded batches, prefill
  then forwards of 1..5 tokens, on every supported family, with q/k/v and gate/up stacked and not.
* The runner takes it for float32 int8 models, and batchspec's output through it equals the model's own ``generate``.
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import tiny_models
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb as glm4_rotary
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rotary

from batchspec.engine.kv_cache import BatchKVCache
from batchspec.engine.runner import ModelRunner, as_mask, cache_keyword
from batchspec.engine.state import BatchState, visible_keys
from batchspec.exact.integer import native, quantize_model
from batchspec.exact.integer.arithmetic import ACTIVATIONS, EXP2_COEFFICIENTS
from batchspec.exact.integer.attention import QKV_LEVELS, pack, packed_width
from batchspec.exact.integer.forward import UNREACHED, IntegerForward, integer_forward
from batchspec.exact.integer.int4 import Int4Weight, from_float
from batchspec.exact.integer.linear import Int4Stack, Int8Stack, gated, quantize_gated
from batchspec.exact.integer.model import exact_rms_norm
from batchspec.exact.integer.moe import forward_bytes
from batchspec.families import sliding_visible

pytestmark = pytest.mark.skipif(not native.available(), reason="this CPU or machine does not run the native kernels")

KINDS = ("llama", "qwen2", "qwen3", "mistral", "smollm3", "granite", "olmo2", "phi3", "glm4", "gemma3", "gemma2",
         "ministral", "qwen3_moe", "olmoe", "mixtral")
# widths that are multiples of the kernel's 64-output panel, so q/k/v and gate/up stack (head size 32, 2 KV heads)
STACKABLE = {"hidden_size": 128, "intermediate_size": 192}


BUILDERS = {"llama": tiny_models.build_llama, "qwen2": tiny_models.build_qwen2, "qwen3": tiny_models.build_qwen3,
            "mistral": tiny_models.build_mistral, "smollm3": tiny_models.build_smollm3,
            "granite": tiny_models.build_granite, "olmo2": tiny_models.build_olmo2, "phi3": tiny_models.build_phi3,
            "glm4": tiny_models.build_glm4, "gemma3": tiny_models.build_gemma3,
            "gemma2": tiny_models.build_gemma2, "ministral": tiny_models.build_ministral,
            "qwen3_moe": tiny_models.build_qwen3_moe, "olmoe": tiny_models.build_olmoe,
            "mixtral": tiny_models.build_mixtral,
            "mistral-window": lambda seed, **kw: tiny_models.build_mistral(seed, sliding_window=7, **kw),
            "phi3-window": lambda seed, **kw: tiny_models.build_phi3(seed, sliding_window=7, **kw)}


@pytest.fixture(scope="module")
def models() -> dict[tuple[str, bool], torch.nn.Module]:
    """``(kind, stackable) -> float32 int8 model``: the tiny targets (48 wide: nothing stacks) and 128-wide ones."""
    out = {}
    for kind in KINDS:
        for stackable in (False, True):
            model = BUILDERS[kind](seed=3, **(STACKABLE if stackable else {})).float()
            out[kind, stackable] = quantize_model(model)
    return out


def _mixed_source(model: torch.nn.Module):
    """A source of int4 weights that leaves layer 0's v and down projections int8, as a GGUF file's 6-bit tensors
    are: that layer's q, k, v and its gate, up, down then read their inputs in both forms."""

    def int4(name: str) -> Int4Weight | None:
        if name.endswith(("v_proj", "down_proj")) and ".0." in name:
            return None
        return from_float(model.get_submodule(name).weight)

    return SimpleNamespace(int4=int4, embedding=lambda *_: None)


@pytest.fixture(scope="module")
def int4_models() -> dict[tuple[str, bool], torch.nn.Module]:
    """``(kind, mixed) -> float32 int4 model``: every layer int4, or layer 0's v and down int8 (:func:`_mixed_source`),
    320 wide so a super-block ends partway."""
    out = {}
    for kind in KINDS:
        for mixed in (False, True):
            model = BUILDERS[kind](seed=3, hidden_size=320, intermediate_size=160).float()
            out[kind, mixed] = quantize_model(model, width="int4", source=_mixed_source(model) if mixed else None)
    return out


# ------------------------------------------------------------------------------------------------ fused calls


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 3), seq=st.integers(1, 5), kv_heads=st.integers(1, 3), group=st.integers(1, 3),
       size=st.sampled_from([2, 6, 16, 64]), part=st.floats(0.0, 1.0), pairs=st.booleans(),
       seed=st.integers(0, 2**16))
def test_rotary_into_gives_transformers_rotation_and_the_caches_packing(batch, seq, kv_heads, group, size, part,
                                                                        pairs, seed):
    """Every head's first ``rotated`` values turned (partial rotary: the rest pass through), over halves as Phi-3's
    ``apply_rotary_pos_emb`` turns them (a Llama's where all turn) or over adjacent pairs as GLM-4's does."""
    generator = torch.Generator().manual_seed(seed)
    heads, rotated = kv_heads * group, max(2, 2 * round(part * size / 2))
    q, k, v = (torch.randn(batch, seq, h, size, generator=generator) * 3 for h in (heads, kv_heads, kv_heads))
    cos, sin = (torch.randn(batch, seq, rotated, generator=generator) for _ in range(2))
    width = packed_width(size)
    store = torch.zeros(2, batch, kv_heads, seq + 3, width, dtype=torch.int16)  # [2, B, Hk, C, W], strided writes
    query = torch.empty(batch, heads, seq, size)
    native.rotary_into(q, k, v, cos, sin, query, store[0, :, :, 2 : 2 + seq], store[1, :, :, 2 : 2 + seq], QKV_LEVELS,
                       pairs)
    rotation = glm4_rotary if pairs else phi3_rotary
    want_q, want_k = rotation(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, H, S, D] each
    if rotated == size and not pairs:
        assert all(torch.equal(a, b) for a, b in zip((want_q, want_k), apply_rotary_pos_emb(
            q.transpose(1, 2), k.transpose(1, 2), cos, sin), strict=True))
    assert torch.equal(query, want_q)
    assert torch.equal(store[0, :, :, 2 : 2 + seq], pack(want_k))
    assert torch.equal(store[1, :, :, 2 : 2 + seq], pack(v.transpose(1, 2)))
    assert not store[:, :, :, :2].any() and not store[:, :, :, 2 + seq :].any()


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), size=st.integers(1, 300), seed=st.integers(0, 2**16), log_scale=st.integers(-8, 8))
def test_norm_quantize_is_the_quantization_of_the_norm(rows, size, seed, log_scale):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, size, generator=generator) * 2.0**log_scale
    weight = torch.rand(size, generator=generator) + 0.5
    codes, scale = native.norm_quantize(x, weight, 1e-6)
    want_codes, want_scale = native.quantize(exact_rms_norm(x, weight, 1e-6))
    assert torch.equal(codes, want_codes) and torch.equal(scale, want_scale)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), size=st.integers(1, 300), seed=st.integers(0, 2**16), log_scale=st.integers(-8, 8))
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_the_gated_product_is_quantized_as_if_written_out(activation, rows, size, seed, log_scale):
    """The MLP's ``act(gate) * up`` (SiLU, GELU with tanh) quantized in one pass: the codes and scales of quantizing
    the written product."""
    generator = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(2, rows, size, generator=generator) * 2.0**log_scale).unbind()
    want_codes, want_scale = native.quantize(gated(gate.clone(), up, activation).view(rows, size))
    got = quantize_gated(gate.clone().view(1, rows, size), up.view(1, rows, size), activation)
    assert torch.equal(got.codes("native"), want_codes) and torch.equal(got.scale, want_scale)
    assert got.shape == (1, rows) and got.inner == size
    kind = ACTIVATIONS[activation]
    fused_codes, fused_scale = native.quantize_gated(gate.view(rows, size), up.view(rows, size), EXP2_COEFFICIENTS,
                                                     kind)
    written = native.activation(gate.view(rows, size), EXP2_COEFFICIENTS, kind) * up.view(rows, size)  # [N, K]
    codes, scale = native.quantize(written)
    assert torch.equal(fused_codes, codes) and torch.equal(fused_scale, scale)
    with pytest.raises(ValueError, match="twice"):
        native.quantize_gated(gate, up[:, :-1], EXP2_COEFFICIENTS)
    with pytest.raises(ValueError, match="ten coefficients"):
        native.quantize_gated(gate, up, EXP2_COEFFICIENTS[:9])


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 7), inner=st.integers(1, 130), widths=st.lists(st.integers(1, 3), min_size=1, max_size=3),
       tail=st.integers(1, 70), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_stacked_products_and_the_residual_give_each_layers_bits(rows, inner, widths, tail, bias, seed):
    """Parts of 64·n outputs and a last part of any width, in one pass, equal each part's own product; a
    residual added in the kernel equals torch's ``residual + y``."""
    generator = torch.Generator().manual_seed(seed)
    sizes = [64 * n for n in widths[:-1]] + [tail]
    weight = torch.randint(-127, 128, (sum(sizes), inner), dtype=torch.int8, generator=generator)
    codes = native.codes(torch.randint(-127, 128, (rows, inner), generator=generator).float())
    row_scale = torch.rand(rows, 1, generator=generator) + 0.5
    col_scale = torch.rand(sum(sizes), generator=generator) + 0.5
    shift = torch.randn(sum(sizes), generator=generator) if bias else None
    parts = native.linear_parts(codes, *native.pack(weight), row_scale, col_scale, shift, tuple(sizes))
    start = 0
    for part, size in zip(parts, sizes, strict=True):
        piece = slice(start, start + size)
        alone = native.linear(codes, *native.pack(weight[piece]), row_scale, col_scale[piece],
                              None if shift is None else shift[piece])
        assert torch.equal(part, alone)
        start += size
    residual = torch.randn(rows, sum(sizes), generator=generator)
    whole = native.linear(codes, *native.pack(weight), row_scale, col_scale, shift, residual)
    assert torch.equal(whole, residual + torch.cat(parts, dim=1))


def test_fused_calls_refuse_what_does_not_fit():
    weight = torch.randint(-127, 128, (130, 8), dtype=torch.int8)
    codes, one = native.codes(torch.zeros(2, 8)), torch.ones(2, 1)
    with pytest.raises(ValueError, match="do not fit"):
        native.linear_parts(codes, *native.pack(weight), one, torch.ones(130), None, (100, 30))  # 100: not 64 n
    with pytest.raises(ValueError, match="do not fit"):
        native.linear_parts(codes, *native.pack(weight), one, torch.ones(130), None, (64, 66), torch.zeros(2, 130))
    q = torch.zeros(1, 1, 2, 8)
    with pytest.raises(ValueError, match="do not fit"):
        native.rotary_into(q, q, q, torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), torch.empty(1, 2, 1, 8),
                           torch.empty(1, 2, 1, 11, dtype=torch.int16), torch.empty(1, 2, 1, 12, dtype=torch.int16),
                           QKV_LEVELS)


# ------------------------------------------------------------------------------------------------ the forward


def test_stacks_where_widths_allow_and_the_layers_read_views_of_them(models):
    plain, stacked = integer_forward(models["qwen2", False]), integer_forward(models["qwen2", True])
    assert all(isinstance(layer.qkv, list) and isinstance(layer.gate_up, list) for layer in plain.layers)
    for layer, module in zip(stacked.layers, models["qwen2", True].model.layers, strict=True):
        assert isinstance(layer.qkv, Int8Stack) and isinstance(layer.gate_up, Int8Stack)
        panels = layer.qkv.tensors[0]
        for projection in (module.self_attn.q_proj, module.self_attn.k_proj, module.self_attn.v_proj):
            own = projection.weight.tensors[0]
            assert own.untyped_storage().data_ptr() == panels.untyped_storage().data_ptr()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.parametrize("variant", ["int8", "int8 stacked", "int4", "int4 mixed"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_forward_gives_transformers_logits_and_cache_bit_for_bit(kind, variant, models, int4_models, data):
    """A left-padded batch: a prefill, then forwards of 1..5 tokens, each run by :class:`IntegerForward` into one
    cache and by the model's own forward into another; the logits of every position that sees a key and both caches'
    contents past each row's padding are equal. (Padding is not read: its logits are zeros.)
    Int8 models with q/k/v and gate/up stacked and not; int4 models, all int4 or with int8 layers beside."""
    width, extra = variant.split()[0], " " in variant
    model = models[kind, extra] if width == "int8" else int4_models[kind, extra]
    batch = data.draw(st.integers(1, 4), label="batch")
    pad = torch.tensor(data.draw(st.lists(st.integers(0, 6), min_size=batch, max_size=batch), label="pad"))
    stops = [int(pad.max()) + data.draw(st.integers(1, 70), label="prefill")]
    for _ in range(data.draw(st.integers(1, 4), label="forwards")):
        stops.append(stops[-1] + data.draw(st.integers(1, 5), label="step"))
    _same_as_transformers(model, pad, stops, data.draw(st.integers(0, 2**16), label="seed"))


@pytest.mark.parametrize("variant", ["int8", "int8 stacked", "int4", "int4 mixed"])
def test_a_long_prompt_is_attended_in_blocks_of_queries_with_the_same_bits(variant, models, int4_models):
    """A prefill of 150 queries (three blocks of QUERY_CHUNK, each over the keys it can see), beside a row padded by
    5, then a forward of 3: Qwen3's layout (its per-head norms), int8 and int4, stacked and not."""
    width, extra = variant.split()[0], " " in variant
    model = models["qwen3", extra] if width == "int8" else int4_models["qwen3", extra]
    _same_as_transformers(model, torch.tensor([0, 5]), [155, 158], seed=11)


def _same_as_transformers(model: torch.nn.Module, pad: torch.Tensor, stops: list[int], seed: int) -> None:
    """Forwards of ``model``'s :class:`IntegerForward` and of its own forward into two caches, rows left-padded by
    ``pad`` ``[B]``, each forward reading the columns up to the next of ``stops``: equal logits at every position
    that sees a key, equal caches past each row's padding."""
    forward, batch = IntegerForward.of(model), pad.shape[0]
    ids = torch.randint(0, model.config.vocab_size, (batch, stops[-1]), generator=torch.Generator().manual_seed(seed))
    ours, theirs = BatchKVCache.for_model(model), BatchKVCache.for_model(model)
    start = 0
    with torch.no_grad():
        for stop in stops:
            keys, queries = torch.arange(stop), torch.arange(start, stop)
            visible = ((keys[None, :] <= queries[:, None])[None] & (keys[None, None, :] >= pad[:, None, None]))[:, None]
            positions = (queries[None] - pad[:, None]).clamp(min=0)
            got = forward.logits(ids[:, start:stop], positions, visible, ours, stop - start)
            want = model(ids[:, start:stop], attention_mask=as_mask(model, visible), position_ids=positions,
                         **{cache_keyword(model): theirs}, use_cache=True, logits_to_keep=stop - start).logits
            read = visible.any(-1)[:, 0]  # [B, S]: the positions that see a key
            assert torch.equal(got[read], want[read])
            assert (got[~read] == 0).all()
            assert ours.length == theirs.length == stop
            for row, left in enumerate(pad.tolist()):  # [layers, 2, B, Hk, C, W]
                assert torch.equal(ours.storage[:, :, row, :, left:stop], theirs.storage[:, :, row, :, left:stop])
            start = stop


@pytest.mark.parametrize("variant", ["int8", "int4"])
def test_a_ragged_verification_scores_each_rows_own_drafts_with_the_same_bits(variant, models, int4_models):
    """Rows fed 1, 3, 5 and 2 of five inputs (``fed``, as the engine verifies rows proposing 0, 2, 4 and 1 drafts): the
    runner leaves the rest out of the forward, and every input a row needs gets the logits and KV of the forward
    that scores all five, bit for bit; the inputs left out get zero logits. The output layer runs on 11 rows, not 20."""
    model = models["qwen2", True] if variant == "int8" else int4_models["qwen2", False]
    ids = torch.randint(0, model.config.vocab_size, (4, 14), generator=torch.Generator().manual_seed(5))  # [B, 14]
    fed = torch.tensor([1, 3, 5, 2])
    runner, head = ModelRunner(torch.device("cpu")), integer_forward(model).head
    caches, logits = [], []
    with torch.no_grad():
        for rows in (None, fed):
            cache = BatchKVCache.for_model(model)
            batch = BatchState.dense(ids, cache)
            runner.read(model, batch, cache, ids[:, :9])
            seen = []
            with _rows_of(head, seen):
                logits.append(runner.logits(model, batch, cache, ids[:, 9:], keep=5, fed=rows))  # [B, 5, V]
            caches.append(cache)
    assert seen == [11]
    needed = torch.arange(5)[None, :] < fed[:, None]  # [B, 5]
    assert torch.equal(logits[1][needed], logits[0][needed]) and (logits[1][~needed] == 0).all()
    for row, n in enumerate(fed.tolist()):  # [layers, 2, B, Hk, C, W]
        assert torch.equal(caches[1].storage[:, :, row, :, : 9 + n], caches[0].storage[:, :, row, :, : 9 + n])


@pytest.mark.parametrize("vocabulary", [1, 64, 100, 10**6])
def test_a_drafts_vocabulary_gives_the_first_logits_bits_and_reads_their_panels_only(vocabulary, models, monkeypatch):
    """``vocabulary``: the first ids' logits are the whole output layer's bits, the others far below any logit; the
    product reads the panels that hold them (a partial panel whole), and a vocabulary past the model's is all of it."""
    model = models["qwen2", True]
    ids = torch.randint(0, model.config.vocab_size, (3, 6), generator=torch.Generator().manual_seed(2))  # [B, 6]
    runner, size = ModelRunner(torch.device("cpu")), model.config.vocab_size
    logits, read = [], []
    linear = native.linear
    monkeypatch.setattr(native, "linear", lambda codes, panels, *rest: read.append(panels.shape[0]) or linear(
        codes, panels, *rest))
    with torch.no_grad():
        for limit in (0, vocabulary):
            cache = BatchKVCache.for_model(model)
            logits.append(runner.logits(model, BatchState.dense(ids, cache), cache, ids, keep=2, vocabulary=limit))
    n = min(vocabulary, size)
    panels = -(-size // native.PANEL)
    assert read == [panels, min(panels, -(-vocabulary // native.PANEL))]  # the output layer's products, in order
    assert torch.equal(logits[1][..., :n], logits[0][..., :n])
    assert (logits[1][..., n:] == UNREACHED).all() and logits[0].min() > UNREACHED / 1e20


@contextmanager
def _rows_of(module: torch.nn.Module, seen: list[int]):
    """Record the rows of every input ``module`` is called on."""
    handle = module.register_forward_pre_hook(lambda _, args: seen.append(args[0].numel() // args[0].shape[-1]))
    try:
        yield
    finally:
        handle.remove()


def test_int4_layers_stack_where_all_three_are_int4(int4_models):
    """q, k, v and gate, up of an all-int4 layer run as one stacked product each; where one of them is int8 (layer 0
    of the mixed model) they run one by one, reading one input quantized both ways."""
    stacked = integer_forward(int4_models["qwen2", False])
    assert all(isinstance(layer.qkv, Int4Stack) and isinstance(layer.gate_up, Int4Stack) for layer in stacked.layers)
    mixed = integer_forward(int4_models["qwen2", True])
    assert isinstance(mixed.layers[0].qkv, list) and isinstance(mixed.layers[1].qkv, Int4Stack)
    assert isinstance(mixed.layers[0].gate_up, Int4Stack)  # down is the int8 one there


def test_read_fills_the_cache_as_logits_does(models):
    model = models["llama", True]
    forward = integer_forward(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    keys = torch.arange(9)
    visible = (keys[None, :] <= keys[:, None]).expand(2, 1, 9, 9)
    positions = keys.expand(2, 9)
    read, scored = BatchKVCache.for_model(model), BatchKVCache.for_model(model)
    forward.read(ids, positions, visible, read)
    forward.logits(ids, positions, visible, scored, 1)
    assert read.length == scored.length == 9 and torch.equal(read.storage, scored.storage)


def test_only_float32_int8_models_take_it(models, bundles):
    assert integer_forward(models["mistral", False]) is not None
    assert IntegerForward.of(copy.deepcopy(bundles["llama"].target).float()) is None  # not quantized
    assert IntegerForward.of(quantize_model(copy.deepcopy(bundles["llama"].target))) is None  # float64
    lopsided = copy.deepcopy(models["qwen3", False])
    del lopsided.model.layers[1].self_attn.k_norm  # a q norm without a k norm: not a layout it runs
    assert IntegerForward.of(lopsided) is None and IntegerForward.of(copy.deepcopy(models["qwen3", False])) is not None


def test_threads_that_meet_a_new_model_share_one_forward_made_once(monkeypatch):
    """Two servers over one model (CI caught it: a round failed on a view of 48 values as [4, 5, -1, 12]): making the
    forward restacks the model's weights, so the second thread waits for the first's and runs on it."""
    model = quantize_model(BUILDERS["qwen2"](seed=5, **STACKABLE).float())
    made, make = [], IntegerForward.of.__func__

    def slow(cls, target):
        made.append(target)
        time.sleep(0.2)  # long enough that, unlocked, the other thread finds no forward and makes its own
        return make(cls, target)

    monkeypatch.setattr(IntegerForward, "of", classmethod(slow))
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(integer_forward, [model, model])
    assert first is not None and first is second and made == [model]


def test_the_sliding_layers_mask_is_the_windowed_one_of_each_rows_own_columns():
    """Gemma 3's sliding layers see the mask every-layer windows give (:func:`visible_keys` with the window), made from
    the full layers' mask alone: left-padded rows, queries that see nothing (a ragged verification's), and the
    capacity-wide masks of the static mode, whose queries do not sit at the last columns."""
    pad = torch.tensor([0, 3, 5])
    for queries, width in ((torch.arange(0, 9), 9), (torch.arange(6, 9), 9), (torch.arange(4, 7), 12)):
        full = visible_keys(queries, pad, width)  # [3, 1, q, width]
        for window in (1, 2, 4, 20):
            assert torch.equal(sliding_visible(full, window), visible_keys(queries, pad, width, window))
        assert sliding_visible(full, None) is full
    unseen = visible_keys(torch.arange(6, 9), pad, 9) & torch.tensor([True, False, True])[None, None, :, None]
    assert torch.equal(sliding_visible(unseen, 2), visible_keys(torch.arange(6, 9), pad, 9, 2) & unseen)


@pytest.mark.parametrize("kind", ["smollm3", "granite", "olmo2", "mistral-window", "phi3", "phi3-window", "glm4",
                                  "gemma3", "gemma2", "ministral", "qwen3_moe", "olmoe", "mixtral"])
@pytest.mark.parametrize("width", ["int8", "int4"])
def test_each_familys_batched_output_is_its_own_generate(kind, width, bs, reference):
    """A family whose layers depart from a Llama's (batchspec.families: SmolLM3's layers without a rotary embedding,
    Granite's multipliers, OLMo 2's norms on the outputs and over whole projections, Mistral's and Phi-3's sliding
    window of 7 over prompts of up to 24 tokens, Phi-3's fused projections, partial rotary and LongRoPE's short
    factors, GLM-4's four norms, biases and partial rotary over pairs, Gemma 3's sliding and full layers, window 4,
    GELU and 1 + w norms, Gemma 2's besides with its scores capped at 3 and its logits at 1, Ministral's sliding and
    full layers; Qwen3-MoE's, OLMoE's and Mixtral's mixtures of experts, a dense layer among Qwen3-MoE's, Mixtral's
    window of 7) runs on the fused forward,
    and EqSpec with a perturbed draft of its own family gives each prompt the model's own greedy output (transformers
    building its own sliding-window mask), in int8 and int4."""
    target = quantize_model(BUILDERS[kind](seed=5, **STACKABLE).float(), width=width)
    draft = quantize_model(tiny_models.perturbed_copy(BUILDERS[kind](seed=5, **STACKABLE), 0.1, seed=6).float(),
                           width=width)
    prompts = tiny_models.random_prompts(5, seed=9, max_len=24)
    result = bs.generate(target, draft, prompts, method="eqspec", proposer="hybrid", batch_size=3, max_new_tokens=12,
                         num_draft_tokens=3, check_invariants=True)
    assert integer_forward(target) is not None and integer_forward(draft) is not None
    assert result.sequences == [reference(target, prompt, 12, None) for prompt in prompts]


@pytest.mark.parametrize("method, proposer, vocabulary", [
    ("eqspec", "draft", 0), ("eqspec", "draft", 40), ("exspec", "hybrid", 0), ("autoregressive", None, 0)])
def test_batchspec_through_it_equals_the_models_own_generate(method, proposer, vocabulary, models, bs, reference):
    """The output is the model's own greedy output, whichever draft: one proposing among the first 40 of 96 ids too."""
    target = models["qwen3", True]
    draft = tiny_models.perturbed_copy(tiny_models.build_qwen3(seed=3, **STACKABLE), 0.1, seed=4)
    draft = quantize_model(draft.float())
    prompts = tiny_models.random_prompts(6, seed=8, max_len=30)
    result = bs.generate(target, draft, prompts, method=method, proposer=proposer, batch_size=4, max_new_tokens=16,
                         num_draft_tokens=3, check_invariants=True, draft_vocabulary=vocabulary)
    assert integer_forward(target) is not None and integer_forward(draft) is not None
    assert result.sequences == [reference(target, prompt, 16, None) for prompt in prompts]


@pytest.mark.parametrize("width", ["int8", "int4"])
def test_a_routers_ties_go_to_the_lower_experts_on_both_forwards(width):
    """Qwen3-MoE with its first layer's router weight zero: every expert's probability is the same, so each row's
    two experts are 0 and 1 (the lower indices), on the fused forward and transformers' alike, bit for bit."""
    float_model = tiny_models.build_qwen3_moe(seed=3, hidden_size=64).float()
    float_model.model.layers[0].mlp.gate.weight.zero_()
    model = quantize_model(float_model, width=width)
    _same_as_transformers(model, torch.tensor([0, 3]), [9, 10, 13], seed=2)
    assert model.model.layers[0].mlp.touched.tolist() == [True, True] + [False] * 4


@pytest.mark.parametrize("kind", ["qwen3_moe", "olmoe", "mixtral"])
def test_the_fused_forward_records_the_experts_it_ran_as_transformers_does(kind, models):
    """After a fused forward of a prefill and of a 4-token verification, each sparse block's ``touched`` is the
    experts transformers' forward of the same tokens ran, and :func:`forward_bytes` counts the same bytes."""
    model = models[kind, False]
    blocks = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "touched")]
    forward, ours, theirs = IntegerForward.of(model), BatchKVCache.for_model(model), BatchKVCache.for_model(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for start, stop in ((0, 5), (5, 9)):
            keys, queries = torch.arange(stop), torch.arange(start, stop)
            visible = (keys[None, :] <= queries[:, None])[None, None].expand(2, 1, -1, -1)
            positions = queries[None].expand(2, -1)
            forward.logits(ids[:, start:stop], positions, visible, ours, stop - start)
            fused, read = [block.touched.clone() for block in blocks], forward_bytes(model)
            model(ids[:, start:stop], attention_mask=as_mask(model, visible), position_ids=positions,
                  **{cache_keyword(model): theirs}, use_cache=True)
            assert [block.touched.tolist() for block in blocks] == [ran.tolist() for ran in fused]
            assert forward_bytes(model) == read
