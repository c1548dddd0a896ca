"""The batch-invariant mode (``batchspec.exact.invariant``): Triton kernels whose result for a row cannot depend on the
batch.

With a CPU build of torch the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by ``conftest.py``
before triton is first imported), in float32; on a GPU the same tests run the compiled kernels.

* Each kernel against a float64 reference (close), and the attention's edges (padding, GQA, a query that sees no
  key).
* What the kernels fix, on inputs whose block dots are exact, so that the bits are the kernels' own on any device
  and any host BLAS (in the interpreter ``tl.dot`` is numpy's matmul, whose last bits for a row can depend on its
  place in the tile): the matrix product adds its K blocks in order without a split; a row left-padded in a batch
  reads its key blocks as it does alone (hypothesis).
* On CUDA, on random inputs: a matrix product's row is the same bits alone and among other rows; a tiny model's rows
  (left padded, of different lengths, in forwards of 1..5 new tokens) give exactly the logits each gets alone, one
  token at a time (in the interpreter: within float32 rounding, which checks the mask, positions and cache).
* Through batchspec: greedy speculative output equals the mode's own one-prompt decoding; ``--cuda-graphs on``
  refuses the mode's models.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device, and Triton's interpreter is off", allow_module_level=True)
pytest.importorskip("triton", reason="the batch-invariant kernels need triton")

import tiny_models  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from ragged import alone_one_token_at_a_time, draw_ragged, ragged_forwards  # noqa: E402

from batchspec.engine.graphs import graph_mode  # noqa: E402
from batchspec.exact.invariant import batch_invariant, check_batch_invariant, make_batch_invariant  # noqa: E402
from batchspec.exact.invariant.kernels import KEY_BLOCK, MATMUL_TILES, attention, matmul, rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def invariant_models() -> dict[str, torch.nn.Module]:
    builders = {"llama": tiny_models.build_llama, "qwen2": tiny_models.build_qwen2}
    return {kind: make_batch_invariant(build(seed=0).to(DEVICE, torch.float32)) for kind, build in builders.items()}


def test_packing_match_float64_references():
    generator = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(shape, generator=generator).to(DEVICE) for shape in ((7, 50), (33, 50), (33,)))
    expected = x.double() @ w.double().T + b.double()
    torch.testing.assert_close(matmul(x, w, b).double(), expected, rtol=1e-5, atol=1e-5)
    h, g = (torch.randn(shape, generator=generator).to(DEVICE) for shape in ((5, 48), (48,)))
    normed = g.double() * h.double() / torch.sqrt((h.double() ** 2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm(h, g, 1e-6).double(), normed, rtol=1e-5, atol=1e-5)


def test_attention_matches_softmax_attention_and_sees_padding_as_nothing():
    """Two rows padded by 0 and 5 over 40 keys (two key blocks), 3 queries, 4 heads sharing 2 key-value heads; a
    fourth query on row 1's padding sees nothing and outputs zeros."""
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(shape, generator=generator).to(DEVICE)
               for shape in ((2, 4, 4, 12), (2, 2, 40, 12), (2, 2, 40, 12)))
    keys, columns = torch.arange(40, device=DEVICE), torch.tensor([2, 37, 38, 39], device=DEVICE)
    pad = torch.tensor([0, 5], device=DEVICE)
    visible = ((keys[None, None, :] <= columns[None, :, None]) & (keys[None, None, :] >= pad[:, None, None]))[:, None]
    got = attention(q, k, v, visible, 12**-0.5)  # [2, 4, 4, 12]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1), attn_mask=visible,
        scale=12**-0.5,
    ).transpose(1, 2)
    torch.testing.assert_close(got[:, 1:].double(), expected[:, 1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0, 0].double(), expected[0, 0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1, 0], torch.zeros_like(got[1, 0])), "a query on padding sees no key"


