"""Validated configuration of one generation run."""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

WINDOW_MULTIPLE = 4
# the n-gram lengths prompt lookup matches by default, longest first (engine/lookup.py)
DEFAULT_MAX_NGRAM = 5
DEFAULT_MIN_NGRAM = 1


def default_cache_dir() -> Path:
    """``$BATCHSPEC_CACHE``, else ``$XDG_CACHE_HOME/batchspec``, else ``~/.cache/batchspec``."""
    explicit = os.environ.get("BATCHSPEC_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "batchspec"
    return Path.home() / ".cache" / "batchspec"


class Method(StrEnum):
    """How batches are formed (and whether a draft proposes at all)."""

    AUTOREGRESSIVE = "autoregressive"
    EQSPEC = "eqspec"
    EXSPEC = "exspec"


METHODS = tuple(m.value for m in Method)


class ProposerKind(StrEnum):
    """Who drafts: a draft model, prompt lookup in the row's own text, or lookup first and the model elsewhere."""

    DRAFT = "draft"
    NGRAM = "ngram"
    HYBRID = "hybrid"


PROPOSERS = tuple(p.value for p in ProposerKind)


class CudaGraphs(StrEnum):
    """Whether decode forwards on a GPU are captured as CUDA graphs (:mod:`batchspec.engine.graphs`)."""

    AUTO = "auto"  # on for a CUDA device, off elsewhere (docs/gpu.md)
    ON = "on"
    OFF = "off"


CUDA_GRAPHS = tuple(c.value for c in CudaGraphs)
AUTO = "auto"
MAX_AUTO_DRAFT_TOKENS = 10


@dataclass(frozen=True)
class SpecConfig:
    """Everything the engine needs to know about a run, validated on construction. The budget of new tokens is not
    here: each :class:`~batchspec.engine.state.Sequence` carries its own (``max_new_tokens``).

    Attributes:
        method: "autoregressive" (target alone, batched), "eqspec" (fixed batches, realigned every round)
            or "exspec" (batches formed each round from a window of sequences, grouped by length).
        batch_size: rows decoded together (B).
        num_draft_tokens: drafts per row and round, each row's capped by its own budget; ``"auto"`` chooses them
            every round for the best expected tokens per second, up to ``max_draft_tokens``
            (:mod:`batchspec.engine.controller`).
        max_draft_tokens: the longest proposal ``"auto"`` may choose.
        proposer: ``"draft"`` (the draft model), ``"ngram"`` (prompt lookup, no draft model) or ``"hybrid"``
            (lookup where it finds a match, the draft model elsewhere); None: ``"hybrid"`` when a draft model is
            given, else ``"ngram"`` (filled in by :func:`batchspec.engine.core.build_engine`).
        ngram_min, ngram_max: the shortest and longest suffix prompt lookup matches.
        eos_token_ids: tokens that end a sequence (empty: only the budget ends it; None: the target's default,
            filled in by :func:`batchspec.engine.core.build_engine`).
        pad_token_id: filler value written into padding columns; never read back as padding (None: the target's
            default, filled in like ``eos_token_ids``).
        window_size: exspec only: sequences active at once (W >= B); None means ``4 * batch_size``.
        sort_by_length: exspec only: admit prompts into the window in order of length.
        check_invariants: verify the batch invariants (I1, I2, token streams, cache lengths) every round.
        timing: measure per-stage seconds (prefill/draft/verify/realign/other); wall time is always measured.
        prefill_chunk: while other rows decode, read at most this many columns of new prompts per round (chunked
            prefill, for serving); ``"auto"``: as many as take about one decode round to read (measured as it
            runs, :class:`batchspec.engine.prefill.ChunkBudget`); None reads every prompt in one piece.
        cuda_graphs: ``"on"`` captures the decode forwards of models on a CUDA device as CUDA graphs and replays
            them (:mod:`batchspec.engine.graphs`); ``"off"`` runs them as they come; ``"auto"`` is on for a CUDA
            device, off elsewhere.
        prefix_cache_size: bytes of prompt KV the prefix cache may keep for later prompts that start the same way
            (:mod:`batchspec.engine.prefix_cache`); 0 turns it off; ``"auto"``: a quarter of the device's free
            memory when the engine is built, at most 4 GiB.
    """

    method: Method = Method.EQSPEC
    batch_size: int = 8
    num_draft_tokens: int | str = AUTO
    max_draft_tokens: int = MAX_AUTO_DRAFT_TOKENS
    proposer: ProposerKind | None = None
    ngram_min: int = DEFAULT_MIN_NGRAM
    ngram_max: int = DEFAULT_MAX_NGRAM
    eos_token_ids: tuple[int, ...] | None = None
    pad_token_id: int | None = None
    window_size: int | None = None
    sort_by_length: bool = True
    check_invariants: bool = False
    timing: bool = True
    prefill_chunk: int | str | None = None
    cuda_graphs: CudaGraphs = CudaGraphs.AUTO
    prefix_cache_size: int | str = AUTO

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "method", Method(self.method))
        except ValueError:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}") from None
        try:
            object.__setattr__(self, "cuda_graphs", CudaGraphs(self.cuda_graphs))
        except ValueError:
            raise ValueError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPHS)}; got {self.cuda_graphs!r}") from None
        require_int("batch_size", self.batch_size, minimum=1)
        if self.num_draft_tokens != AUTO:
            if isinstance(self.num_draft_tokens, str):
                raise ValueError(f"num_draft_tokens must be an integer >= 1 or 'auto'; got {self.num_draft_tokens!r}")
            require_int("num_draft_tokens", self.num_draft_tokens, minimum=1)
        require_int("max_draft_tokens", self.max_draft_tokens, minimum=1)
        if self.proposer is not None:
            try:
                object.__setattr__(self, "proposer", ProposerKind(self.proposer))
            except ValueError:
                raise ValueError(f"proposer must be one of {', '.join(PROPOSERS)}; got {self.proposer!r}") from None
        require_int("ngram_min", self.ngram_min, minimum=1)
        require_int("ngram_max", self.ngram_max, minimum=self.ngram_min)
        if self.pad_token_id is not None:
            require_int("pad_token_id", self.pad_token_id, minimum=0)
        for eos in self.eos_token_ids or ():
            require_int("eos_token_id", eos, minimum=0)
        if self.prefill_chunk is not None and self.prefill_chunk != AUTO:
            if isinstance(self.prefill_chunk, str):
                raise ValueError(f"prefill_chunk must be an integer >= 1, 'auto' or None; got {self.prefill_chunk!r}")
            require_int("prefill_chunk", self.prefill_chunk, minimum=1)
        if self.prefix_cache_size != AUTO:
            if isinstance(self.prefix_cache_size, str):
                raise ValueError(f"prefix_cache_size must be a number of bytes >= 0 or 'auto'; "
                                 f"got {self.prefix_cache_size!r}")
            require_int("prefix_cache_size", self.prefix_cache_size, minimum=0)
        if self.window_size is not None:
            require_int("window_size", self.window_size, minimum=1)
            if self.window_size < self.batch_size:
                raise ValueError(
                    f"window_size must be >= batch_size ({self.batch_size}); got {self.window_size}"
                )

    @property
    def speculative(self) -> bool:
        return self.method is not Method.AUTOREGRESSIVE

    @property
    def adaptive(self) -> bool:
        """The draft length is chosen every round (``num_draft_tokens="auto"``)."""
        return self.num_draft_tokens == AUTO

    @property
    def uses_draft_model(self) -> bool:
        return self.speculative and self.proposer in (ProposerKind.DRAFT, ProposerKind.HYBRID)

    @property
    def window(self) -> int:
        """The exspec window W."""
        return self.window_size if self.window_size is not None else WINDOW_MULTIPLE * self.batch_size


def require_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is an integer (not a bool) in ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer; got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}; got {value}")
