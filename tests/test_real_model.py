"""The real ``smollm2`` preset: batched EqSpec, ExSpec, autoregressive decoding and the server equal the target's own
greedy output.

The reference is transformers' ``generate`` on each prompt alone (batch size 1, ``do_sample=False``). The float32
tests load the models in float32 (``quantize="none"``), where the batched and the single-prompt forward passes agree
closely enough that no argmax near-tie flips; the ``int8`` tests load them as batchspec does by default on the CPU
(``quantize="auto"``: the exact int8 models, whose rows are bit-identical whatever the batch). CI obtains the
preset first (``scripts/setup.sh test`` runs ``batchspec fetch --preset smollm2``), so there a missing preset fails
instead of skipping.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import cached_or_skip
from prometheus_client.parser import text_string_to_metric_families
from ragged import ragged_forwards
from typer.testing import CliRunner

import batchspec
from batchspec.bench.fingerprint import committed, fingerprint
from batchspec.cli import app
from batchspec.config import default_cache_dir
from batchspec.data import format_prompts, load_prompts
from batchspec.exact.integer import native
from batchspec.models import loading
from batchspec.server import ServerConfig, create_app, serve_in_thread

torch = pytest.importorskip("torch")

NUM_PROMPTS = 4
BATCH_SIZE = 4
MAX_NEW_TOKENS = 24


SERVED_PROMPTS = (
    "def fibonacci(n):", "# quicksort in Python\n", "The capital of France is", "import numpy as np\n",
    "def is_prime(n):\n    ", "Once upon a time", "SELECT name FROM users WHERE", "class Stack:\n",
)
SERVED_TOKENS = 16
# an odd thread count splits rows unevenly; 16 threads (tests/test_integer_builds.py, on tiny models) thrash a 2-core
# CI host for a minute on these models
THREADS = 3


@pytest.fixture(scope="module")
def smollm2():
    cached_or_skip("smollm2")
    return loading.load_pair("smollm2", progress=False, quantize="none")  # the default dtype, float32


@pytest.fixture(scope="module")
def humaneval_ids(smollm2) -> list[list[int]]:
    return format_prompts(load_prompts("humaneval", limit=NUM_PROMPTS), smollm2.tokenizer)


@pytest.fixture(scope="module")
def expected(smollm2, humaneval_ids, reference) -> list[list[int]]:
    eos = smollm2.target.generation_config.eos_token_id
    return [reference(smollm2.target, ids, MAX_NEW_TOKENS, eos) for ids in humaneval_ids]


@pytest.mark.parametrize("method", ["eqspec", "exspec", "autoregressive"])
def test_batched_generation_equals_target_greedy(smollm2, humaneval_ids, expected, method):
    result = batchspec.generate(
        smollm2.target, smollm2.draft, humaneval_ids, method=method, batch_size=BATCH_SIZE,
        max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=5, check_invariants=True,
    )
    assert result.sequences == expected
    assert result.stats.generated_tokens == sum(map(len, expected))
    if method != "autoregressive":
        assert result.stats.ragged_rounds > 0
        assert 0.2 < result.stats.acceptance_rate < 1.0


def test_cli_generate_on_the_preset(smollm2, expected, tmp_path):
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, [
        "generate", "--preset", "smollm2", "--limit", str(NUM_PROMPTS), "--batch-size", str(BATCH_SIZE),
        "--max-new-tokens", str(MAX_NEW_TOKENS), "--quantize", "none", "--output", str(out),
    ])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["token_ids"] for row in rows] == expected
    assert "def " in rows[0]["text"]
    assert "acceptance rate" in result.stdout
    assert "Summary: smollm2 (float32, packed kernels), eqspec, batch size 4" in result.stdout


def test_default_dtype_is_float32_on_the_cpu(smollm2):
    assert smollm2.dtype == "float32"
    assert smollm2.target.dtype == smollm2.draft.dtype == torch.float32


def mean_batch_occupancy(url: str) -> float:
    """Rows per round over the maximum batch size, averaged over the server's rounds (from its /metrics)."""
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    samples = {sample.name: sample.value for sample in families["batchspec_batch_occupancy"].samples}
    return samples["batchspec_batch_occupancy_sum"] / samples["batchspec_batch_occupancy_count"]


