"""The model runner: staging, the round's one device→host read, the attention mask it builds, and the device.

* Worked examples of :meth:`ModelRunner.stage` and :meth:`ModelRunner.fetch`.
* The 4D mask the runner builds gives the logits transformers' own 2D-mask path gives, bit for bit (float64,
  padded rows, one and several query columns), for the sdpa and eager attention implementations.
* Every decode round reads the device once (counted with :class:`host_reads.HostReads`: on a GPU each read is a
  synchronisation), in every method and proposer, greedy and sampling, and the output stays the reference's.
* On CUDA (skipped elsewhere): synchronisations per round counted by torch itself, and float32 equivalence.
"""

from __future__ import annotations

import warnings

import pytest
import tiny_models
import torch
from host_reads import HostReads

from batchspec.engine.core import Engine
from batchspec.engine.errors import InvariantError
from batchspec.engine.kv_cache import BatchKVCache, Slab
from batchspec.engine.proposers import draft as draft_proposer
from batchspec.engine.proposers.draft import DraftModelProposer
from batchspec.engine.runner import Floats, ModelRunner
from batchspec.engine.state import BatchState, HostColumns

CPU = ModelRunner(torch.device("cpu"))
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_stage_worked_example():
    ints, matrix, floats = CPU.stage([0, 2], [[5, 6], [7, 8]], Floats([0.5, 1e-300]))
    assert ints.tolist() == [0, 2] and ints.dtype == torch.long
    assert matrix.tolist() == [[5, 6], [7, 8]]
    assert floats.dtype == torch.float64 and floats.tolist() == [0.5, 1e-300]  # the bits travel unchanged


def test_stage_refuses_ragged_matrices():
    with pytest.raises(InvariantError, match="rectangular"):
        CPU.stage([[1, 2], [3]])


def test_fetch_worked_example():
    assert CPU.fetch(torch.tensor([1, 0]), torch.tensor([[7, 8], [9, 4]])) == [[1, 7, 8], [0, 9, 4]]


def _batch(pad: list[int], width: int, cache: BatchKVCache) -> BatchState:
    size = len(pad)
    content = [width - p for p in pad]
    host = HostColumns(pad=pad, content=content, draft_cached=[0] * size)
    tokens = torch.zeros((size, width), dtype=torch.long)
    return BatchState([], torch.tensor(pad), torch.tensor(content), Slab(tokens, cache, None), torch.zeros(size), host)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_mask_gives_transformers_own_logits(implementation):
    """Prefill 9 columns of rows padded by 0, 3 and 6, then decode 1 and then 4 columns: at every real query the
    runner's logits equal those of the same forward with transformers' 2D padding mask, bit for bit, and are finite
    (eager attention in transformers itself gives NaN at real queries of padded rows: its padding queries see no key,
    a row of ``-inf``, and their keys and values are NaN in the layers after; the runner's padding sees every key).
    Every real query's logits also match each row's own unpadded forward, to float32's rounding."""
    model = tiny_models.build_llama(seed=5)
    model.set_attn_implementation(implementation)
    pad = [0, 3, 6]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, tiny_models.VOCAB_SIZE, (3, 14), generator=generator)
    ours, theirs = BatchKVCache.for_model(model), BatchKVCache.for_model(model)
    batch = _batch(pad, 14, ours)
    chunks = []
    for start, end in ((0, 9), (9, 10), (10, 14)):
        columns = tokens[:, start:end]
        mine = CPU.logits(model, batch, ours, columns, keep=end - start)  # [3, q, V]
        chunks.append(mine)
        reference = model(
            input_ids=columns,
            attention_mask=batch.attention_mask(end),
            position_ids=batch.position_ids(start, end),
            past_key_values=theirs,
            use_cache=True,
            logits_to_keep=end - start,
        ).logits
        for i, p in enumerate(pad):
            real = slice(max(0, p - start), None)  # queries on padding columns attend to nothing: not compared
            assert torch.isfinite(mine[i, real]).all()
            finite = torch.isfinite(reference[i, real])  # [q', V]
            torch.testing.assert_close(mine[i, real][finite], reference[i, real][finite], rtol=0, atol=0)
    logits = torch.cat(chunks, dim=1)  # [3, 14, V]
    for i, p in enumerate(pad):
        alone = model(input_ids=tokens[i : i + 1, p:]).logits[0]  # [14 - p, V]: the row without padding
        torch.testing.assert_close(logits[i, p:], alone, rtol=1e-4, atol=1e-4)


CONFIGS = [
    ("autoregressive", None, 0.0),
    ("eqspec", "draft", 0.0),
    ("eqspec", "hybrid", 0.0),
    ("exspec", "ngram", 0.0),
    ("eqspec", "draft", 1.0),
    ("exspec", "hybrid", 0.8),
    ("eqspec", "ngram", 1.0),
]


