"""What a load holds: a checkpoint's tensors read one at a time, the float weights widened a layer at a time, the
allocator's freed memory given back, and a 7B-shape model's int8 load within 1.3x of what it holds (large)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models
import torch
from fabricated import tiny_tokenizer

from batchspec import memory
from batchspec.exact.integer import native
from batchspec.models import loading
from batchspec.models.checkpoint import CheckpointReader, widen_model

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture(scope="module")
def bfloat16_checkpoint(tmp_path_factory):
    """A tiny Llama saved in bfloat16 with a tied output layer (stored once, as the embedding)."""
    directory = tmp_path_factory.mktemp("bf16")
    model = tiny_models.build_llama(seed=3, tie_word_embeddings=True).to(torch.bfloat16)
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory, model


def test_the_reader_gives_each_tensor_as_the_file_holds_it(bfloat16_checkpoint):
    directory, model = bfloat16_checkpoint
    reader = CheckpointReader(directory)
    state = model.state_dict()
    for name in ("model.layers.0.mlp.up_proj.weight", "model.norm.weight", "model.embed_tokens.weight"):
        read = reader.fresh(name, state[name])
        assert read.dtype == torch.bfloat16 and torch.equal(read, state[name])
        assert read.untyped_storage().data_ptr() != state[name].untyped_storage().data_ptr()
        part = reader.fresh(name, state[name], slice(1, 3))  # rows 1 and 2 alone, read from their place in the file
        assert torch.equal(part, state[name][1:3]) and part.untyped_storage().nbytes() == state[name][1:3].nbytes
    head = reader.fresh("lm_head.weight", model.lm_head.weight)  # stored once, under its twin's name
    assert torch.equal(head, model.model.embed_tokens.weight)
    unknown = torch.zeros(3)
    assert reader.fresh("not.in.the.files", unknown) is unknown


def test_widening_a_layer_at_a_time_gives_the_float32_model(bfloat16_checkpoint):
    """widen_model (what a float32 load does with a bf16 checkpoint) gives the logits of the model widened whole,
    its linear layers swapped as they are widened."""
    directory, model = bfloat16_checkpoint
    whole = tiny_models.build_llama(seed=3, tie_word_embeddings=True).to(torch.bfloat16).float()
    held = tiny_models.build_llama(seed=3, tie_word_embeddings=True).to(torch.bfloat16)
    swapped = []
    widen_model(held, torch.float32, CheckpointReader(directory).fresh, lambda linear: swapped.append(1) or linear)
    assert all(p.dtype == torch.float32 for p in held.parameters())
    assert len(swapped) == sum(isinstance(m, torch.nn.Linear) for m in whole.modules())
    ids = torch.tensor([tiny_models.random_prompts(1, seed=2, min_len=7, max_len=7)[0]])
    with torch.no_grad():
        assert torch.equal(held(ids).logits, whole(ids).logits)


def test_a_float32_load_of_a_bfloat16_checkpoint_holds_float32_weights(bfloat16_checkpoint):
    directory, model = bfloat16_checkpoint
    loaded, _ = loading.load_model(str(directory), quantize="none", kernels="default", progress=False)
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    assert torch.equal(loaded.model.layers[1].mlp.down_proj.weight, model.model.layers[1].mlp.down_proj.weight.float())


def test_the_load_gives_back_what_it_freed(monkeypatch):
    """Within returned_when_freed the mmap threshold is fixed at LOAD_BLOCK_BYTES; after it the heap is trimmed and
    the threshold is KEEP_BYTES where keep_freed_memory ran."""
    calls = []

    class Libc:
        def mallopt(self, parameter, value):
            calls.append(("mallopt", parameter, value))
            return 1

        def malloc_trim(self, pad):
            calls.append(("trim", pad))
            return 1

    monkeypatch.setattr(memory, "_libc", Libc)
    with memory.returned_when_freed():
        assert calls == [("mallopt", memory._M_MMAP_THRESHOLD, memory.LOAD_BLOCK_BYTES)]
    kept = memory.KEEP_BYTES if memory.keep_freed_memory.cache_info().currsize else memory.LOAD_BLOCK_BYTES
    assert calls[1:] == [("mallopt", memory._M_MMAP_THRESHOLD, kept), ("trim", 0)]


@pytest.mark.skipif(not os.environ.get("BATCHSPEC_LARGE_TESTS"),
                    reason="writes a 15 GB 7B-shape checkpoint and loads it in int8 (about 5 minutes); set "
                           "BATCHSPEC_LARGE_TESTS=1 to run it")
def test_a_7b_shape_model_loads_in_int8_within_1_3_times_what_it_holds(tmp_path):
    tokenizer = loading.obtain_preset("qwen2.5-coder", loading.default_cache_dir(), False).target_dir
    script = str(SCRIPTS / "memory_7b.py")
    subprocess.run([sys.executable, script, "write", str(tmp_path), "--tokenizer-from", str(tokenizer)], check=True)
    run = subprocess.run([sys.executable, script, "load", str(tmp_path)], check=True, capture_output=True, text=True)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert 7.5 < result["held_gb"] < 9.0
    assert result["peak_over_held"] <= 1.3, result


def test_the_forwards_memory_goes_back_once_the_last_row_finishes(monkeypatch, bundles):
    """The drive gives back freed memory when it runs out of rows (once for an offline call); between rounds it only
    bounds what the heap keeps (HeapWatch.check, every round but the last)."""
    import batchspec
    from batchspec.engine.schedulers import drive

    calls = []

    class Watch:
        def __init__(self) -> None:
            calls.append("start")

        def reset(self) -> None:
            calls.append("reset")

        def check(self) -> bool:
            calls.append("check")
            return False

    monkeypatch.setattr(drive, "HeapWatch", Watch)
    bundle = bundles["llama"]
    prompts = tiny_models.random_prompts(3, seed=1, min_len=4, max_len=8)
    result = batchspec.generate(bundle.target, bundle.drafts["perturbed"], prompts, max_new_tokens=6)
    assert result.stats.rounds > 1
    assert calls == ["start"] + ["check"] * (result.stats.rounds - 1) + ["reset"]


@pytest.mark.skipif(memory.HeapWatch().resident is None, reason="needs glibc and /proc")
def test_the_heap_watch_gives_back_free_memory_beyond_its_bound():
    """Blocks freed between live ones stay resident in the heap (the mmap threshold raised, as the commands raise
    it); once more than the bound of them is resident, check gives them back, and then finds nothing to give. Live
    memory's growth past the bound costs one give-back, after which the bound counts from there."""
    memory.keep_freed_memory()
    watch = memory.HeapWatch(held=64 << 20)
    blocks, pins = [], []
    for _ in range(3):
        blocks.append(torch.ones(100 << 18))  # 100 MiB, touched
        pins.append(torch.ones(1024))  # a live block after it, so the freed one is not the heap's top
    resident = memory.resident_bytes()
    blocks.clear()
    assert memory.resident_bytes() > resident - (100 << 20)  # freed, still resident
    assert watch.check() and memory.resident_bytes() < resident - (200 << 20)
    assert not watch.check()
    blocks.append(torch.ones(100 << 18))  # live: the resident set grows by it, once
    assert watch.check() and not watch.check()