def test_server_default_config_gives_concurrent_clients_their_sequential_outputs(smollm2_int8):
    """16 greedy clients at once (8 prompts, each sent twice) against the server as `batchspec serve --preset
    smollm2` starts it (default dtype and options): each gets what batchspec.generate gives its prompt alone."""
    prompts = [smollm2_int8.tokenizer.encode(text) for text in SERVED_PROMPTS]
    config = ServerConfig()
    alone = [
        batchspec.generate(smollm2_int8.target, smollm2_int8.draft, [ids], max_new_tokens=SERVED_TOKENS,
                           num_draft_tokens=config.engine.num_draft_tokens).sequences[0]
        for ids in prompts
    ]
    with serve_in_thread(create_app(smollm2_int8, config)) as server:

        def complete(index: int) -> list[int]:
            body = {"model": "smollm2", "prompt": prompts[index % len(prompts)], "max_tokens": SERVED_TOKENS,
                    "return_token_ids": True}
            reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120.0)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(2 * len(prompts)) as pool:
            served = list(pool.map(complete, range(2 * len(prompts))))
        occupancy = mean_batch_occupancy(server.url)
    assert served == alone + alone
    assert occupancy > 2 / config.engine.batch_size, "the requests must have been decoded together"


@pytest.fixture(scope="module")
def smollm2_int8():
    cached_or_skip("smollm2")
    return loading.load_pair("smollm2", progress=False, quantize="int8")  # the CPU's default where kernels run


@pytest.mark.parametrize("width, method, proposer", [
    ("int8", "eqspec", "hybrid"), ("int8", "exspec", "draft"), ("int8", "eqspec", "ngram"),
    ("int4", "eqspec", "hybrid"), ("int4", "exspec", "draft"),
])
def test_integer_batched_generation_equals_its_own_greedy(request, humaneval_ids, reference, width, method, proposer):
    """The int8 (or int4) pair's batched output is its target's own greedy output, with no near-tie exemption."""
    pair = request.getfixturevalue(f"smollm2_{width}")
    eos = pair.target.generation_config.eos_token_id
    expected = [reference(pair.target, ids, MAX_NEW_TOKENS, eos) for ids in humaneval_ids]
    result = batchspec.generate(
        pair.target, pair.draft, humaneval_ids, method=method, proposer=proposer,
        batch_size=BATCH_SIZE, max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=4, check_invariants=True,
    )
    assert result.sequences == expected
    assert pair.precision.startswith(f"float32, {width} exact on ")


def test_the_integer_pair_holds_the_ggufs_own_embedding_rows(smollm2, smollm2_int8):
    """Each int8 model's input embedding is its GGUF file's own Q8_0 rows, not a table: every id looks up the float
    model's row (the file's values, rounded to bfloat16 as the preset's cache holds them), in 0.53x a bf16 table."""
    from batchspec.models.gguf_weights import GgufEmbedding

    for integer, dense in ((smollm2_int8.target, smollm2.target), (smollm2_int8.draft, smollm2.draft)):
        embedding, table = integer.get_input_embeddings(), dense.get_input_embeddings().weight  # [V, H] float32
        assert isinstance(embedding, GgufEmbedding) and embedding.kind.name == "Q8_0"
        with torch.no_grad():
            assert torch.equal(embedding(torch.arange(table.shape[0])), table)
        assert embedding.blocks.nbytes == table.numel() * 34 // 32


def test_one_changed_bit_of_one_weight_changes_the_fingerprint(smollm2_int8):
    """The fingerprint sees a single bit: the lowest of one int8 weight of the target's first down projection (a
    bit of the rotary table's cosines, by contrast, rarely survives the keys' 15-bit quantization)."""
    panels = smollm2_int8.target.model.layers[0].mlp.down_proj.weight.tensors[0].view(-1)  # the packed int8 codes
    original = panels[0].clone()
    try:
        panels[0] = original ^ 1
        changed = fingerprint(smollm2_int8)
    finally:
        panels[0] = original
    want = committed("smollm2")["int8"]
    assert changed["target logits"] != want["target logits"]
    assert changed["draft logits"] == want["draft logits"]