@pytest.mark.parametrize(("method", "proposer", "temperature"), CONFIGS)
def test_one_device_read_per_round(method, proposer, temperature, bs, llama, reference, monkeypatch):
    """Each decode round copies its inputs to the device once and reads the device back once (its verdict),
    whatever the method, proposer or sampling, with the runner's GPU policy (``free_reads`` off: the hybrid
    proposer's lookups after a model-drafted token stay on the device)."""
    reads, rounds = HostReads(), []
    decode = Engine.decode

    def counted(engine, rows, **options):
        rounds.append(len(rows))
        engine.runner.free_reads = False
        with reads:
            decode(engine, rows, **options)

    monkeypatch.setattr(Engine, "decode", counted)
    base = [5, 9, 5, 9, 17, 5, 9]
    prompts = [base * 3, [3, 4] + base * 2, [11, 12, 13, 14, 15, 16, 17, 18]]
    draft = None if proposer in (None, "ngram") else llama.drafts["perturbed"]
    options = dict(method=method, batch_size=2, max_new_tokens=14, temperature=temperature, seed=3)
    options.update(proposer=proposer, eos_token_id=[], num_draft_tokens=3)
    result = bs.generate(llama.target, draft, prompts, **options)
    fetches = sum(n for where, n in reads.where.items() if where.startswith("runner.py"))
    assert rounds and fetches == len(rounds) == reads.count, dict(reads.where)
    assert reads.copies == len(rounds)  # one host→device copy a round: everything it needs, staged at once
    if temperature == 0:
        assert result.sequences == [reference(llama.target, p, 14, []) for p in prompts]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_hybrid_reads_lookup_hits_only_where_reads_are_free(temperature, bs, llama, monkeypatch):
    """With ``free_reads`` (the CPU) the hybrid proposer reads its device lookups' hits and skips the draft forwards
    they make unnecessary; without (a GPU) it runs them. The tokens are the same either way. (A greedy row's lookup
    past a model draft is taken at a suffix of one token here, as a sampling row's is, so that every row finds one:
    which suffix counts is :func:`test_proposers.test_a_lookup_past_a_draft_models_draft_must_copy`'s subject.)"""
    monkeypatch.setattr(draft_proposer, "PAST_MODEL_NGRAM", 1)
    forwards, free = [], [True]
    decode, step = Engine.decode, DraftModelProposer._model_step

    def configured(engine, rows, **options):
        engine.runner.free_reads = free[0]
        decode(engine, rows, **options)

    def counted(proposer, *args, **kwargs):
        forwards[-1] += 1
        return step(proposer, *args, **kwargs)

    monkeypatch.setattr(Engine, "decode", configured)
    monkeypatch.setattr(DraftModelProposer, "_model_step", counted)
    base = [5, 9, 5, 9, 17, 5, 9]
    prompts = [base * 3, [3, 4] + base * 2, [11, 12, 13, 14, 15, 16, 17, 18]]
    options = dict(method="eqspec", proposer="hybrid", batch_size=3, max_new_tokens=24, temperature=temperature)
    options.update(seed=3, eos_token_id=[], num_draft_tokens=4)
    results = []
    for free_reads in (True, False):
        free[0] = free_reads
        forwards.append(0)
        results.append(bs.generate(llama.target, llama.drafts["perturbed"], prompts, **options).sequences)
    assert results[0] == results[1]
    assert forwards[0] < forwards[1], forwards


@CUDA
@pytest.mark.parametrize(("method", "proposer", "temperature"), CONFIGS)
def test_cuda_syncs_per_round(method, proposer, temperature, bs, reference, monkeypatch):
    """On CUDA, torch's own sync detector counts at most two synchronisations per decode round (the verdict's read
    and the stage timer's), and greedy float32 output equals transformers' generate."""
    target = tiny_models.build_llama(seed=0).to("cuda", torch.float32)
    draft = tiny_models.build_llama(seed=1).to("cuda", torch.float32)
    rounds: list[int] = []
    decode = Engine.decode

    def counted(engine, rows, **options):
        rounds.append(len(rows))
        decode(engine, rows, **options)

    monkeypatch.setattr(Engine, "decode", counted)
    prompts = [[5, 9, 5, 9, 17] * 3, [3, 4, 5, 9, 5, 9], [11, 12, 13, 14, 15, 16]]
    use = None if proposer in (None, "ngram") else draft
    options = dict(method=method, batch_size=2, max_new_tokens=12, temperature=temperature, seed=3)
    options.update(proposer=proposer, eos_token_id=[], num_draft_tokens=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = bs.generate(target, use, prompts, **options)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    prefill_reads = 2 * len(prompts) + 2  # each prompt reading waits once per model, plus the draft's catch-ups
    assert len(syncs) <= 2 * len(rounds) + prefill_reads, len(syncs)  # per round: the verdict and the timer
    if temperature == 0:
        assert result.sequences == [reference(target, p, 12, []) for p in prompts]