def test_available_memory_counts_what_the_system_can_reclaim(tmp_path, monkeypatch):
    """The prefix cache's ``auto`` budget reads MemAvailable, not the free pages alone (a host whose page cache fills
    its memory has few free pages and much available); without a meminfo it falls back to the free pages."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:          300000 kB\nMemAvailable:   20000000 kB\n")
    assert memory.available_bytes(str(meminfo)) == 20000000 * 1024
    monkeypatch.setattr(memory.os, "sysconf", {"SC_AVPHYS_PAGES": 75000, "SC_PAGE_SIZE": 4096}.__getitem__)
    assert memory.available_bytes(str(tmp_path / "absent")) == 75000 * 4096


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q5_1"])
def test_a_ggufs_own_embedding_rows_look_up_the_loaded_tables_values(kind):
    """A table held as a GGUF file's blocks gives, for every id, the row of the table loaded from that file (gguf's
    dequantization rounded to bfloat16, widened), in a third to a half of its memory; a table it does not expand to
    is refused."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from batchspec.models.gguf_weights import GgufEmbedding

    values = torch.randn(300, 64, generator=torch.Generator().manual_seed(1)).numpy()
    blocks = quantize(values, GGMLQuantizationType[kind])  # [V, row bytes] uint8
    table = torch.from_numpy(dequantize(blocks, GGMLQuantizationType[kind])).bfloat16()  # [V, H], as a load holds it
    embedding = GgufEmbedding(kind, torch.from_numpy(blocks), torch.bfloat16, torch.float32)
    ids = torch.tensor([[0, 299, 5], [5, 17, 0]])
    assert torch.equal(embedding(ids), torch.nn.functional.embedding(ids, table).float())
    assert torch.equal(embedding(torch.arange(300)), table.float())
    assert embedding.expands_to(table) and embedding.blocks.nbytes <= 0.55 * table.nbytes
    changed = table.clone()
    changed[128, 7] = -changed[128, 7] if changed[128, 7] != 0 else 1  # a row the check compares (every 16th)
    assert not embedding.expands_to(changed)


