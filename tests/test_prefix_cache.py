"""The prefix cache (:mod:`batchspec.engine.prefix_cache`): with the int8 forward, prompts that reuse cached keys and
values decode exactly as with the cache off (greedy, seeded sampling and logprobs, bit for bit), whatever prefixes the
prompts share — part of a block, a prompt that is a prefix of another, one equal to a cached prompt — and however
often entries are evicted; namespaces never share; the cache stays within its bytes."""

from __future__ import annotations

import copy
import json

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import word_tokenizer

import batchspec
from batchspec.engine.kv_cache import BatchKVCache, Slab
from batchspec.engine.prefix_cache import BLOCK, PrefixCache, block_keys
from batchspec.engine.state import KVLocation, Sequence
from batchspec.exact.integer import quantize_model
from batchspec.models import ModelPair
from batchspec.server import ServerConfig, create_app, serve_in_thread


@pytest.fixture(scope="module")
def pair(bundles):
    bundle = bundles["llama"]
    target, draft = bundle.target, bundle.drafts["perturbed"]
    return quantize_model(copy.deepcopy(target)), quantize_model(copy.deepcopy(draft)), bundle


@st.composite
def shared_prefix_prompts(draw, vocab: int) -> list[list[int]]:
    """Prompts grown from a few stems: each takes a stem's first ``cut`` tokens (any cut: whole blocks or not, the
    whole stem, or a stem that is itself a prefix of another prompt) and its own tail (possibly none)."""
    token = st.integers(1, vocab - 1)
    stems = draw(st.lists(st.lists(token, min_size=BLOCK + 1, max_size=3 * BLOCK + 5), min_size=1, max_size=3))
    prompts = []
    for _ in range(draw(st.integers(3, 7))):
        stem = draw(st.sampled_from(stems))
        cut = draw(st.integers(BLOCK + 1, len(stem)) | st.integers(1, len(stem)))  # mostly a block or more
        prompts.append(stem[:cut] + draw(st.lists(token, max_size=BLOCK + 3)))
    return prompts


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.parametrize("method, proposer", [("eqspec", "hybrid"), ("exspec", "draft"), ("autoregressive", None)])
def test_outputs_with_the_cache_are_those_without(method, proposer, pair, reference, data):
    target, draft, bundle = pair
    prompts = data.draw(shared_prefix_prompts(target.config.vocab_size), label="prompts")
    size = data.draw(st.sampled_from([1 << 30, 40_000]), label="bytes")  # 40 kB holds about one entry: evictions
    common = {"method": method, "proposer": proposer, "batch_size": 2, "max_new_tokens": 8, "num_draft_tokens": 3,
              "eos_token_id": bundle.eos_id, "pad_token_id": bundle.pad_id, "check_invariants": True, "logprobs": 2}
    cached = batchspec.generate(target, draft, prompts, prefix_cache_size=size, **common)
    plain = batchspec.generate(target, draft, prompts, prefix_cache_size=0, **common)
    assert cached.sequences == plain.sequences == [reference(target, p, 8, bundle.eos_id) for p in prompts]
    assert cached.logprobs == plain.logprobs
    assert plain.stats.prefix_hits == 0


def test_shared_prompts_are_read_once_and_reused(pair, reference):
    target, draft, bundle = pair
    system = list(range(1, 3 * BLOCK + 1))
    prompts = [system + [50 + i, 60, 70 - i] for i in range(6)]
    common = {"batch_size": 6, "max_new_tokens": 6, "eos_token_id": bundle.eos_id, "pad_token_id": bundle.pad_id,
              "temperature": 1.0, "seed": 9, "check_invariants": True}
    cached = batchspec.generate(target, draft, prompts, **common)
    plain = batchspec.generate(target, draft, prompts, prefix_cache_size=0, **common)
    assert cached.sequences == plain.sequences
    assert cached.stats.prefix_hits == 5  # the first prompt is read; the others wait for it and link its 3 blocks
    assert cached.stats.cached_tokens == 5 * 3 * BLOCK


def _read_row(prompt: list[int], namespace: str, heads: int = 2, dim: int = 4) -> Sequence:
    """A row whose prompt is read: a one-row slab whose KV column ``j`` holds the value ``j``."""
    columns = len(prompt) - 1
    storage = torch.arange(columns, dtype=torch.float32).expand(1, 2, 1, heads, dim, columns).transpose(-1, -2)
    slab = Slab(torch.tensor([prompt]), BatchKVCache(1, storage.contiguous(), columns), None)
    row = Sequence(0, prompt, 4, prefix_namespace=namespace)
    row.kv = KVLocation(slab, 0, start=0, target_cached=columns, draft_cached=0)
    return row


