"""The request record: one prompt (or one HTTP request of ``n`` choices) with its budget and how it samples, the one
record ``batchspec.generate``, the server and the adapters hand the engine, which makes its rows of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchspec.config import SamplingParams, require_int
from batchspec.engine.grammar import Grammar
from batchspec.engine.penalties import Penalties
from batchspec.engine.sampling import derive_row_seeds
from batchspec.engine.state import Sequence


@dataclass(frozen=True)
class GenerationParams:
    """One request as the engine sees it, from ``batchspec.generate`` (one per prompt), the server (one per HTTP
    request, of ``n`` choices) or an adapter: what its rows (:class:`~batchspec.engine.state.Sequence`) are made of.

    Attributes:
        prompt: token ids, non-empty (the server has checked them against the context length).
        max_tokens: new tokens at most (>= 0; 0 only reads the prompt, for ``prompt_logprobs``).
        stop: strings that end the output (the text is cut before the first one found).
        sampling: temperature, top-k and top-p; the default (temperature 0) is greedy decoding.
        seed: the request's seed; the row's seed is derived from it as ``batchspec.generate(..., seed=seed)``
            derives it for a single prompt, so both give the same tokens. None draws a fresh seed.
        cache_namespace: which requests may share cached prompt prefixes with this one (one API key and
            ``cache_salt``: :func:`batchspec.server.security.cache_namespace`).
        penalties: presence, frequency and repetition penalties and the logit bias (default: none).
        grammar: the grammar the output must follow (structured outputs, tool calls), or None.
        logprobs: None for no logprobs; else how many top alternatives each output token reports (0: its own only).
        prompt_logprobs: likewise for the prompt's tokens after the first (completions' ``echo``); each choice's
            row reads the prompt once more for them.
        n: how many choices (rows) to generate for the prompt; choice ``i`` samples with ``row_seeds()[i]``.
    """

    prompt: list[int]
    max_tokens: int
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    cache_namespace: str = ""
    penalties: Penalties = field(default_factory=Penalties)
    grammar: Grammar | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("prompt must hold at least one token")
        require_int("max_tokens", self.max_tokens, minimum=0)
        if self.n < 1:
            raise ValueError(f"n must be >= 1; got {self.n}")

    def row_seeds(self) -> list[int]:
        """One seed per choice, as ``batchspec.generate(..., seed=seed)`` derives them for ``n`` prompts (so
        choice 0's seed is the one a lone ``n = 1`` request gets)."""
        return derive_row_seeds(self.seed, self.n)

    def sequence(self, index: int, seed: int) -> Sequence:
        """Row ``index`` of this request, sampling with ``seed`` (one of :meth:`row_seeds`, or the seed
        ``batchspec.generate`` derived for the prompt)."""
        return Sequence(
            index, list(self.prompt), self.max_tokens, sampling=self.sampling, row_seed=seed, penalties=self.penalties,
            grammar=self.grammar, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
            prefix_namespace=self.cache_namespace,
        )
