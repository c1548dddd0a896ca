"""The server on a network: API key, TLS, CORS, the Host check, body and prompt limits, timeouts, connection cap,
shutdown timeout, bounded metrics and sampling values at the edge. All traffic on 127.0.0.1, every wait bounded.

The ``served`` and ``served_dirs`` fixtures come from ``test_server`` (imported, hence ruff's F401/F811 are off here).
"""

from __future__ import annotations

import datetime
import importlib.util
import ipaddress
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import tiny_models
from serving import (
    TIMEOUT_S,
    Served,
    address,
    assert_error,
    assert_raw_error,
    client,
    free_port,
    healthy,
    loop_of,
    parse_response,
    plain_prompts,
    post_raw,
    raw_exchange,
    read_until_closed,
    recording_rounds,
    wait_until,
)

import batchspec
from batchspec.models import ModelPair
from batchspec.server import ServerConfig, create_app, serve_in_thread
from batchspec.server.hosting import HttpOptions
from batchspec.server.limits import RequestLimits
from batchspec.server.security import LOOPBACK_NAMES, SecurityConfig, host_name, is_loopback

KEY = "sk-test-0123456789"
REPO = Path(__file__).resolve().parents[1]


def serving(served: Served, *, http: HttpOptions | None = None, **options):
    config = ServerConfig.of(**{"batch_size": 4, "num_draft_tokens": 4, **options})
    return serve_in_thread(create_app(served.models, config), http=http or HttpOptions())


# --------------------------------------------------------------------------------------------------
# who may use the server


def test_api_key_guards_everything_but_health(served):
    with serving(served, security=SecurityConfig(api_key=KEY)) as server:
        for path in ("/v1/models", "/metrics", "/docs", "/no/such/path"):
            refused = httpx.get(f"{server.url}{path}", timeout=TIMEOUT_S)
            assert_error(refused, 401, code="invalid_api_key")
            assert refused.headers["www-authenticate"] == "Bearer"
        for value in (f"Bearer {KEY}x", f"Basic {KEY}", KEY, "Bearer"):
            wrong = httpx.get(f"{server.url}/v1/models", headers={"Authorization": value}, timeout=TIMEOUT_S)
            assert_error(wrong, 401, code="invalid_api_key")
        assert httpx.get(f"{server.url}/health", timeout=TIMEOUT_S).status_code == 200
        authorized = {"Authorization": f"bearer {KEY}"}
        assert httpx.get(f"{server.url}/metrics", headers=authorized, timeout=TIMEOUT_S).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            client(server).models.list()
        keyed = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S)
        prompt = plain_prompts(1, seed=41)[0]
        reply = keyed.completions.create(model="tiny", prompt=prompt, max_tokens=9,
                                         extra_body={"return_token_ids": True})
        assert reply.choices[0].token_ids == served.reference(prompt, 9)[0]
        text = httpx.get(f"{server.url}/metrics", headers=authorized, timeout=TIMEOUT_S).text
        assert 'batchspec_requests_total{endpoint="/v1/models",status="401"}' in text


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A key and a certificate for 127.0.0.1 (PEM), made with ``cryptography``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .sign(key, hashes.SHA256())
    )
    keyfile, certfile = directory / "key.pem", directory / "cert.pem"
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    certfile.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return keyfile, certfile


def test_https_with_a_self_signed_certificate(served, tmp_path):
    keyfile, certfile = self_signed_certificate(tmp_path)
    http = HttpOptions(ssl_keyfile=str(keyfile), ssl_certfile=str(certfile))
    with serving(served, http=http) as server:
        assert server.url.startswith("https://127.0.0.1:")
        trust = ssl.create_default_context(cafile=str(certfile))
        assert httpx.get(f"{server.url}/health", verify=trust, timeout=TIMEOUT_S).json()["status"] == "ok"
        reply = httpx.post(f"{server.url}/v1/completions", verify=trust, timeout=TIMEOUT_S,
                           json={"prompt": "w10 w11", "max_tokens": 4})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 4
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health", timeout=TIMEOUT_S)  # the system store does not trust it
    with pytest.raises(ValueError, match="both"):
        HttpOptions(ssl_certfile=str(certfile))
    with pytest.raises(ValueError, match="does not exist"):
        HttpOptions(ssl_keyfile=str(tmp_path / "nope.pem"), ssl_certfile=str(certfile))