def test_namespaces_never_share_and_the_cache_stays_within_its_bytes():
    entry = 2 * 2 * 4 * 4 * 2 * BLOCK  # keys and values, 2 heads, 4 dims, float32, 2 blocks
    cache = PrefixCache(capacity=2 * entry)
    prompt = list(range(1, 2 * BLOCK + 3))
    cache.keep(_read_row(prompt, "alice"))
    assert cache.link(Sequence(1, prompt, 4, prefix_namespace="bob")) == 0
    same = Sequence(2, prompt, 4, prefix_namespace="alice")
    assert cache.link(same) == 2 * BLOCK
    assert same.kv.slab.shared and same.kv.slab.target.storage[0, 0, 0, 0, 5, 0] == 5
    for salt in range(5):
        cache.keep(_read_row([100 + salt, *prompt], "alice"))
        assert cache.stats.bytes_held <= cache.capacity
    assert cache.stats.evicted == 4
    assert cache.link(Sequence(3, prompt, 4, prefix_namespace="alice")) == 0  # its entry was the least recent


def test_block_keys_worked_example():
    tokens = list(range(40))
    keys = block_keys("", tokens)
    assert len(keys) == 2
    assert keys == block_keys("", tokens[: 2 * BLOCK]) and keys[:1] == block_keys("", tokens[:BLOCK])
    assert block_keys("x", tokens) != keys


# ------------------------------------------------------------------------------------------------ through the server


@pytest.fixture(scope="module")
def server(pair):
    target, draft, bundle = pair
    models = ModelPair(target, draft, word_tokenizer(bundle.eos_id), "tiny", "int8")
    with serve_in_thread(create_app(models, ServerConfig.of(batch_size=4, check_invariants=True))) as running:
        yield running


def test_clients_see_their_cached_tokens_and_tenants_never_share(server):
    prompt = [20 + i % 60 for i in range(3 * BLOCK + 5)]

    def complete(key: str, salt: str | None = None, stream: bool = False) -> tuple[list[int], int]:
        body = {"prompt": prompt, "max_tokens": 5, "return_token_ids": True, "cache_salt": salt}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        headers = {"Authorization": f"Bearer {key}"}
        reply = httpx.post(f"{server.url}/v1/completions", json={k: v for k, v in body.items() if v is not None},
                           headers=headers, timeout=60)
        reply.raise_for_status()
        if stream:
            events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: {")]
            chunks = [json.loads(event) for event in events]
            tokens = [t for chunk in chunks for choice in chunk["choices"] for t in choice.get("token_ids") or []]
            return tokens, chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
        data = reply.json()
        return data["choices"][0]["token_ids"], data["usage"]["prompt_tokens_details"]["cached_tokens"]

    first, cached = complete("alice")
    assert cached == 0
    assert complete("alice") == (first, 3 * BLOCK)
    assert complete("alice", stream=True) == (first, 3 * BLOCK)
    assert complete("bob") == (first, 0)  # another key: its own entry
    assert complete("alice", salt="s1") == (first, 0)
    assert complete("alice", salt="s1") == (first, 3 * BLOCK)
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    held = next(line for line in metrics.splitlines() if line.startswith("batchspec_prefix_cache_bytes "))
    assert float(held.split()[1]) > 0
    assert "batchspec_prefix_cache_tokens " in metrics


def test_rows_wait_for_a_shared_prompt_only_where_it_saves_much():
    cache = PrefixCache(capacity=1 << 20)
    template = list(range(1, 2 * BLOCK + 1))
    articles = [Sequence(i, template + [100 + i] * 800, 4) for i in range(8)]
    assert cache.followers(articles) == set()  # 32 shared tokens of 832 each: all read at once
    system = list(range(1, 1500))
    agents = [Sequence(i, system + [100 + i] * 60, 4) for i in range(8)]
    assert cache.followers(agents) == set(range(1, 8))  # the first reads, the others link it
    other = Sequence(8, [7] * 1600, 4, prefix_namespace="someone else")
    assert 8 not in cache.followers([*agents, other])
