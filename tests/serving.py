"""Helpers for the server tests: the word tokenizer the tiny models are served with, the served models with their
``batchspec.generate`` references, and small HTTP helpers (clients, raw posts and raw socket exchanges, error
checks, waiting, free ports).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import tiny_models
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import batchspec
from batchspec.models import ModelPair

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)
ROLE_WORDS = ("user", "assistant", "system")
TIMEOUT_S = 60.0


def word_tokenizer(eos_id: int) -> PreTrainedTokenizerFast:
    """One word per token id (``w0`` … ``w95``), so decoding is injective; EOS, unk and the chat roles are
    words of their own; a chat template that writes ``role content`` per message."""
    words = [f"w{i}" for i in range(tiny_models.VOCAB_SIZE)]
    free = iter(i for i in range(1, tiny_models.VOCAB_SIZE) if i != eos_id)
    words[eos_id] = "</s>"
    for word in ("<unk>", *ROLE_WORDS):
        words[next(free)] = word
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def byte_tokenizer(eos_id: int) -> PreTrainedTokenizerFast:
    """One printable ASCII character per token id (95 of them, byte-level like GPT-2's, so that llguidance can read
    it and JSON can be written), EOS at ``eos_id``; the word tokenizer's chat template."""
    chars = iter("Ġ" if code == ord(" ") else chr(code) for code in range(ord(" "), ord("~") + 1))
    vocab = {("</s>" if i == eos_id else next(chars)): i for i in range(tiny_models.VOCAB_SIZE)}
    backend = Tokenizer(models.BPE(vocab, [], unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@dataclass
class Served:
    """The served models, their tokenizer, and ``batchspec.generate`` references (cached)."""

    models: ModelPair
    cache: dict

    @property
    def tokenizer(self) -> PreTrainedTokenizerFast:
        return self.models.tokenizer

    def reference(self, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        key = (tuple(prompt), max_tokens)
        if key not in self.cache:
            result = batchspec.generate(
                self.models.target, self.models.draft, [prompt], max_new_tokens=max_tokens, num_draft_tokens=4
            )
            reason = "stop" if result.finish_reasons[0] == "eos" else "length"
            self.cache[key] = (result.sequences[0], reason)
        return self.cache[key]

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def words(self, prompt: list[int]) -> str:
        return " ".join(self.tokenizer.convert_ids_to_tokens(prompt))


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


def loop_of(server=None, *, app=None):
    return (app or server.app).state.serving.loop


def plain_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts of ordinary words only (no EOS, no unk, no role words), 1 to 40 tokens."""
    return [[t % 80 + 10 for t in p] for p in tiny_models.random_prompts(n, seed, max_len=40)]


def wait_until(condition, what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@contextmanager
def recording_rounds(loop, monkeypatch, delay_s: float = 0.0) -> Iterator[list]:
    """Wrap the engine's ``step``: remember every row it ran, optionally slowing every round down."""
    seen: list = []
    original = loop.engine.step

    def step(rows, **options):
        seen.extend(rows)
        time.sleep(delay_s)
        original(rows, **options)

    monkeypatch.setattr(loop.engine, "step", step)
    yield seen


def post_raw(server, body: bytes | str, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=body, headers={"Content-Type": "application/json"},
                      timeout=TIMEOUT_S)


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def address(server) -> tuple[str, int]:
    host, port = server.url.split("://")[1].split(":")
    return host, int(port)


def raw_exchange(server, data: bytes, timeout: float = TIMEOUT_S) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it."""
    with socket.create_connection(address(server), timeout=timeout) as sock:
        sock.sendall(data)
        return read_until_closed(sock)


def read_until_closed(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def assert_raw_error(raw: bytes, status: int, code: str) -> None:
    got, headers, body = parse_response(raw)
    assert got == status, raw[:300]
    assert headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["code"] == code and error["message"] and set(error) == {"message", "type", "param", "code"}
