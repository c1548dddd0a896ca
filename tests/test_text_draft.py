"""A draft of another tokenizer than the target's (universal assisted generation, :mod:`batchspec.engine.retokenize`):
its drafts reach the target as text, and the output is the target's own greedy output all the same.

The tiny pairs: the target reads one printable character per token (``serving.byte_tokenizer``); the draft's
tokenizer numbers the same characters otherwise (reversed), and in the ``merged`` pair also merges some pairs of them
into tokens of their own (byte-level BPE), so that a text splits otherwise in it. The draft is the target's own network
over its characters' rows: where a text splits into single characters (always, in the ``permuted`` pair) it agrees with
the target and its drafts are accepted. The tests see both that the handoff works (most drafts accepted) and that it
cannot change the output (every answer equals an independent greedy loop's, whatever the draft's tokens)."""

from __future__ import annotations

import copy
import itertools

import pytest
import tiny_models
import torch
from helpers import cached_or_skip, engine_for
from serving import CHAT_TEMPLATE, byte_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import batchspec
from batchspec.config import SpecConfig
from batchspec.engine import Offline, Sequence, bridge_of, drive, make_scheduler
from batchspec.engine.kv_cache import BatchKVCache
from batchspec.engine.retokenize import HOLD, DraftText, TextBridge, Window, bridged
from batchspec.exact.integer import quantize_model
from batchspec.exact.integer.forward import forward_in_use
from batchspec.models import load_pair

MERGED = "jqxz"  # every pair of these (rare) characters is one token of the draft's: a text with them splits otherwise


