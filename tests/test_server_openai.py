"""The OpenAI fields real clients send (``logprobs``/``top_logprobs``, ``n``, penalties, ``logit_bias``,
``response_format``), through the ``openai`` SDK where it can send them and raw HTTP elsewhere.

The models are the tiny llama pair quantized to batchspec's exact int8 forward (a row's logits are the same bits
whatever the batch, method or ``k``) with a one-character-per-token byte-level tokenizer (so that llguidance reads
it and JSON can be written). References: the same request served alone, the same request served by plain
autoregressive decoding, a greedy loop over the target's own forward written here, and ``batchspec.generate``.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch
from pydantic import BaseModel
from serving import (
    Served,
    assert_error,
    byte_tokenizer,
    client,
    loop_of,
    post_raw,
    recording_rounds,
    wait_until,
    word_tokenizer,
)

import batchspec
from batchspec.exact.integer import quantize_model
from batchspec.models import ModelPair
from batchspec.server import ServerConfig, create_app, serve_in_thread
from batchspec.server.errors import APIError
from batchspec.server.params import StructuredOutputs

MESSAGES = [{"role": "user", "content": "tell me"}]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def int8_served(llama) -> Served:
    target = quantize_model(copy.deepcopy(llama.target))
    draft = quantize_model(copy.deepcopy(llama.drafts["perturbed"]))
    return Served(ModelPair(target, draft, byte_tokenizer(llama.eos_id), "tiny", "int8"), {})


@contextmanager
def running(served: Served, method: str) -> Iterator:
    config = ServerConfig.of(method=method, batch_size=4, num_draft_tokens=4, check_invariants=True)
    with serve_in_thread(create_app(served.models, config)) as server:
        yield server


@pytest.fixture(scope="module")
def spec(int8_served):
    with running(int8_served, "eqspec") as server:
        yield server


@pytest.fixture(scope="module")
def plain(int8_served):
    with running(int8_served, "autoregressive") as server:
        yield server


def chat(server, **options):
    return client(server).chat.completions.create(model="tiny", messages=MESSAGES, **options)


def ids_of(choice) -> list[int]:
    return choice.token_ids  # the return_token_ids extension


def prompt_ids(served: Served) -> list[int]:
    return served.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]


def shaped_greedy(served: Served, prompt: list[int], max_tokens: int, **shaping) -> list[int]:
    """Greedy decoding by the target's own forward over the whole sequence, with vLLM's penalties (repetition over
    prompt and output, then frequency and presence over the output) and a logit bias, written out here."""
    eos = served.models.target.generation_config.eos_token_id
    presence, frequency = shaping.get("presence", 0.0), shaping.get("frequency", 0.0)
    repetition, bias = shaping.get("repetition", 1.0), shaping.get("bias", {})
    output: list[int] = []
    while len(output) < max_tokens and eos not in output:
        with torch.no_grad():
            logits = served.models.target(torch.tensor([prompt + output])).logits[0, -1].double()  # [V]
        for token in set(prompt) | set(output):
            logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
        for token, count in Counter(output).items():
            logits[token] -= frequency * count + presence
        for token, value in bias.items():
            logits[token] += value
        output.append(int(logits.argmax()))
    return output


# --------------------------------------------------------------------------------------------------
# logprobs


def test_chat_logprobs_are_the_targets_whatever_the_batch(spec, plain, int8_served):
    lone = chat(spec, max_tokens=12, logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True})
    choice = lone.choices[0]
    entries = choice.logprobs.content
    assert [e.token for e in entries] == [int8_served.text([t]) for t in ids_of(choice)]
    assert "".join(e.token for e in entries) == choice.message.content
    for entry in entries:
        assert bytes(entry.bytes) == entry.token.encode() and len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob  # greedy
    with torch.inference_mode():
        logits = int8_served.models.target(torch.tensor([prompt_ids(int8_served) + ids_of(choice)])).logits[0]
    expected = torch.log_softmax(logits.double(), dim=-1)[-len(entries) - 1 : -1]  # [n, V]: before each token
    got = torch.tensor([e.logprob for e in entries], dtype=torch.float64)
    torch.testing.assert_close(got, expected.gather(-1, torch.tensor(ids_of(choice))[:, None])[:, 0])

    def ask(options: dict):
        return client(spec).chat.completions.create(
            model="tiny", max_tokens=12, logprobs=True, top_logprobs=3, **{"messages": MESSAGES, **options}
        )

    others = [{}, {"n": 2}, {"temperature": 1.0, "seed": 3}, {"messages": [{"role": "user", "content": "x"}]}]
    with ThreadPoolExecutor(4) as pool:
        batched = list(pool.map(ask, others))
    alone_plain = chat(plain, max_tokens=12, logprobs=True, top_logprobs=3)
    for reply in (batched[0], batched[1], alone_plain):
        for c in reply.choices:
            assert c.logprobs == choice.logprobs, "logprobs changed with the batch or the method"


def test_streamed_logprobs_equal_the_whole_reply(spec):
    whole = chat(spec, max_tokens=10, n=2, logprobs=True, top_logprobs=2)
    chunks = list(chat(spec, max_tokens=10, n=2, logprobs=True, top_logprobs=2, stream=True,
                       stream_options={"include_usage": True}))
    for index, choice in enumerate(whole.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [e for c in mine if c.logprobs for e in c.logprobs.content] == choice.logprobs.content
        assert mine[-1].finish_reason == choice.finish_reason
    assert chunks[-1].usage == whole.usage


def test_completion_logprobs_shape(spec, plain):
    reply = client(spec).completions.create(model="tiny", prompt="tell me", max_tokens=8, logprobs=2)
    alone_plain = client(plain).completions.create(model="tiny", prompt="tell me", max_tokens=8, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert logprobs == alone_plain.choices[0].logprobs
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert all(len(top) == 2 and max(top.values()) >= lp for top, lp in
               zip(logprobs.top_logprobs, logprobs.token_logprobs, strict=True))
    streamed = list(client(spec).completions.create(model="tiny", prompt="tell me", max_tokens=8, logprobs=2,
                                                    stream=True))
    parts = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs]
    assert [o for p in parts for o in p.text_offset] == logprobs.text_offset
    assert [t for p in parts for t in p.token_logprobs] == logprobs.token_logprobs


def test_echo_scores_the_prompt_with_the_bits_its_tokens_had_when_generated(spec, plain):
    """What evaluation harnesses send to score a continuation (``echo``, ``logprobs``, ``max_tokens: 1``): the
    echoed prompt's logprobs, the first token's null, and a continuation the model generated scored with the very
    logprobs it was generated with, by the speculative server and the plain one alike."""
    completions = client(spec).completions
    generated = completions.create(model="tiny", prompt="tell me", max_tokens=6, logprobs=2,
                                   extra_body={"return_token_ids": True})
    text, prompt = "tell me" + generated.choices[0].text, generated.choices[0].prompt_token_ids
    options = {"model": "tiny", "max_tokens": 1, "logprobs": 2, "echo": True}
    scored = completions.create(prompt=text, **options).choices[0]
    assert scored.text.startswith(text) and len(scored.text) == len(text) + 1
    logprobs = scored.logprobs
    assert logprobs == client(plain).completions.create(prompt=text, **options).choices[0].logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert "".join(logprobs.tokens) == scored.text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    continuation = slice(len(prompt), len(prompt) + 6)
    assert logprobs.token_logprobs[continuation] == generated.choices[0].logprobs.token_logprobs
    assert logprobs.top_logprobs[continuation] == generated.choices[0].logprobs.top_logprobs
    by_ids = completions.create(prompt=prompt + generated.choices[0].token_ids, **options).choices[0]
    assert (by_ids.text, by_ids.logprobs) == (scored.text, logprobs)
    streamed = list(completions.create(prompt=text, stream=True, **options))
    assert "".join(c.choices[0].text for c in streamed) == scored.text
    parts = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs]
    assert [v for p in parts for v in p.token_logprobs] == logprobs.token_logprobs
    assert completions.create(prompt=text, model="tiny", max_tokens=2, echo=True).choices[0].text.startswith(text)


# --------------------------------------------------------------------------------------------------
# n


def test_n_sampled_choices_each_follow_their_derived_seed(spec, int8_served):
    options = {"max_tokens": 10, "temperature": 1.0, "seed": 11, "extra_body": {"return_token_ids": True}}
    reply = chat(spec, n=3, **options)
    prompt = reply.choices[0].prompt_token_ids
    expected = batchspec.generate(
        int8_served.models.target, int8_served.models.draft, [prompt] * 3, max_new_tokens=10, num_draft_tokens=4,
        temperature=1.0, seed=11,
    ).sequences
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [ids_of(c) for c in reply.choices] == expected and len({tuple(s) for s in expected}) > 1
    assert ids_of(chat(spec, **options).choices[0]) == expected[0], "n = 1 must keep its seed"
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == sum(len(s) for s in expected)


def test_greedy_n_gives_identical_choices_and_disconnect_cancels_all(spec, monkeypatch):
    reply = chat(spec, n=2, max_tokens=6)
    assert reply.choices[0].message == reply.choices[1].message
    loop = loop_of(spec)
    with recording_rounds(loop, monkeypatch, delay_s=0.01) as seen:
        with chat(spec, n=3, max_tokens=400, stream=True) as stream:
            next(iter(stream))
        wait_until(lambda: loop.status().running == 0, "every choice's row to leave")
    rows = {id(row): row for row in seen if row.max_new_tokens == 400}.values()
    assert len(rows) == 3 and all(row.finish_reason == "abort" and len(row.output) < 400 for row in rows)


# --------------------------------------------------------------------------------------------------
# penalties and logit bias


@pytest.mark.parametrize("shaping", [
    {"presence_penalty": 1.5, "frequency_penalty": 0.7},
    {"repetition_penalty": 1.6, "frequency_penalty": -0.5},
    {"logit_bias": {"40": 3.0, "41": -100}},
])
def test_shaped_greedy_equals_plain_decoding(spec, plain, int8_served, shaping):
    unshaped = {"messages": MESSAGES, "max_tokens": 16, "return_token_ids": True}
    body = {**unshaped, **shaping}

    def ask(server_and_body) -> list[list[int]]:
        server, sent = server_and_body
        response = post_raw(server, json.dumps(sent), CHAT)
        assert response.status_code == 200, response.text
        return [choice["token_ids"] for choice in response.json()["choices"]]

    asks = [(spec, body), (spec, unshaped), (spec, {**body, "n": 2}), (plain, body)]
    with ThreadPoolExecutor(len(asks)) as pool:
        alone_spec, plain_unshaped, batched, alone_plain = pool.map(ask, asks)
    expected = shaped_greedy(
        int8_served, prompt_ids(int8_served), 16, presence=shaping.get("presence_penalty", 0.0),
        frequency=shaping.get("frequency_penalty", 0.0), repetition=shaping.get("repetition_penalty", 1.0),
        bias={int(k): v for k, v in shaping.get("logit_bias", {}).items()},
    )
    assert alone_spec == batched[:1] == batched[1:] == alone_plain == [expected]
    assert plain_unshaped != [expected], "the shaping had no effect"


def test_strong_logit_bias_forces_its_token(spec, int8_served):
    token = int8_served.tokenizer.convert_tokens_to_ids("Q")
    reply = chat(spec, max_tokens=5, logit_bias={str(token): 100}, extra_body={"return_token_ids": True})
    assert ids_of(reply.choices[0]) == [token] * 5 and reply.choices[0].message.content == "QQQQQ"


# --------------------------------------------------------------------------------------------------
# response_format


class Verdict(BaseModel):
    ok: bool
    size: int


def test_json_schema_output_parses_and_equals_plain_decoding(spec, plain):
    def parse(server):
        return client(server).chat.completions.parse(model="tiny", messages=MESSAGES, max_tokens=60,
                                                     response_format=Verdict)

    with ThreadPoolExecutor(3) as pool:
        free = pool.submit(chat, spec, max_tokens=20)
        replies = list(pool.map(parse, (spec, plain)))
    for reply in replies:
        assert reply.choices[0].finish_reason == "stop"
        assert isinstance(reply.choices[0].message.parsed, Verdict)
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    assert replies[0].choices[0].message.content != free.result().choices[0].message.content


def test_json_object_on_both_endpoints(spec):
    reply = chat(spec, max_tokens=60, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop" and isinstance(json.loads(reply.choices[0].message.content), dict)
    body = {"prompt": "json", "max_tokens": 60, "response_format": {"type": "json_object"}}
    completion = post_raw(spec, json.dumps(body)).json()["choices"][0]
    assert completion["finish_reason"] == "stop" and isinstance(json.loads(completion["text"]), dict)
    text = chat(spec, max_tokens=8, response_format={"type": "text"}).choices[0].message.content
    assert text == chat(spec, max_tokens=8).choices[0].message.content


def test_structured_outputs_need_a_tokenizer_llguidance_reads(llama):
    structured = StructuredOutputs.of(word_tokenizer(llama.eos_id), 96)
    with pytest.raises(APIError, match="response_format is not available") as error:
        structured.require("response_format")
    assert error.value.status == 400 and error.value.param == "response_format"


# --------------------------------------------------------------------------------------------------
# what is refused


def test_bad_fields_get_400_naming_them(spec):
    schema_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}
    chat_bodies = {
        "response_format": {"response_format": schema_format},
        "logit_bias": {"logit_bias": {"96": 1}},
        "top_logprobs": {"logprobs": True, "top_logprobs": 21},
        "n": {"n": 17},
        "presence_penalty": {"presence_penalty": 2.5},
        "repetition_penalty": {"repetition_penalty": 0},
        "frobnicate": {"frobnicate": 1},
    }
    for param, extra in chat_bodies.items():
        assert_error(post_raw(spec, json.dumps({"messages": MESSAGES, **extra}), CHAT), 400, param=param)
    reason = post_raw(spec, json.dumps({"messages": MESSAGES, "response_format": schema_format}), CHAT)
    assert "frob" in reason.json()["error"]["message"]
    for param, extra in {
        "top_logprobs": {"top_logprobs": 2},
        "logit_bias": {"logit_bias": {"w": 1}},
        "response_format": {"response_format": {"type": "xml"}},
    }.items():
        assert_error(post_raw(spec, json.dumps({"messages": MESSAGES, **extra}), CHAT), 400, param=param)
    completion_bodies = {"logprobs": {"logprobs": 21}, "suffix": {"suffix": "!"},
                         "logit_bias": {"logit_bias": {"1": 101}}}
    for param, extra in completion_bodies.items():
        assert_error(post_raw(spec, json.dumps({"prompt": "tell me", **extra})), 400, param=param)