def test_int8_rows_are_bit_identical_alone_and_padded(smollm2_int8, humaneval_ids):
    """Two prompts of different lengths in one left-padded forward give each the logits it gets alone."""
    target = smollm2_int8.target
    short, long = sorted(humaneval_ids[:2], key=len)
    pad = len(long) - len(short)
    ids = torch.tensor([[0] * pad + short, long])
    mask = torch.tensor([[0] * pad + [1] * len(short), [1] * len(long)])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batched = target(ids, attention_mask=mask, position_ids=positions, logits_to_keep=8).logits
        alone = [target(torch.tensor([row]), logits_to_keep=8).logits[0] for row in (short, long)]
    assert torch.equal(batched[0], alone[0]) and torch.equal(batched[1], alone[1])


def test_int8_logits_are_the_same_bits_on_every_build_and_thread_count(smollm2_int8, humaneval_ids):
    """The int8 target's logits, 8 prompts read as a ragged batch and decoded 1, 3 and 1 tokens at a time, and one
    prompt alone: the same bits on every native build this CPU runs (2 threads), with 1 and 3 threads on this CPU's
    default build, and on the torch path without native kernels (the model quantized there too: the same
    calibration, so the same int8 weights). The pair's fingerprint is the committed one
    (``batchspec/bench/fingerprints.json``, made on another host), so every build's logits are that host's too."""
    served = [smollm2_int8.tokenizer.encode(text) for text in SERVED_PROMPTS[:4]]
    rows = [ids[-40:] for ids in humaneval_ids] + served
    prefix = [len(row) - 5 for row in rows]

    def logits(model) -> list[torch.Tensor]:
        return [*ragged_forwards(model, rows, prefix, [1, 3, 1]), *ragged_forwards(model, rows[:1], prefix[:1], [5])]

    threads, want = torch.get_num_threads(), logits(smollm2_int8.target)
    assert fingerprint(smollm2_int8) == committed("smollm2")["int8"]
    runs = [(isa, 2) for isa in native.host_isas()] + [(native.isa(), 1), (native.isa(), THREADS)]
    try:
        for isa, count in runs:
            torch.set_num_threads(count)
            with native.using(isa):
                got = logits(smollm2_int8.target)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (isa, count)
    finally:
        torch.set_num_threads(threads)
    with native.using("none"):
        torch_path = loading.load_model("smollm2:target", progress=False, quantize="int8")[0]
        got = logits(torch_path)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def smollm2_int4():
    """The pair as ``--quantize auto`` loads it on the ``avx2`` build (every x86-64 host runs it): its GGUF holds Q4_1
    blocks, so int4."""
    cached_or_skip("smollm2")
    if "avx2" not in native.host_isas():
        pytest.skip("this CPU does not run the avx2 build")
    with native.using("avx2"):
        return loading.load_pair("smollm2", progress=False)