def _draft_tokenizer(merged: bool) -> PreTrainedTokenizerFast:
    """The 95 printable characters in reverse order, EOS, then (``merged``) a token for every pair of :data:`MERGED`."""
    chars = ["Ġ" if code == ord(" ") else chr(code) for code in range(ord("~"), ord(" ") - 1, -1)]
    pairs = list(itertools.product(MERGED, repeat=2)) if merged else []
    vocab = {c: i for i, c in enumerate(chars)} | {"</s>": len(chars)}
    vocab |= {a + b: len(vocab) + i for i, (a, b) in enumerate(pairs)}
    backend = Tokenizer(models.BPE(vocab, pairs, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module", params=["permuted", "merged"])
def text_pair(request):
    """``(target, draft, bridge, prompts)``: the tiny llama target and its draft of another tokenizer."""
    target = tiny_models.build_target("llama")
    eos = tiny_models.VOCAB_SIZE - 1
    target_tokenizer, draft_tokenizer = byte_tokenizer(eos), _draft_tokenizer(request.param == "merged")
    draft = copy.deepcopy(target)
    draft.resize_token_embeddings(len(draft_tokenizer), mean_resizing=False)
    embed, head = draft.get_input_embeddings().weight, draft.get_output_embeddings().weight
    source_embed, source_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    with torch.no_grad():
        head[:] = source_head[eos]  # a merged pair is drafted as seldom as EOS
        for token, i in target_tokenizer.get_vocab().items():
            j = draft_tokenizer.get_vocab()[token]
            embed[j], head[j] = source_embed[i], source_head[i]
    bridge = TextBridge.of(target_tokenizer, draft_tokenizer)
    prompts = [target_tokenizer.encode(text) for text in ("to be or not", "a tea at noon in", "eat", "jazz quiz")]
    return target, draft, bridge, prompts


@pytest.mark.parametrize(("proposer", "batch_size"), [("draft", 3), ("hybrid", 1)])
def test_a_draft_of_another_tokenizer_gives_the_targets_greedy_output(text_pair, proposer, batch_size):
    target, draft, bridge, prompts = text_pair
    reference = tiny_models.greedy_no_eos(target, prompts, 24)
    result = batchspec.generate(target, bridged(copy.deepcopy(draft), bridge), prompts, max_new_tokens=24,
                                proposer=proposer, batch_size=batch_size, num_draft_tokens=3, eos_token_id=[])
    assert result.sequences == reference
    stats = result.stats
    if len(bridge.draft) == tiny_models.VOCAB_SIZE:  # the permuted pair: one text, one split
        assert stats.draft_tokens_accepted > 0.8 * stats.draft_tokens_proposed > 0


def test_an_int8_draft_of_another_tokenizer_gives_the_targets_greedy_output(text_pair):
    target, draft, bridge, prompts = text_pair
    quantized_target = quantize_model(copy.deepcopy(target).float())
    quantized_draft = bridged(quantize_model(copy.deepcopy(draft).float()), bridge)
    reference = batchspec.generate(quantized_target, None, prompts, max_new_tokens=16, method="autoregressive",
                                   eos_token_id=[])
    result = batchspec.generate(quantized_target, quantized_draft, prompts, max_new_tokens=16, batch_size=2,
                                eos_token_id=[])
    assert result.sequences == reference.sequences


def test_the_commit_point_holds_one_text_in_both_tokenizations(text_pair):
    _, draft, bridge, prompts = text_pair
    state = DraftText.start(bridge, BatchKVCache.for_model(draft))
    text = bridge.target.encode("eat a tea at ten, not at one; " * 3)
    for end in range(1, len(text) + 1):
        state.sync(bridge, Window.of(text[:end], [], state.commit[0]), [])
        at, held = state.commit
        assert bridge.target.decode(text[:at]) == bridge.draft.decode(state.ids[:held])
        assert bridge.draft.decode(state.ids) == bridge.target.decode(text[:end])
        assert at == 0 or end - 2 * HOLD <= at <= end - HOLD


def test_the_continuation_is_the_text_the_drafts_add(text_pair):
    _, draft, bridge, _ = text_pair
    state = DraftText.start(bridge, BatchKVCache.for_model(draft))
    text = bridge.target.encode("at ")
    state.sync(bridge, Window.of(text, [], 0), [])
    drafted = bridge.draft.encode("tea time", add_special_tokens=False)
    assert state.continuation(bridge, drafted) == "tea time"
    assert bridge.to_target("tea time") == bridge.target.encode("tea time", add_special_tokens=False)


def test_seeded_sampling_with_a_draft_of_another_tokenizer_does_not_depend_on_the_batch_or_k(text_pair):
    """A seeded row draws the same tokens whatever the batch and draft length (``SpecConfig.seed``): its drafts are
    its lookups, a function of its text, never the draft's text cut at the round's length."""
    target, draft, bridge, prompts = text_pair
    prompts = [prompt + prompt for prompt in prompts]  # repeats: lookups find matches
    options = dict(max_new_tokens=16, temperature=0.9, seed=7, eos_token_id=[])
    alone = batchspec.generate(target, bridged(copy.deepcopy(draft), bridge), prompts, batch_size=1,
                               num_draft_tokens=3, **options)
    assert alone.stats.draft_tokens_proposed > 0
    for batch_size, k in [(4, 2), (3, "auto")]:
        batched = batchspec.generate(target, bridged(copy.deepcopy(draft), bridge), prompts, batch_size=batch_size,
                                     num_draft_tokens=k, **options)
        assert batched.sequences == alone.sequences


@pytest.fixture(scope="module")
def gemma3_with_smollm2(reference):
    """Gemma 3 270M drafted for by SmolLM2-135M through text, both int8, loaded once; three prompts and the target's
    own greedy 20 tokens of each."""
    cached_or_skip("gemma3")
    cached_or_skip("smollm2")
    pair = load_pair(target="gemma3:target", draft="smollm2:target", quantize="int8", progress=False)
    texts = ("def fibonacci(n):\n", "The capital of France is", "Once upon a time, in a small village,")
    prompts = [pair.tokenizer.encode(text) for text in texts]
    eos = pair.target.generation_config.eos_token_id
    return pair, prompts, [reference(pair.target, ids, 20, eos) for ids in prompts]


@pytest.mark.parametrize(("proposer", "k"), [("draft", 3), ("hybrid", "auto")])
def test_smollm2_drafts_for_gemma3_through_text(gemma3_with_smollm2, proposer, k):
    """Two real models of two tokenizers (Gemma 3 270M's 262k tokens, SmolLM2-135M's 49k), both int8 on the fused
    forward: the draft's text is handed over and the output is Gemma's own greedy output, prompt by prompt."""
    pair, prompts, expected = gemma3_with_smollm2
    assert bridge_of(pair.draft) is not None and forward_in_use(pair.draft) == "fused"
    assert pair.precision.endswith("fused forward, the draft through text")
    assert pair.served()["draft_tokenizer"] == "its own, through text"
    result = batchspec.generate(pair.target, pair.draft, prompts, proposer=proposer, num_draft_tokens=k,
                                batch_size=2, max_new_tokens=20, check_invariants=True)
    assert result.sequences == expected
    if proposer == "draft":
        assert result.stats.draft_tokens_accepted > 0


def test_a_finished_row_lets_go_of_its_draft_text(text_pair):
    """A row keeps its text in the draft's tokens and the draft's KV cache of it while it decodes, and lets go of them
    when it finishes: they are the draft's KV of a whole prompt."""
    target, draft, bridge, prompts = text_pair
    config = SpecConfig(batch_size=2, num_draft_tokens=3, proposer="draft", eos_token_ids=())
    engine = engine_for(target, bridged(copy.deepcopy(draft), bridge), config)
    rows = [Sequence(i, prompt, budget) for i, (prompt, budget) in enumerate(zip(prompts, [2, 9, 5, 12], strict=True))]
    scheduler = make_scheduler(engine.config)
    for row in rows:
        scheduler.add(row)
    held = []

    class Watch(Offline):
        def ran(self, ran: list[Sequence], finished: list[Sequence]) -> None:
            held.append((sum(row.draft_text is not None for row in ran), [row.draft_text for row in finished]))

    with torch.inference_mode():
        drive(engine, scheduler, Watch(lambda done: None))
    assert max(holding for holding, _ in held) > 0
    assert all(text is None for _, texts in held for text in texts)
    assert all(row.finished and row.draft_text is None for row in rows)