def test_cors_for_allowed_origins_only(served):
    origin = "https://app.example.com"
    with serving(served, security=SecurityConfig(api_key=KEY, allowed_origins=(origin,))) as server:
        preflight = httpx.options(f"{server.url}/v1/chat/completions", timeout=TIMEOUT_S, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        })
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == origin
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        keyed = {"Authorization": f"Bearer {KEY}"}
        allowed = httpx.get(f"{server.url}/v1/models", headers={**keyed, "Origin": origin}, timeout=TIMEOUT_S)
        assert allowed.headers["access-control-allow-origin"] == origin
        refused = httpx.get(f"{server.url}/v1/models", headers={"Origin": origin}, timeout=TIMEOUT_S)
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == origin
        other = httpx.get(f"{server.url}/v1/models", headers={**keyed, "Origin": "https://evil.example"},
                          timeout=TIMEOUT_S)
        assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    with pytest.raises(ValueError, match="origins"):
        SecurityConfig(allowed_origins=("app.example.com",))


def test_loopback_server_refuses_foreign_host_names(served):
    with serving(served) as server:
        for host in ("localhost", "localhost:8000", "127.0.0.1:1", "[::1]:8000", "LOCALHOST."):
            assert httpx.get(f"{server.url}/health", headers={"Host": host}, timeout=TIMEOUT_S).status_code == 200
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost:abc"):
            refused = httpx.get(f"{server.url}/v1/models", headers={"Host": host}, timeout=TIMEOUT_S)
            assert_error(refused, 421, code="invalid_host")
    assert SecurityConfig.for_bind("127.0.0.1").allowed_hosts == LOOPBACK_NAMES
    assert SecurityConfig.for_bind("::1").allowed_hosts == LOOPBACK_NAMES
    assert SecurityConfig.for_bind("0.0.0.0").allowed_hosts is None
    assert SecurityConfig.for_bind("0.0.0.0", allowed_hosts=("API.example.com.",)).allowed_hosts == (
        *LOOPBACK_NAMES, "api.example.com")
    assert SecurityConfig.for_bind("localhost", allowed_hosts=("*",)).allowed_hosts is None
    assert is_loopback("127.0.0.2") and not is_loopback("10.0.0.1") and not is_loopback("example.com")
    assert host_name("[::1]:8000") == "::1" and host_name("a:b") is None


def test_serve_command_options_and_their_errors(tmp_path):
    import typer
    from typer.testing import CliRunner

    from batchspec.cli.serve import serve_command

    app = typer.Typer()
    app.command("serve")(serve_command)
    app.command("unused")(lambda: None)
    runner = CliRunner()
    usage = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    for option in ("--api-key", "BATCHSPEC_API_KEY", "--allowed-origins", "--allowed-hosts", "--ssl-keyfile",
                   "--ssl-certfile", "--max-body-bytes", "--head-timeout", "--read-timeout", "--keep-alive-timeout",
                   "--max-connections", "--max-idle-connections", "--max-messages", "--max-content-parts",
                   "--request-timeout", "--default-max-tokens", "--shutdown-timeout"):
        assert option in usage.output, option
    pem = tmp_path / "cert.pem"
    pem.write_text("not used")
    for arguments, message in (
        (["--ssl-certfile", str(pem)], "HTTPS needs both"),
        (["--ssl-keyfile", str(tmp_path / "none.pem"), "--ssl-certfile", str(pem)], "does not exist"),
        (["--allowed-origins", "ftp://files.example"], "allowed origins"),
        (["--api-key", " spaced "], "API key"),
    ):
        failed = runner.invoke(app, ["serve", *arguments])
        assert failed.exit_code == 1 and failed.output.startswith("Error: ") and message in failed.output, failed.output
        assert failed.output.count("\n") == 1
    for option in ("--max-body-bytes", "--max-connections", "--max-idle-connections", "--max-messages",
                   "--max-content-parts", "--head-timeout"):
        assert runner.invoke(app, ["serve", option, "0"]).exit_code == 2, option


# --------------------------------------------------------------------------------------------------
# body and prompt limits


@pytest.fixture(scope="module")
def small_body_server(served):
    limits = RequestLimits(max_body_bytes=16384, read_timeout_s=1.0)
    with serving(served, limits=limits, http=HttpOptions(head_timeout_s=1.0, keep_alive_timeout_s=1)) as server:
        yield server


def post_head(server, extra: str) -> bytes:
    host, port = address(server)
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"{extra}\r\n").encode()