def test_auto_keeps_the_ggufs_own_4_bit_blocks(smollm2_int4):
    """``--quantize auto`` on a preset published in 4 bits is int4 on the avx2 build, and every int4 layer holds the
    file's own Q4_1 blocks: expanded as gguf expands them, they equal gguf's dequantization of the file element for
    element."""
    from gguf import GGUFReader, dequantize

    from batchspec.exact.integer.linear import Int4Linear
    from batchspec.models.gguf_weights import GgufOrigin, GgufWeights

    assert smollm2_int4.quantize == "int4"
    path = default_cache_dir() / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tensors = {tensor.name: tensor for tensor in GGUFReader(str(path)).tensors}
    dense = loading.load_model("smollm2:target", progress=False, quantize="none")[0]
    source = GgufWeights(GgufOrigin(path), dense)
    layers = [(name, m) for name, m in smollm2_int4.target.named_modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 7 * dense.config.num_hidden_layers
    for name in ("model.layers.0.mlp.down_proj", "model.layers.29.self_attn.v_proj", "model.layers.7.mlp.gate_proj"):
        tensor = tensors[source.tensor_name(name) + ".weight"]
        assert torch.equal(source.int4(name).values(), torch.from_numpy(dequantize(tensor.data, tensor.tensor_type)))
    q = source.int4("model.layers.3.self_attn.q_proj")  # llama.cpp's row order undone, as transformers undoes it
    assert torch.equal(q.values().bfloat16(), dense.model.layers[3].self_attn.q_proj.weight.bfloat16())


def test_int4_logits_are_the_same_bits_on_every_build_and_thread_count(smollm2_int4, humaneval_ids):
    """The int4 target's logits of a ragged batch: the same bits on every native build (2 threads), with 1 and 3
    threads, and, for one short row, on the torch path (the model made there from the same file); the pair's
    fingerprint is the committed one."""
    rows = [ids[-40:] for ids in humaneval_ids]
    prefix = [len(row) - 5 for row in rows]

    def logits(model) -> list[torch.Tensor]:
        return ragged_forwards(model, rows, prefix, [1, 3, 1])

    threads, want = torch.get_num_threads(), logits(smollm2_int4.target)
    assert fingerprint(smollm2_int4) == committed("smollm2")["int4"]
    try:
        for isa, count in [(isa, 2) for isa in native.host_isas()] + [(native.isa(), 1), (native.isa(), THREADS)]:
            torch.set_num_threads(count)
            with native.using(isa):
                assert all(torch.equal(a, b) for a, b in zip(logits(smollm2_int4.target), want, strict=True))
    finally:
        torch.set_num_threads(threads)
    short = [rows[0][-12:]]  # one short row: the torch path's product unpacks the nibbles of every weight each call
    want = ragged_forwards(smollm2_int4.target, short, [7], [1, 3, 1])
    with native.using("none"):
        torch_path = loading.load_model("smollm2:target", progress=False, quantize="int4")[0]
        got = ragged_forwards(torch_path, short, [7], [1, 3, 1])
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


LARGE = pytest.mark.skipif(not os.environ.get("BATCHSPEC_LARGE_TESTS"),
                           reason="loads the 1.5B preset (about 35 s); set BATCHSPEC_LARGE_TESTS=1 to run it")


@pytest.mark.parametrize("preset", ["smollm2", pytest.param("qwen2.5-coder", marks=LARGE)])
def test_int8_penalties_grammar_and_logprobs_on_the_preset(preset, request):
    """Issue 38's features on a real int8 pair: with penalties, a logit bias and a JSON schema, speculative batches
    give each prompt the constrained, penalised greedy output of plain decoding alone, and the same logprobs, bit
    for bit; every finished answer is a valid object, and the prompt and answer read back as one prompt (completions'
    echo) give the answer those logprobs again. (qwen2.5-coder runs where a developer has fetched it.)"""
    from batchspec.engine.grammar import GrammarCompiler
    from batchspec.engine.penalties import Penalties

    cached_or_skip(preset)
    pair = request.getfixturevalue("smollm2_int8") if preset == "smollm2" else loading.load_pair(preset, progress=False)
    tokenizer = pair.tokenizer
    eos = pair.target.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}
    grammar = GrammarCompiler(tokenizer, pair.target.config.vocab_size, eos).json_schema(schema)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"A weather request for {city} as JSON"}],
                                             add_generation_prompt=True, tokenize=True) for city in
               ("Paris", "Lima", "Oslo", "Tokyo")]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    common = {"max_new_tokens": 32, "eos_token_id": eos, "logprobs": 2, "grammar": grammar,
              "penalties": Penalties(presence=0.3, frequency=0.2, repetition=1.1, logit_bias=((eos[0], -1.0),))}
    alone = batchspec.generate(pair.target, None, prompts, method="autoregressive", batch_size=1, **common)
    batched = batchspec.generate(pair.target, pair.draft, prompts, batch_size=4, num_draft_tokens=4,
                                 check_invariants=True, **common)
    assert batched.sequences == alone.sequences
    assert batched.logprobs == alone.logprobs
    finished = [tokenizer.decode(s, skip_special_tokens=True) for s in alone.sequences if s[-1] in eos]
    assert finished
    for text in finished:
        assert set(json.loads(text)) == {"city", "days"}
    echoed = [p + s for p, s in zip(prompts, alone.sequences, strict=True)]  # completions' echo: the prompt scored
    scored = batchspec.generate(pair.target, pair.draft, echoed, max_new_tokens=0, prompt_logprobs=2).prompt_logprobs
    for prompt, scores, generated in zip(prompts, scored, alone.logprobs, strict=True):
        assert scores[len(prompt) - 1 :] == generated