def one_term_per_block(rows: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[rows, k]`` and ``w`` ``[n, k]`` whose K blocks (of :data:`MATMUL_TILES`' width) each hold one nonzero
    product per output element: every row of ``x`` has one nonzero entry per block, a small integer, and ``w``'s
    integers are scaled by a power of two chosen per block between 2^-30 and 2^30. A block's dot is then one exact
    product however a device orders its terms (zeros add exactly), while adding the blocks together rounds."""
    generator = torch.Generator().manual_seed(seed)
    block = MATMUL_TILES[2]
    x = torch.zeros((rows, k))
    for start in range(0, k, block):
        width = min(block, k - start)
        place = start + torch.randint(0, width, (rows,), generator=generator)  # [rows]
        x[torch.arange(rows), place] = torch.randint(1, 8, (rows,), generator=generator).float()
    exponents = torch.randint(-30, 31, (-(-k // block),), generator=generator)  # [blocks]
    scale = torch.exp2(exponents.float()).repeat_interleave(block)[:k]  # [k]
    w = torch.randint(-7, 8, (n, k), generator=generator).float() * scale
    return x, w


def sum_of_blocks(x: torch.Tensor, w: torch.Tensor, order: list[slice]) -> torch.Tensor:
    """``x @ w.T`` in float32, adding each K block's exact dot (float64, then float32: exact for
    :func:`one_term_per_block`'s inputs) to the running sum in ``order``."""
    total = torch.zeros((x.shape[0], w.shape[0]))
    for part in order:
        total = total + (x[:, part].double() @ w[:, part].double().T).float()
    return total


@settings(max_examples=8, deadline=None, derandomize=True, database=None)
@given(rows=st.integers(1, 70), k=st.integers(33, 160), seed=st.integers(0, 2**16))
def test_matmul_adds_its_k_blocks_in_order(rows, k, seed):
    """What the matmul kernel fixes: K blocks of width ``BLOCK_K``, added in order into one running sum, rows that
    never mix. Each block's dot is exact here, so that order determines the result bit for bit on any device and
    any host BLAS (in Triton's interpreter ``tl.dot`` is numpy's matmul), and each row alone gets the same bits."""
    x, w = one_term_per_block(rows, k, 24, seed)
    block = MATMUL_TILES[2]
    in_order = sum_of_blocks(x, w, [slice(start, start + block) for start in range(0, k, block)])  # [rows, 24]
    assert torch.equal(matmul(x.to(DEVICE), w.to(DEVICE)).cpu(), in_order)
    assert torch.equal(matmul(x[-1:].to(DEVICE), w.to(DEVICE)).cpu(), in_order[-1:])


def test_matmul_rounds_as_its_block_order_says():
    """Three K blocks whose dots are 2^24, 1 and 1: added in order, each 1 is lost to rounding (2^24 + 1 rounds to
    even), so the kernel must give 2^24; reversed, or split in two sums (2^24, then 1 + 1), they give 2^24 + 2."""
    block = MATMUL_TILES[2]
    x = torch.zeros((1, 3 * block))
    x[0, [0, block, 2 * block]] = 1.0
    w = torch.zeros((1, 3 * block))
    w[0, [0, block, 2 * block]] = torch.tensor([2.0**24, 1.0, 1.0])
    assert matmul(x.to(DEVICE), w.to(DEVICE)).item() == 2.0**24
    assert (torch.tensor(1.0) + torch.tensor(1.0) + torch.tensor(2.0**24)).item() == 2.0**24 + 2


@pytest.mark.skipif(DEVICE != "cuda", reason="in Triton's interpreter tl.dot is the host BLAS's matmul, whose last "
                    "bits for a row may depend on its place in the tile; test_matmul_adds_its_k_blocks_in_order "
                    "checks the kernel's own order on any host")
@settings(max_examples=10, deadline=None, derandomize=True, database=None)
@given(rows=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_a_matmul_row_is_the_same_bits_alone_on_random_inputs(rows, seed):
    """The compiled kernel's matrix unit: a row's bits do not depend on its place in a tile (random inputs)."""
    generator = torch.Generator().manual_seed(seed)
    x, w = torch.randn((rows, 40), generator=generator), torch.randn((24, 40), generator=generator)
    together = matmul(x.to(DEVICE), w.to(DEVICE))
    assert torch.equal(together[-1:], matmul(x[-1:].to(DEVICE), w.to(DEVICE)))


def one_key_per_block(batch: int, heads: int, keys: int, size: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Queries, keys and values ``[batch, heads, ·, size]`` for the attention kernel whose dots are exact whatever
    the order of their terms: queries and keys small multiples of 1/4 (scores exact), and in each block of
    :data:`KEY_BLOCK` keys each value dimension nonzero for at most one key (``size >= KEY_BLOCK``), so a block's
    weighted sum of values is one rounded product per element."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-4, 5, (batch, heads, 1, size), generator=generator).float() / 4
    k = torch.randint(-4, 5, (batch, heads, keys, size), generator=generator).float() / 4
    v = torch.zeros((batch, heads, keys, size))
    columns = torch.arange(keys)
    v[:, :, columns, columns % size] = torch.randn((batch, heads, keys), generator=generator)
    return q, k, v


@settings(max_examples=6, deadline=None, derandomize=True, database=None)
@given(lengths=st.lists(st.integers(1, 100), min_size=2, max_size=3), seed=st.integers(0, 2**16))
def test_attention_row_padded_in_a_batch_is_the_same_bits_alone(lengths, seed):
    """Key blocks anchored at each row's first real key: a row left-padded in a batch reads its keys in the same
    blocks as alone, and the padding's blocks count exactly nothing. The dots are exact (:func:`one_key_per_block`),
    so the bits are the kernel's online softmax alone, on any host."""
    width, size = max(lengths), KEY_BLOCK
    q, k, v = one_key_per_block(len(lengths), 2, width, size, seed)  # keys of the widest row; shorter rows padded
    pad = torch.tensor([width - n for n in lengths])
    keys = torch.arange(width)
    visible = (keys[None, None, :] >= pad[:, None, None])[:, None]  # [B, 1, 1, width]
    together = attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), visible.to(DEVICE), size**-0.5).cpu()
    for i, n in enumerate(lengths):
        own_keys, own_values = k[i : i + 1, :, width - n :], v[i : i + 1, :, width - n :]  # [1, heads, n, size]
        ones = torch.ones((1, 1, 1, n), dtype=torch.bool)
        inputs = (q[i : i + 1], own_keys.contiguous(), own_values.contiguous(), ones)
        alone = attention(*(t.to(DEVICE) for t in inputs), size**-0.5).cpu()  # [1, 1, heads, size]
        assert torch.equal(together[i], alone[0])


@settings(max_examples=1 if DEVICE == "cpu" else 4, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_every_row_is_itself_alone(kind, invariant_models, data):
    """Rows of different lengths, left-padded, in forwards of 1..5 new tokens, give each row the logits it gets
    alone, one token at a time: bit for bit on CUDA (plain float32 there differs in the last bits); in Triton's
    interpreter, where the last bits of ``tl.dot`` are the host BLAS's, within float32 rounding (the mask, the
    positions and the cache reach every kernel as they should)."""
    model = invariant_models[kind].cpu() if DEVICE == "cpu" else invariant_models[kind]
    rows, prefix, steps = draw_ragged(data, model.config.vocab_size, max_batch=3, max_length=10)
    for row, got in zip(rows, ragged_forwards(model, rows, prefix, steps), strict=True):
        alone = alone_one_token_at_a_time(model, row)
        if DEVICE == "cuda":
            assert torch.equal(got, alone)
        else:
            torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)


def test_speculative_output_is_the_modes_own(invariant_models, bs, reference):
    target = invariant_models["llama"]
    draft = make_batch_invariant(tiny_models.build_llama(seed=1, num_hidden_layers=1).to(DEVICE, torch.float32))
    prompts = [[5, 9, 5, 9, 17, 5, 9, 5], [3, 4, 5]]
    options = dict(method="eqspec", proposer="hybrid", batch_size=2, max_new_tokens=4, eos_token_id=[])
    result = bs.generate(target, draft, prompts, num_draft_tokens=3, **options)
    assert result.sequences == [reference(target, p, 4, []) for p in prompts]


def test_the_mode_names_what_it_supports(bundles):
    assert batch_invariant(make_batch_invariant(tiny_models.build_llama(seed=2)))
    assert not batch_invariant(tiny_models.build_llama(seed=2))
    model = tiny_models.build_llama(seed=2)
    model.config.model_type = "gpt2"
    with pytest.raises(ValueError, match="supports llama, qwen2, qwen3, mistral models; got model_type 'gpt2'"):
        check_batch_invariant(model)


def test_cuda_graphs_on_refuses_a_batch_invariant_model(invariant_models):
    """Graphs capture sdpa and eager attention only: ``on`` says so for a batch-invariant model instead of running it
    ungraphed; ``auto`` graphs what it can (its forwards run as they come)."""
    model, plain = invariant_models["llama"], tiny_models.build_llama(seed=2)
    with pytest.raises(ValueError, match="this one runs 'batchspec_invariant'.*use --cuda-graphs auto or off"):
        graph_mode("on", torch.device("cuda"), (plain, model))
    assert graph_mode("on", torch.device("cuda"), (plain,)) == "on"
    assert graph_mode("auto", torch.device("cuda"), (model,)) == "on"