def test_body_over_the_limit_gets_413_before_it_is_read(small_body_server):
    declared = raw_exchange(small_body_server, post_head(small_body_server, "Content-Length: 20000000\r\n"))
    assert_raw_error(declared, 413, "request_too_large")
    chunk = b"x" * 16385
    chunked = post_head(small_body_server, "Transfer-Encoding: chunked\r\n") + b"%x\r\n%s\r\n" % (len(chunk), chunk)
    assert_raw_error(raw_exchange(small_body_server, chunked), 413, "request_too_large")
    fits = post_raw(small_body_server, json.dumps({"prompt": [10] * 400, "max_tokens": 2}))
    assert fits.status_code == 200


def test_slow_head_and_slow_body_are_cut_off(small_body_server):
    host, port = address(small_body_server)
    started = time.monotonic()
    assert raw_exchange(small_body_server, b"") == b""  # sent nothing: closed after the head timeout
    assert raw_exchange(small_body_server, f"GET /health HTTP/1.1\r\nHost: {host}\r\n".encode()) == b""
    assert time.monotonic() - started < TIMEOUT_S
    half_body = post_head(small_body_server, "Content-Length: 100\r\n") + b'{"prompt": '
    assert_raw_error(raw_exchange(small_body_server, half_body), 408, "read_timeout")
    answered = raw_exchange(small_body_server, f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    assert parse_response(answered)[0] == 200  # and then closed, idle after its answer


class GatedTokenizer:
    """The tiny tokenizer, holding every text encoding until ``gate`` opens; counts the encodings."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.calls = 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.entered.set()
        self.gate.wait(TIMEOUT_S)
        return self.inner(*args, **kwargs)


def test_tokenizing_does_not_hold_up_other_clients(served):
    gated = GatedTokenizer(served.tokenizer)
    models = ModelPair(served.models.target, served.models.draft, gated, "tiny", "float64")
    with serve_in_thread(create_app(models, ServerConfig.of(batch_size=2))) as server, ThreadPoolExecutor(1) as pool:
        held = pool.submit(post_raw, server, json.dumps({"prompt": "w10 w11 w12", "max_tokens": 3}))
        assert gated.entered.wait(TIMEOUT_S)
        assert httpx.get(f"{server.url}/health", timeout=2).status_code == 200
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": [10, 11], "max_tokens": 2},
                          timeout=TIMEOUT_S).status_code == 200
        gated.gate.set()
        assert held.result(TIMEOUT_S).status_code == 200
        calls = gated.calls
        too_long = "w10 " * 5000  # 20,000 characters: more than 512 tokens of at most 9 characters
        assert_error(post_raw(server, json.dumps({"prompt": too_long})), 400, param="prompt",
                     code="context_length_exceeded")
        chat = {"messages": [{"role": "user", "content": too_long}]}
        assert_error(post_raw(server, json.dumps(chat), "/v1/chat/completions"), 400, param="messages",
                     code="context_length_exceeded")
        assert gated.calls == calls, "a prompt that cannot fit was tokenized"


def resident_bytes() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024


def test_health_answers_while_big_bodies_are_refused_and_memory_comes_back(served):
    with serving(served) as server:
        huge = json.dumps({"prompt": "w10 " * 750_000}).encode()  # 3 MB: under the body limit, too long a prompt
        assert_error(post_raw(server, huge), 400, param="prompt", code="context_length_exceeded")
        before = resident_bytes()

        def upload() -> None:  # 5 MB in chunks, past the 4 MiB limit: refused on the way
            head = post_head(server, "Transfer-Encoding: chunked\r\n")
            piece = b"x" * 65536
            with socket.create_connection(address(server), timeout=TIMEOUT_S) as sock:
                try:
                    sock.sendall(head)
                    for _ in range(80):
                        sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                        time.sleep(0.005)
                except OSError:
                    pass

        with ThreadPoolExecutor(2) as pool:
            uploads = [pool.submit(upload) for _ in range(2)]
            while not all(u.done() for u in uploads):
                assert httpx.get(f"{server.url}/health", timeout=2).status_code == 200
            for _ in range(5):
                assert_error(post_raw(server, huge), 400, param="prompt", code="context_length_exceeded")
        assert resident_bytes() - before < 200 * 2**20


# --------------------------------------------------------------------------------------------------
# timeouts, budgets, connections, shutdown


def test_request_timeout_ends_slow_requests_with_504(served, monkeypatch):
    prompt = plain_prompts(1, seed=43)[0]
    with serving(served, limits=RequestLimits(request_timeout_s=0.5)) as server:
        loop = loop_of(server)
        with recording_rounds(loop, monkeypatch, delay_s=0.2):
            body = {"prompt": prompt, "max_tokens": 400}
            assert_error(post_raw(server, json.dumps(body)), 504, code="request_timeout")
            stream = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT_S)
            assert stream.status_code == 200
            events = [line for line in stream.text.splitlines() if line.startswith("data: ")]
            assert json.loads(events[-1][6:])["error"]["code"] == "request_timeout"
            wait_until(lambda: loop.status().running == 0, "the timed-out rows to leave")
        monkeypatch.undo()
        reply = post_raw(server, json.dumps({"prompt": prompt, "max_tokens": 6, "return_token_ids": True}))
        assert reply.json()["choices"][0]["token_ids"] == served.reference(prompt, 6)[0]


def test_default_max_tokens_is_finite_and_capped_by_the_context(served):
    prompt = plain_prompts(1, seed=47)[0]
    with serving(served, limits=RequestLimits(default_max_tokens=7)) as server:
        reply = post_raw(server, json.dumps({"prompt": prompt, "return_token_ids": True})).json()
        assert reply["choices"][0]["token_ids"] == served.reference(prompt, 7)[0]
        long_prompt = [10] * (tiny_models.MAX_POSITIONS - 2)
        assert post_raw(server, json.dumps({"prompt": long_prompt})).json()["usage"]["completion_tokens"] <= 2
    assert ServerConfig().limits.default_max_tokens == 512


def test_shutdown_timeout_ends_requests_in_flight_with_503(served, monkeypatch):
    gate = threading.Event()
    gate.set()
    with serving(served, shutdown_timeout_s=1.0) as server, ThreadPoolExecutor(2) as pool:
        loop = loop_of(server)
        original = loop.engine.step
        monkeypatch.setattr(loop.engine, "step", lambda rows, **kw: (gate.wait(TIMEOUT_S), original(rows, **kw)))
        try:
            connection, response = open_stream_on(server, plain_prompts(1, seed=53)[0])
            gate.clear()
            waiting = pool.submit(post_raw, server, json.dumps({"prompt": [10, 11, 12], "max_tokens": 50}))
            half_body = pool.submit(raw_exchange, server, post_head(server, "Content-Length: 100\r\n") + b"{")
            wait_until(lambda: len(server.server.server_state.tasks) >= 3, "three requests to be in")
            server.stop(TIMEOUT_S)
            assert_error(waiting.result(TIMEOUT_S), 503, code="shutting_down")
            assert_raw_error(half_body.result(TIMEOUT_S), 503, "shutting_down")
            events = [line for line in response.read().decode().splitlines() if line.startswith("data: ")]
            connection.close()
            assert json.loads(events[-1][6:])["error"]["code"] == "shutting_down"
        finally:
            gate.set()


def open_stream_on(server, prompt: list[int]):
    import http.client

    host, port = address(server)
    connection = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
    body = json.dumps({"prompt": prompt, "max_tokens": 400, "stream": True})
    connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    return connection, response


def test_sigterm_with_shutdown_timeout_cuts_off_a_half_sent_body(served_dirs):
    port = free_port()
    command = [
        sys.executable, "-c", "import typer; from batchspec.cli.serve import serve_command; typer.run(serve_command)",
        "--target", str(served_dirs["target"]), "--draft", str(served_dirs["draft"]), "--dtype", "float32",
        "--port", str(port), "--served-model-name", "tiny", "--log-level", "warning", "--shutdown-timeout", "1",
        "--read-timeout", "600",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "BATCHSPEC_API_KEY": KEY}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: process.poll() is not None or healthy(url), "the server to start", timeout=120)
        assert process.poll() is None, process.communicate()[1]
        assert httpx.get(f"{url}/v1/models", timeout=TIMEOUT_S).status_code == 401
        keyed = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT_S)
        assert keyed.status_code == 200
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
            sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {KEY}"
                          "\r\nContent-Length: 100\r\n\r\n{").encode())
            assert healthy(url)  # answered after the half-sent request's head was read
            process.send_signal(signal.SIGTERM)
            assert_raw_error(read_until_closed(sock), 503, "shutting_down")
        assert process.wait(30) == 0  # read timeout 600 s: only the 1 s shutdown timeout ends that request
    finally:
        if process.poll() is None:
            process.kill()
        _, stderr = process.communicate(timeout=TIMEOUT_S)
    assert "Traceback" not in stderr


# --------------------------------------------------------------------------------------------------
# metrics and sampling values


def test_metrics_stay_bounded_whatever_paths_clients_send(served):
    with serving(served) as server:
        client(server).completions.create(model="tiny", prompt="w10 w12", max_tokens=2)
        httpx.get(f"{server.url}/no-such-path-0", timeout=TIMEOUT_S)
        before = len(httpx.get(f"{server.url}/metrics", timeout=TIMEOUT_S).content)
        with httpx.Client(timeout=TIMEOUT_S) as session:
            for i in range(100):
                assert session.get(f"{server.url}/no-such-path-{i}/{'x' * (i % 50)}").status_code == 404
            assert session.get(f"{server.url}/v1/completions").status_code == 405
        text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT_S).text
    assert len(text.encode()) - before < 2048
    assert 'batchspec_requests_total{endpoint="unmatched",status="404"} 101.0' in text
    assert 'batchspec_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
    assert 'endpoint="/v1/completions",status="405"' in text
    assert "no-such-path" not in text
    assert "process_resident_memory_bytes" in text


def test_sampling_values_at_the_edge_never_fail_a_round(served):
    prompt = plain_prompts(1, seed=59)[0]
    greedy = served.reference(prompt, 12)[0]
    with serving(served, method="eqspec") as server:
        for options in ({"temperature": 5e-324}, {"temperature": 1e-300, "top_p": 5e-324},
                        {"temperature": 1e-12, "top_k": 10**12}, {"temperature": 2.0, "top_p": 1e-300}):
            body = {"prompt": prompt, "max_tokens": 12, "seed": 3, "return_token_ids": True, **options}
            reply = post_raw(server, json.dumps(body))
            assert reply.status_code == 200, (options, reply.text)
            expected = batchspec.generate(
                served.models.target, served.models.draft, [prompt], max_new_tokens=12, num_draft_tokens=4, seed=3,
                temperature=options["temperature"], top_p=options.get("top_p"), top_k=options.get("top_k"),
            ).sequences[0]
            assert reply.json()["choices"][0]["token_ids"] == expected, options
            if options["temperature"] < 1e-200:
                assert expected == greedy
        for raw, param in ((b'{"prompt": "w1", "temperature": NaN}', "temperature"),
                           (b'{"prompt": "w1", "temperature": 1e400}', "temperature"),
                           (b'{"prompt": "w1", "temperature": 1, "top_p": -Infinity}', "top_p"),
                           (b'{"prompt": "w1", "temperature": 1, "top_p": 4.9e-325}', "top_p")):
            assert_error(post_raw(server, raw), 400, param=param)
        assert loop_of(server).metrics.registry.get_sample_value("batchspec_failed_requests_total") == 0


# --------------------------------------------------------------------------------------------------
# the locust load test


def test_locustfile_checks_every_answer_against_its_reference(served):
    if importlib.util.find_spec("locust") is None:  # not imported here: importing locust monkey-patches with gevent
        pytest.skip("locust is not installed (pip install -e '.[load]')")
    with serving(served, security=SecurityConfig(api_key=KEY)) as server:
        command = [
            sys.executable, "-m", "locust", "-f", str(REPO / "scripts" / "locustfile.py"), "--host", server.url,
            "--headless", "--users", "4", "--spawn-rate", "4", "--run-time", "300s", "--only-summary",
            "--requests", "16", "--max-tokens", "12", "--prompts", "2", "--model", "tiny",
            "--abusive", "2", "--abusive-body-bytes", "200000",
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "BATCHSPEC_API_KEY": KEY})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        metrics = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    output = done.stdout + done.stderr
    assert "references: 8 requests answered one at a time" in output
    assert "batchspec load test: 16 answers, 0 failures (0 differ from their reference: greedy 0, seeded 0)" in output
    assert "server RSS start" in output and "after the references" in output
    assert re.search(r"abusive clients: [1-9]\d* actions \(.*\), 0 unexpected; /health slowest \d+ ms", output), (
        output[-2000:])
    assert re.search(r"after each quarter of the answers [\d,]+ / [\d,]+ / [\d,]+ / [\d,]+ MiB", output), output[-2000:]
    answered = sum(float(line.split()[1]) for line in metrics.splitlines()
                   if line.startswith("batchspec_requests_total") and 'status="200"' in line and "/v1/" in line)
    assert answered >= 8 + 16
