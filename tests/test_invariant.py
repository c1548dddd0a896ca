"""The batch-invariant mode (``batchspec.invariant``): Triton kernels whose result for a row cannot depend on the batch.

With a CPU build of torch the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by ``conftest.py``
before triton is first imported), in float32; on a GPU the same tests run the compiled kernels.

* Each kernel against a float64 reference (close), and the attention's edges (padding, GQA, a query that sees no
  key).
* The properties: a matrix product's row is the same bits alone and among other rows; a tiny model's rows (left
  padded, of different lengths, in forwards of 1..5 new tokens) give exactly the logits each gets alone, one token
  at a time (hypothesis).
* Through batchspec: greedy speculative output equals the mode's own one-prompt decoding.
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
from ragged import alone_one_token_at_a_time, ragged_forwards  # noqa: E402

from batchspec.invariant import batch_invariant, check_batch_invariant, make_batch_invariant  # noqa: E402
from batchspec.invariant.kernels import attention, matmul, rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def invariant_models() -> dict[str, torch.nn.Module]:
    builders = {"llama": tiny_models.build_llama, "qwen2": tiny_models.build_qwen2}
    return {kind: make_batch_invariant(build(seed=0).to(DEVICE, torch.float32)) for kind, build in builders.items()}


def test_kernels_match_float64_references():
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


@settings(max_examples=10, deadline=None, derandomize=True, database=None)
@given(rows=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_a_matmul_row_is_the_same_bits_alone(rows, seed):
    generator = torch.Generator().manual_seed(seed)
    x, w = torch.randn((rows, 40), generator=generator), torch.randn((24, 40), generator=generator)
    together = matmul(x.to(DEVICE), w.to(DEVICE))
    assert torch.equal(together[-1:], matmul(x[-1:].to(DEVICE), w.to(DEVICE)))


@settings(max_examples=4, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_every_row_is_bit_identical_to_itself_alone(kind, invariant_models, data):
    """Rows of different lengths, left-padded, in forwards of 1..5 new tokens, give each row exactly the logits it
    gets alone, one token at a time (plain float32 on the CPU differs in the last bits)."""
    model = invariant_models[kind].cpu() if DEVICE == "cpu" else invariant_models[kind]
    batch = data.draw(st.integers(1, 3), label="batch")
    lengths = data.draw(st.lists(st.integers(2, 10), min_size=batch, max_size=batch), label="lengths")
    prefix = [data.draw(st.integers(1, n - 1), label="prefix") for n in lengths]
    steps = []
    while sum(steps) < max(n - p for n, p in zip(lengths, prefix, strict=True)):
        steps.append(data.draw(st.integers(1, 5), label="step"))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    rows = [torch.randint(0, model.config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    for row, got in zip(rows, ragged_forwards(model, rows, prefix, steps), strict=True):
        assert torch.equal(got, alone_one_token_at_a_time(model, row))


def test_speculative_output_is_the_modes_own(invariant_models, bs, reference):
    target = invariant_models["llama"]
    draft = make_batch_invariant(tiny_models.build_llama(seed=1).to(DEVICE, torch.float32))
    prompts = [[5, 9, 5, 9, 17, 5, 9, 5], [3, 4, 5]]
    options = dict(method="eqspec", proposer="hybrid", batch_size=2, max_new_tokens=6, eos_token_id=[])
    result = bs.generate(target, draft, prompts, num_draft_tokens=3, **options)
    assert result.sequences == [reference(target, p, 6, []) for p in prompts]


def test_the_mode_names_what_it_supports(bundles):
    assert batch_invariant(make_batch_invariant(tiny_models.build_llama(seed=2)))
    assert not batch_invariant(tiny_models.build_llama(seed=2))
    model = tiny_models.build_llama(seed=2)
    model.config.model_type = "gpt2"
    with pytest.raises(ValueError, match="supports llama, qwen2, qwen3, mistral models; got model_type 'gpt2'"):
        check_batch_invariant(model)
