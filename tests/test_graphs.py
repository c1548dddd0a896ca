"""Static-mode forwards, the shape CUDA graphs capture (``batchspec.engine.graphs``).

* On the CPU the static mode runs eagerly (``graphs="eager"``): it writes the KV at columns held in a tensor and
  attends over the cache's whole capacity, with the mask and positions built from tensors. Every decode forward of
  a round goes through it, and the tokens are the reference's (greedy: transformers' ``generate`` on each prompt
  alone; sampling: the same seeded samples as without the static mode), in every method and proposer.
* The static mode masks whatever lies past a row's length: a cache whose spare capacity holds garbage gives the
  same logits.
* On CUDA (skipped elsewhere): captured graphs give the tokens of the eager forwards, and are captured once per
  storage, batch size and width.
"""

from __future__ import annotations

import pytest
import tiny_models
import torch

from batchspec.engine.core import Engine
from batchspec.engine.graphs import GraphedForwards, graph_mode
from batchspec.engine.kv_cache import BatchKVCache, Slab
from batchspec.engine.runner import ModelRunner
from batchspec.engine.state import BatchState, HostColumns

CONFIGS = [
    ("autoregressive", None, 0.0),
    ("eqspec", "draft", 0.0),
    ("eqspec", "hybrid", 0.0),
    ("exspec", "ngram", 0.0),
    ("exspec", "hybrid", 0.0),
    ("eqspec", "draft", 1.0),
    ("exspec", "hybrid", 0.8),
]
PROMPTS = [[5, 9, 5, 9, 17, 5, 9] * 3, [3, 4, 5, 9, 5, 9, 17], [11, 12, 13, 14, 15, 16, 17, 18], [7, 8]]


def _generate(bs, target, draft, method, proposer, temperature, graphs, monkeypatch):
    """Generate with the engine's runner in ``graphs`` mode; returns the sequences, the forwards that ran in static
    mode and the graphs captured."""
    init, runners, static = Engine.__init__, [], []
    forward = GraphedForwards._static_forward

    def configured(engine, *args, **kwargs):
        init(engine, *args, **kwargs)
        engine.runner = ModelRunner(engine.device, graphs=graphs)
        runners.append(engine.runner)

    def counted(self, *args, **kwargs):
        static.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "__init__", configured)
    monkeypatch.setattr(GraphedForwards, "_static_forward", counted)
    options = dict(method=method, proposer=proposer, batch_size=3, max_new_tokens=16, temperature=temperature)
    options.update(seed=3, eos_token_id=[], num_draft_tokens=3)
    use = None if proposer in (None, "ngram") else draft
    sequences = bs.generate(target, use, PROMPTS, **options).sequences
    monkeypatch.undo()
    captured = sum(runner.graphs.captured for runner in runners if runner.graphs is not None)
    return sequences, len(static), captured


@pytest.mark.parametrize(("method", "proposer", "temperature"), CONFIGS)
def test_static_mode_gives_the_reference_tokens(method, proposer, temperature, bs, llama, reference, monkeypatch):
    target, draft = llama.target, llama.drafts["perturbed"]
    static, forwards, _ = _generate(bs, target, draft, method, proposer, temperature, "eager", monkeypatch)
    assert forwards > 0, "no decode forward ran in static mode"
    if temperature == 0:
        assert static == [reference(target, p, 16, []) for p in PROMPTS]
    else:
        plain, none, _ = _generate(bs, target, draft, method, proposer, temperature, "off", monkeypatch)
        assert none == 0 and static == plain


def test_static_mode_masks_the_spare_capacity():
    """Rows padded by 0 and 3 read 9 columns; then a 2-column forward in static mode gives the ordinary forward's
    logits (float64, to rounding), also when the capacity past the length holds garbage."""
    model = tiny_models.build_llama(seed=5).double()
    pad = [0, 3]
    tokens = torch.randint(0, tiny_models.VOCAB_SIZE, (2, 11), generator=torch.Generator().manual_seed(0))
    host = HostColumns(pad=pad, content=[11 - p for p in pad], draft_cached=[0, 0])
    results = []
    for runner, garbage in ((ModelRunner(torch.device("cpu")), False), (ModelRunner("cpu", graphs="eager"), True)):
        cache = BatchKVCache.for_model(model)
        batch = BatchState([], torch.tensor(pad), torch.tensor(host.content), Slab(tokens, cache, None), None, host)
        runner.logits(model, batch, cache, tokens[:, :9], keep=1)
        if garbage:
            cache.storage[..., 9:, :] = 1e6
        assert runner.graphs is None or runner.graphs.handles(cache, 11, 2)
        results.append(runner.logits(model, batch, cache, tokens[:, 9:], keep=2))
        assert cache.length == 11
    torch.testing.assert_close(results[1], results[0], rtol=1e-12, atol=1e-12)


def test_cuda_graphs_setting(bs, llama):
    """``cuda_graphs="on"`` needs a CUDA device (a clear error otherwise); ``"auto"`` captures on CUDA only."""
    options = dict(method="autoregressive", max_new_tokens=2, eos_token_id=[])
    with pytest.raises(ValueError, match="needs the models on a CUDA device"):
        bs.generate(llama.target, None, PROMPTS, cuda_graphs="on", **options)
    with pytest.raises(ValueError, match="cuda_graphs must be one of auto, on, off"):
        bs.generate(llama.target, None, PROMPTS, cuda_graphs="yes", **options)
    assert graph_mode("auto", torch.device("cuda")) == "on"
    assert graph_mode("auto", torch.device("cpu")) == "off"
    assert graph_mode("off", torch.device("cuda")) == "off"
    assert graph_mode("on", torch.device("cuda:1")) == "on"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("method", "proposer", "temperature"), CONFIGS)
def test_cuda_graphs_give_the_eager_tokens(method, proposer, temperature, bs, monkeypatch):
    target = tiny_models.build_llama(seed=0).to("cuda", torch.float32)
    draft = tiny_models.build_llama(seed=1).to("cuda", torch.float32)
    eager, _, _ = _generate(bs, target, draft, method, proposer, temperature, "eager", monkeypatch)
    graphed, _, captured = _generate(bs, target, draft, method, proposer, temperature, "on", monkeypatch)
    assert graphed == eager
    if method == "autoregressive":  # rows in lockstep: their storage lasts, and its graphs replay
        assert captured > 0
