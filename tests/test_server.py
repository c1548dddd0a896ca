"""The HTTP server (``batchspec.server``) on tiny float64 models, all traffic on 127.0.0.1.

Outputs are compared with ``batchspec.generate`` run on each prompt alone: greedy serving must give the same
tokens however requests are admitted, batched, cancelled or failed around it.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest
import tiny_models
from serving import (
    TIMEOUT_S,
    Served,
    assert_error,
    client,
    free_port,
    healthy,
    loop_of,
    plain_prompts,
    post_raw,
    recording_rounds,
    wait_until,
)

import batchspec
from batchspec.bench.online import OnlineWorkload, run_online_benchmark
from batchspec.server import ServerConfig, create_app, serve_in_thread
from batchspec.server.text import TextTracker


@contextmanager
def running(served: Served, **options) -> Iterator:
    config = ServerConfig.of(**{"batch_size": 4, "num_draft_tokens": 4, "check_invariants": True, **options})
    with serve_in_thread(create_app(served.models, config)) as server:
        yield server


@pytest.fixture(scope="module", params=["eqspec", "exspec"])
def server(request, served):
    with running(served, method=request.param, window_size=8 if request.param == "exspec" else None) as server:
        yield server


@pytest.fixture(scope="module")
def eqspec_server(served):
    with running(served, method="eqspec") as server:
        yield server


def chunk_ids(chunk) -> list[int]:
    """The token ids of a stream chunk (the ``return_token_ids`` extension; the closing chunk has none)."""
    return getattr(chunk.choices[0], "token_ids", None) or []


# --------------------------------------------------------------------------------------------------
# outputs equal batchspec.generate


def test_completion_equals_generate(server, served):
    for prompt, max_tokens in zip(plain_prompts(3, seed=1), (40, 7, 60), strict=True):
        tokens, reason = served.reference(prompt, max_tokens)
        reply = client(server).completions.create(
            model="tiny", prompt=served.words(prompt), max_tokens=max_tokens, extra_body={"return_token_ids": True}
        )
        choice = reply.choices[0]
        assert choice.token_ids == tokens
        assert choice.prompt_token_ids == prompt
        assert choice.text == served.text(tokens)
        assert choice.finish_reason == reason
        assert reply.usage.completion_tokens == len(tokens) and reply.usage.prompt_tokens == len(prompt)


def test_token_id_prompt_and_eos_finish(server, served):
    prompts = tiny_models.random_prompts(30, seed=5, max_len=30)
    finished = ((p, served.reference(p, 40)) for p in prompts)
    prompt, (tokens, reason) = next((p, r) for p, r in finished if r[1] == "stop")
    reply = client(server).completions.create(model="tiny", prompt=prompt, max_tokens=40,
                                              extra_body={"return_token_ids": True})
    assert reply.choices[0].token_ids == tokens and tokens[-1] == served.models.target.generation_config.eos_token_id
    assert reply.choices[0].finish_reason == "stop"


def test_streaming_equals_generate(server, served):
    prompt = plain_prompts(1, seed=2)[0]
    tokens, reason = served.reference(prompt, 50)
    stream = client(server).completions.create(
        model="tiny", prompt=prompt, max_tokens=50, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in chunk_ids(c)]
    assert ids == tokens and text == served.text(tokens)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
    assert chunks[-1].usage.completion_tokens == len(tokens)
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 1, "the answer arrived in one piece"


def test_chat_equals_generate_on_the_templated_prompt(server, served):
    messages = [{"role": "system", "content": "w20 w21"}, {"role": "user", "content": "w30 w31 w32 w33"}]
    ids = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    tokens, reason = served.reference(ids, 30)
    reply = client(server).chat.completions.create(model="tiny", messages=messages, max_tokens=30)
    assert reply.choices[0].message.content == served.text(tokens)
    assert reply.choices[0].finish_reason == reason and reply.usage.prompt_tokens == len(ids)
    stream = client(server).chat.completions.create(model="tiny", messages=messages, max_tokens=30, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == served.text(tokens)
    assert chunks[-1].choices[0].finish_reason == reason


def test_sixteen_concurrent_clients_get_their_own_outputs(server, served):
    prompts = plain_prompts(16, seed=7)
    budgets = [10 + 7 * i % 50 for i in range(16)]
    expected = [served.reference(p, m)[0] for p, m in zip(prompts, budgets, strict=True)]
    rounds_before = dict(loop_of(server).engine.stats.rows_per_round_histogram)

    def ask(i: int) -> list[int]:
        if i % 2:
            stream = client(server).completions.create(
                model="tiny", prompt=prompts[i], max_tokens=budgets[i], stream=True,
                extra_body={"return_token_ids": True},
            )
            return [t for c in stream if c.choices for t in chunk_ids(c)]
        reply = client(server).completions.create(
            model="tiny", prompt=prompts[i], max_tokens=budgets[i], extra_body={"return_token_ids": True}
        )
        return reply.choices[0].token_ids

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, range(16)))
    assert got == expected
    after = loop_of(server).engine.stats.rows_per_round_histogram
    batched = sum(after.get(b, 0) - rounds_before.get(b, 0) for b in after if b > 1)
    assert batched > 0, "no round served more than one request"
    assert loop_of(server).status().running == 0
    assert loop_of(server).engine.stats.recomputed_columns == 0, "admission made running rows re-read their KV"


@pytest.mark.parametrize(("method", "chunk"), [("eqspec", 5), ("eqspec", "auto"), ("exspec", 5)])
def test_long_prompts_are_read_in_chunks_while_others_decode(served, method, chunk):
    """With 5 prompt columns per round (or as many as a decode round's time allows), prompts that arrive while a
    request decodes are read over several rounds between its rounds; every answer stays exact and the running row
    never re-reads its KV."""
    prompts = [p + p for p in plain_prompts(6, seed=41) if len(p) > 10]  # 22 to 80 tokens: several chunks each
    budget = 150
    candidates = (plain_prompts(1, seed=seed)[0] for seed in range(42, 142))
    first = next(p for p in candidates if len(served.reference(p, budget)[0]) == budget)  # decodes to the end
    expected = [served.reference(p, 12)[0] for p in prompts]
    with running(served, method=method, prefill_chunk=chunk) as server, ThreadPoolExecutor(len(prompts)) as pool:
        stream = client(server).completions.create(
            model="tiny", prompt=first, max_tokens=budget, stream=True, extra_body={"return_token_ids": True}
        )
        chunks = iter(stream)
        head = next(chunks)  # the first request is decoding now
        chunks_before = loop_of(server).engine.stats.prefill_chunks

        def ask(prompt: list[int]) -> list[int]:
            reply = client(server).completions.create(
                model="tiny", prompt=prompt, max_tokens=12, extra_body={"return_token_ids": True}
            )
            return reply.choices[0].token_ids

        got = list(pool.map(ask, prompts))
        streamed = [t for c in [head, *chunks] if c.choices for t in chunk_ids(c)]
        stats = loop_of(server).engine.stats
    assert got == expected
    assert streamed == served.reference(first, budget)[0]
    if chunk == 5:
        assert stats.prefill_chunks - chunks_before > len(prompts), "prompts should have been read in several chunks"
    assert stats.recomputed_columns == 0


def test_stop_string_cuts_text_and_tokens(server, served):
    prompt = plain_prompts(1, seed=11)[0]
    tokens, _ = served.reference(prompt, 40)
    full = served.text(tokens)
    stop = " ".join(full.split()[5:7])
    cut = full.index(stop)
    reply = client(server).completions.create(
        model="tiny", prompt=prompt, max_tokens=40, stop=[stop, "never-there"], extra_body={"return_token_ids": True}
    )
    assert reply.choices[0].text == full[:cut] and reply.choices[0].finish_reason == "stop"
    length = len(reply.choices[0].token_ids)
    assert reply.choices[0].token_ids == tokens[:length] and stop in served.text(tokens[:length])
    assert stop not in served.text(tokens[: length - 1])
    stream = client(server).completions.create(model="tiny", prompt=prompt, max_tokens=40, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == full[:cut]


def test_text_tracker_holds_back_partial_stop_strings():
    class Letters:
        def decode(self, tokens, skip_special_tokens=True):
            return "".join(chr(ord("a") + t) for t in tokens)

    tracker = TextTracker(Letters(), stop=("cde",))
    assert tracker.update([0, 1, 2], final=False).delta == "ab"  # "c" may begin the stop string
    update = tracker.update([0, 1, 2, 3, 4, 5], final=False)
    assert (update.delta, update.stop_tokens) == ("", 5)
    plain = TextTracker(Letters(), stop=("xyz",))
    assert plain.update([0, 23], final=False).delta == "a"
    assert plain.update([0, 23, 1], final=True).delta == "xb"


# --------------------------------------------------------------------------------------------------
# cancellation, failures, bad input, overload


def open_stream(url: str, prompt: list[int], max_tokens: int) -> tuple[http.client.HTTPConnection, object]:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True})
    connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    return connection, response


def cancelled_count(loop) -> float:
    return loop.metrics.registry.get_sample_value("batchspec_cancelled_requests_total")


def test_client_killed_mid_stream_frees_its_row(server, served, monkeypatch):
    loop = loop_of(server)
    victim = plain_prompts(1, seed=13)[0]
    others = plain_prompts(4, seed=17)
    expected = [served.reference(p, 30)[0] for p in others]
    cancelled_before = cancelled_count(loop)
    with recording_rounds(loop, monkeypatch, delay_s=0.01) as seen, ThreadPoolExecutor(4) as pool:
        connection, response = open_stream(server.url, victim, 400)
        assert response.readline().startswith(b"data: ")
        futures = [pool.submit(lambda p=p: client(server).completions.create(
            model="tiny", prompt=p, max_tokens=30, extra_body={"return_token_ids": True})) for p in others]
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
        got = [f.result(TIMEOUT_S).choices[0].token_ids for f in futures]
        wait_until(lambda: loop.status().running == 0, "every row to leave")
    assert got == expected
    row = next(r for r in seen if r.prompt == victim)
    assert row.finish_reason == "abort" and row.kv is None and len(row.output) < 400
    assert cancelled_count(loop) == cancelled_before + 1


def test_failing_round_gives_500_and_serving_goes_on(eqspec_server, served, monkeypatch):
    loop = loop_of(eqspec_server)
    poison = [11, 12, 13, 14, 15, 16]
    original = loop.engine.step

    def step(rows, **options):
        if any(row.prompt == poison for row in rows):
            raise RuntimeError("injected failure")
        original(rows, **options)

    monkeypatch.setattr(loop.engine, "step", step)
    with pytest.raises(openai.InternalServerError) as failure:
        client(eqspec_server).completions.create(model="tiny", prompt=poison, max_tokens=20)
    assert "injected failure" in failure.value.body["message"]
    response = httpx.post(f"{eqspec_server.url}/v1/completions", timeout=TIMEOUT_S,
                          json={"prompt": poison, "max_tokens": 20, "stream": True})
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
    healthy = plain_prompts(2, seed=19)
    for prompt in healthy:
        reply = client(eqspec_server).completions.create(model="tiny", prompt=prompt, max_tokens=25,
                                                         extra_body={"return_token_ids": True})
        assert reply.choices[0].token_ids == served.reference(prompt, 25)[0]
    assert httpx.get(f"{eqspec_server.url}/health").json()["status"] == "ok"
    assert loop.status().running == 0


def test_bad_requests_get_400_with_openai_errors(eqspec_server):
    assert_error(post_raw(eqspec_server, b'{"prompt": "w1", '), 400, code="invalid_json")
    assert_error(post_raw(eqspec_server, b"[1, 2]"), 400)
    bodies = {
        "max_tokens": {"prompt": "w10", "max_tokens": "many"},
        "n": {"prompt": "w10", "n": 17},
        "prompt": {"prompt": ""},
        "top_p": {"prompt": "w10", "top_p": 0},
        "frobnicate": {"prompt": "w10", "frobnicate": True},
        "stop": {"prompt": "w10", "stop": ["a", "b", "c", "d", "e"]},
    }
    for param, body in bodies.items():
        assert_error(post_raw(eqspec_server, json.dumps(body)), 400, param=param)
    assert_error(post_raw(eqspec_server, json.dumps({"prompt": [5, 999]})), 400, param="prompt")
    chat = {"messages": [{"role": "robot", "content": "w1"}]}
    assert_error(post_raw(eqspec_server, json.dumps(chat), "/v1/chat/completions"), 400, param="messages")
    assert_error(post_raw(eqspec_server, json.dumps({"prompt": "w10", "model": "other"})), 404, param="model")
    with pytest.raises(openai.BadRequestError):
        client(eqspec_server).completions.create(model="tiny", prompt="w10", max_tokens=0)


def test_context_overflow_gets_400(eqspec_server):
    context = tiny_models.MAX_POSITIONS
    too_long = {"prompt": [10] * context, "max_tokens": 1}
    assert_error(post_raw(eqspec_server, json.dumps(too_long)), 400, param="prompt", code="context_length_exceeded")
    overflow = {"prompt": [10] * 100, "max_tokens": context - 99}
    assert_error(post_raw(eqspec_server, json.dumps(overflow)), 400, param="max_tokens",
                 code="context_length_exceeded")
    fits = post_raw(eqspec_server, json.dumps({"prompt": [10] * 100, "max_tokens": 3}))
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] <= 3


def test_seeded_sampling_equals_generate_while_mixed_with_greedy(server, served):
    prompts = plain_prompts(8, seed=37)
    settings = [{"temperature": 0.8, "top_p": 0.9, "seed": 100 + i} if i % 2 else {} for i in range(8)]
    sampled = {"temperature": 1.3, "top_k": 20, "seed": 5}

    def expected(prompt, options) -> list[int]:
        if not options:
            return served.reference(prompt, 20)[0]
        top_p, top_k = options.get("top_p"), options.get("top_k")
        return batchspec.generate(
            served.models.target, served.models.draft, [prompt], max_new_tokens=20, num_draft_tokens=4,
            temperature=options["temperature"], top_p=top_p, top_k=top_k, seed=options["seed"],
        ).sequences[0]

    def ask(i: int) -> list[int]:
        options = sampled if i == 8 else settings[i]
        body = {"prompt": prompts[i % 8], "max_tokens": 20, "return_token_ids": True, **options}
        response = post_raw(server, json.dumps(body))
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(9) as pool:
        got = list(pool.map(ask, range(9)))
    assert got[:8] == [expected(p, o) for p, o in zip(prompts, settings, strict=True)]
    assert got[8] == expected(prompts[0], sampled)
    assert got[1] != expected(prompts[1], {**settings[1], "seed": 999}), "the seed had no effect"
    assert loop_of(server).status().running == 0


def test_sampling_fields_are_checked(eqspec_server):
    for param, body in {
        "temperature": {"prompt": "w10", "temperature": 2.5},
        "seed": {"prompt": "w10", "temperature": 1.0, "seed": -1},
        "top_k": {"prompt": "w10", "temperature": 1.0, "top_k": 0},
    }.items():
        assert_error(post_raw(eqspec_server, json.dumps(body)), 400, param=param)


def test_full_queue_gets_429_with_retry_after(served, monkeypatch):
    gate = threading.Event()
    with running(served, method="eqspec", batch_size=1, max_queue=1) as server, ThreadPoolExecutor(2) as pool:
        loop = loop_of(server)
        original = loop.engine.step
        monkeypatch.setattr(loop.engine, "step", lambda rows, **kw: (gate.wait(TIMEOUT_S), original(rows, **kw)))
        prompts = plain_prompts(2, seed=23)

        def ask(prompt):
            return post_raw(server, json.dumps({"prompt": prompt, "max_tokens": 12, "return_token_ids": True}))

        first = pool.submit(ask, prompts[0])
        wait_until(lambda: loop.status().running == 1, "the first request to be admitted")
        second = pool.submit(ask, prompts[1])
        wait_until(lambda: loop.status().queued == 1, "the second request to queue")
        rejected = post_raw(server, json.dumps({"prompt": "w10", "max_tokens": 4}))
        assert_error(rejected, 429, code="queue_full")
        assert int(rejected.headers["Retry-After"]) >= 1
        gate.set()
        for future, prompt in ((first, prompts[0]), (second, prompts[1])):
            answer = future.result(TIMEOUT_S)
            assert answer.status_code == 200
            assert answer.json()["choices"][0]["token_ids"] == served.reference(prompt, 12)[0]


def test_models_health_and_metrics(eqspec_server):
    models_ = httpx.get(f"{eqspec_server.url}/v1/models").json()
    assert [m["id"] for m in models_["data"]] == ["tiny"]
    assert models_["data"][0]["max_model_len"] == tiny_models.MAX_POSITIONS
    assert models_["data"][0]["batchspec"] == {"device": "cpu", "dtype": "float64", "quantize": "none", "build": "none",
                                                "forward": "transformers'", "draft_quantize": "none",
                                                "draft_tokenizer": "the target's"}
    assert httpx.get(f"{eqspec_server.url}/health").json()["status"] == "ok"
    client(eqspec_server).completions.create(model="tiny", prompt="w10 w12", max_tokens=8)
    text = httpx.get(f"{eqspec_server.url}/metrics").text
    for name in (
        'batchspec_requests_total{endpoint="/v1/completions",status="200"}', "batchspec_completion_tokens_total",
        "batchspec_request_latency_seconds_bucket", "batchspec_time_to_first_token_seconds_count",
        "batchspec_queue_depth", "batchspec_batch_occupancy_bucket", "batchspec_draft_acceptance_rate",
        "batchspec_generation_tokens_per_second",
    ):
        assert name in text, name
    rate = next(float(line.split()[1]) for line in text.splitlines() if line.startswith("batchspec_draft_acc"))
    assert 0.0 < rate <= 1.0


# --------------------------------------------------------------------------------------------------
# online benchmark and the serve command


def test_online_benchmark_reports_each_method(served):
    prompts = plain_prompts(6, seed=29)
    workload = OnlineWorkload(prompts, rate=40.0, requests=6, max_tokens=16, arrival_seed=1)
    result = run_online_benchmark(workload, models=served.models, methods=("eqspec", "exspec"), batch_size=2,
                                  num_draft_tokens=3, warmup=0)
    expected_tokens = sum(len(served.reference(p, 16)[0]) for p in prompts)
    assert [r.method for r in result.results] == ["eqspec", "exspec"]
    for method in result.results:
        assert method.failed == 0 and method.requests == 6
        assert method.output_tokens == expected_tokens
        assert 0 < method.ttft_s.p50 <= method.latency_s.p50 <= method.latency_s.p99
        assert method.throughput_tokens_per_s > 0 and 0 < method.acceptance_rate <= 1
    assert json.loads(result.to_json())["results"][1]["latency_s"]["p90"] > 0


def test_serve_command_help_and_errors(tmp_path):
    import typer
    from typer.testing import CliRunner

    from batchspec.cli.serve import serve_command

    app = typer.Typer()
    app.command("serve")(serve_command)
    app.command("unused")(lambda: None)
    runner = CliRunner()
    usage = runner.invoke(app, ["serve", "--help"])
    assert usage.exit_code == 0
    for option in ("--host", "--port", "--method", "--max-batch-size", "--max-queue", "--num-draft-tokens", "--dtype"):
        assert option in usage.output, option
    assert runner.invoke(app, ["serve", "--max-batch-size", "0"]).exit_code == 2
    missing = runner.invoke(app, ["serve", "--target", str(tmp_path / "nope"), "--draft", str(tmp_path / "nope")])
    assert missing.exit_code == 1 and "Error: " in missing.output and "does not exist" in missing.output


def test_serve_forever_drives_rounds_on_the_calling_thread_and_sigterm_ends_it(served, monkeypatch):
    config = ServerConfig.of(batch_size=4, num_draft_tokens=4)
    app = create_app(served.models, config)
    loop = loop_of(app=app)
    drivers: set[str] = set()
    step = loop.engine.step

    def recorded(rows, **options):
        drivers.add(threading.current_thread().name)
        step(rows, **options)

    monkeypatch.setattr(loop.engine, "step", recorded)
    port, prompt, answers, served_out = free_port(), plain_prompts(1, seed=37)[0], [], threading.Event()

    def ask_then_terminate() -> None:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: served_out.is_set() or healthy(url), "the server to start")
            reply = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": served.words(prompt),
                               "max_tokens": 12, "return_token_ids": True}, timeout=TIMEOUT_S)
            answers.append(reply.json()["choices"][0]["token_ids"])
        finally:
            if not served_out.is_set():  # SIGTERM reaches serve_forever's handler, never pytest's default
                os.kill(os.getpid(), signal.SIGTERM)

    asker = threading.Thread(target=ask_then_terminate)
    asker.start()
    try:
        batchspec.server.serve_forever(app, "127.0.0.1", port, log_level="warning")
    finally:
        served_out.set()
    asker.join(TIMEOUT_S)
    assert answers == [served.reference(prompt, 12)[0]]
    assert drivers == {threading.main_thread().name}
    assert not loop.status().alive


def test_serve_forever_on_a_taken_port_raises_and_stops_its_loop(served):
    app = create_app(served.models, ServerConfig.of(batch_size=2))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"could not start on 127.0.0.1:{port}"):
            batchspec.server.serve_forever(app, "127.0.0.1", port, log_level="critical")
    assert not loop_of(app=app).status().alive


def test_sigterm_drains_the_request_in_flight_and_exits_0(served_dirs, served):
    port = free_port()
    command = [
        sys.executable, "-c", "import typer; from batchspec.cli.serve import serve_command; typer.run(serve_command)",
        "--target", str(served_dirs["target"]), "--draft", str(served_dirs["draft"]),  # --dtype auto
        "--port", str(port), "--served-model-name", "tiny", "--max-batch-size", "2", "--log-level", "warning",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: process.poll() is not None or healthy(url), "the server to start", timeout=120)
        assert process.poll() is None, process.communicate()[1]
        connection, response = open_stream(url, plain_prompts(1, seed=31)[0], 300)
        assert response.readline().startswith(b"data: ")
        process.send_signal(signal.SIGTERM)
        events = [line for line in response.read().decode().splitlines() if line.startswith("data: ")]
        connection.close()
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")
        assert process.wait(TIMEOUT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
        _, stderr = process.communicate(timeout=TIMEOUT_S)
    assert "Traceback" not in stderr
    assert f"Serving tiny (float32) on http://127.0.0.1:{port}/v1" in stderr