def test_an_integer_model_on_its_files_embedding_rows_gives_the_same_logits():
    """quantize_model with a source that holds the embedding as a file's blocks (both widths) gives the logits of
    the model that keeps its bfloat16 table, and holds the blocks instead of the table."""
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from batchspec.exact.integer import quantize_model
    from batchspec.exact.integer.model import ExactEmbedding
    from batchspec.models.gguf_weights import GgufEmbedding

    def built() -> torch.nn.Module:
        model = tiny_models.build_llama(seed=4, hidden_size=64).to(torch.bfloat16)
        table = model.model.embed_tokens.weight
        blocks = quantize(table.float().numpy(), GGMLQuantizationType.Q8_0)
        table.data = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0)).bfloat16()
        return model, torch.from_numpy(blocks)

    ids = torch.tensor([tiny_models.random_prompts(1, seed=5, min_len=9, max_len=9)[0]])
    for width in ("int8", "int4"):
        (plain, _), (compact, blocks) = built(), built()
        plain = quantize_model(plain, width=width, source=SimpleNamespace(int4=lambda name: None,
                                                                          embedding=lambda *_: None))
        def embedding(name: str, table: torch.Tensor, dtype: torch.dtype, blocks=blocks) -> GgufEmbedding:
            return GgufEmbedding("Q8_0", blocks, table.dtype, dtype)

        source = SimpleNamespace(int4=lambda name: None, embedding=embedding)  # int4: every layer int8 here
        compact = quantize_model(compact, width=width, source=source)
        assert isinstance(plain.model.embed_tokens, ExactEmbedding)
        assert isinstance(compact.model.embed_tokens, GgufEmbedding)
        with torch.no_grad():
            assert torch.equal(compact(ids).logits, plain(ids).logits), width


@pytest.mark.skipif(not native.available(), reason="this CPU or machine does not run the native kernels")
def test_a_weight_quantized_and_packed_a_part_at_a_time_is_the_whole_ones(monkeypatch):
    """quantized_weight in parts of 64 channels (the last one short, past a panel's end) gives the bits of the whole
    weight quantized and packed at once."""
    from batchspec.exact.integer import linear
    from batchspec.exact.integer.arithmetic import quantize_rows

    weight = torch.randn(300, 70, generator=torch.Generator().manual_seed(2))  # [O, K]
    monkeypatch.setattr(linear, "WEIGHT_ROWS", 64)
    packed, scales = linear.quantized_weight(lambda part: weight[part], tuple(weight.shape), torch.float32)
    q, scale = quantize_rows(weight)
    panels, sums = native.pack(q.to(torch.int8))
    assert packed.kernel == "native"
    assert torch.equal(packed.tensors[0], panels) and torch.equal(packed.tensors[1], sums)
    assert torch.equal(scales, scale[:, 0])


def _advised_ranges() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings advised for huge pages (``hg`` in smaps' VmFlags)."""
    ranges, current = [], None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                current = (start, end)
            elif head == "VmFlags:" and "hg" in line.split()[1:]:
                ranges.append(current)
    return ranges


HUGE_PAGES = memory.HUGE_PAGES_ADVISED and Path("/sys/kernel/mm/transparent_hugepage").is_dir()


@pytest.mark.skipif(not HUGE_PAGES, reason="no transparent huge pages on this system (not Linux, or not built in)")
def test_a_weight_buffer_starts_on_a_huge_page_its_whole_huge_pages_are_advised_and_its_mapping_goes_with_it():
    shape = (3, memory.HUGE_PAGE // 2 + 5)  # int16: 3 huge pages and 30 bytes
    buffer = memory.weight_buffer(shape, torch.int16)
    start = buffer.data_ptr()
    assert buffer.shape == shape and buffer.dtype == torch.int16 and buffer.is_contiguous()
    assert start % memory.HUGE_PAGE == 0
    buffer.fill_(7)
    assert int(buffer.sum()) == 7 * buffer.numel()
    advised = [(a, b) for a, b in _advised_ranges() if a <= start < b]
    assert advised == [(start, start + 3 * memory.HUGE_PAGE)]  # the 30 bytes past them stay in small pages
    del buffer
    gc.collect()
    assert not [(a, b) for a, b in _advised_ranges() if a <= start < b]


@pytest.mark.skipif(not HUGE_PAGES, reason="no transparent huge pages on this system (not Linux, or not built in)")
def test_a_weight_buffer_below_a_huge_page_is_torchs_memory_and_advises_nothing():
    before = _advised_ranges()
    buffer = memory.weight_buffer((4, memory.HUGE_PAGE // 16 - 1), torch.float32)  # 16 bytes short of a huge page
    assert buffer.shape == (4, memory.HUGE_PAGE // 16 - 1) and buffer.is_contiguous()
    assert _advised_ranges() == before


@pytest.mark.skipif(not HUGE_PAGES, reason="no transparent huge pages on this system (not Linux, or not built in)")
def test_the_packed_weights_a_step_reads_are_held_in_weight_buffers():
    """An int8 weight packed in parts, an int4 weight's panels and both kinds of stack start on huge pages."""
    from batchspec.exact.integer import int4
    from batchspec.exact.integer.linear import stacked

    generator = torch.Generator().manual_seed(5)
    panels, _ = native.empty_pack(2048, 1536)  # 3 MiB
    packed = int4.from_float(torch.randn(4096, 1152, generator=generator)).packed()  # ~2.4 MB
    for weight in (panels, packed, stacked([packed, packed]), stacked([panels, panels])):
        assert weight.data_ptr() % memory.HUGE_PAGE == 0
    assert torch.equal(stacked([packed, packed[:5]]), torch.cat([packed, packed[:5]]))
