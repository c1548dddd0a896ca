"""Validated configuration of one generation run."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchspec.sampling import SamplingParams

METHODS = ("autoregressive", "eqspec", "exspec")
WINDOW_MULTIPLE = 4


@dataclass(frozen=True)
class SpecConfig:
    """Everything the engine needs to know about a run, validated on construction.

    Attributes:
        method: "autoregressive" (target alone, batched), "eqspec" (fixed batches, realigned every round)
            or "exspec" (batches formed each round from a window of sequences, grouped by length).
        batch_size: rows decoded together (B).
        max_new_tokens: budget of new tokens per prompt; 0 returns empty sequences.
        num_draft_tokens: draft length k proposed per round (clipped near a row's budget).
        eos_token_ids: tokens that end a sequence (empty: only the budget ends it).
        pad_token_id: filler value written into padding columns; never read back as padding.
        window_size: exspec only: sequences active at once (W >= B); None means ``4 * batch_size``.
        sort_by_length: exspec only: admit prompts into the window in order of length.
        check_invariants: verify the batch invariants (I1, I2, token streams, cache lengths) every round.
        timing: measure per-stage seconds (draft/verify/realign/other); wall time is always measured.
        sampling: temperature, top-k and top-p that ``generate`` gives every row (the default, temperature 0, is
            greedy decoding); the engine follows each row's own ``Sequence.sampling``.
    """

    method: str = "eqspec"
    batch_size: int = 8
    max_new_tokens: int = 128
    num_draft_tokens: int = 5
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    window_size: int | None = None
    sort_by_length: bool = True
    check_invariants: bool = False
    timing: bool = True
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams; got {type(self.sampling).__name__}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        _require_int("batch_size", self.batch_size, minimum=1)
        _require_int("max_new_tokens", self.max_new_tokens, minimum=0)
        _require_int("num_draft_tokens", self.num_draft_tokens, minimum=1)
        _require_int("pad_token_id", self.pad_token_id, minimum=0)
        for eos in self.eos_token_ids:
            _require_int("eos_token_id", eos, minimum=0)
        if self.window_size is not None:
            _require_int("window_size", self.window_size, minimum=1)
            if self.window_size < self.batch_size:
                raise ValueError(
                    f"window_size must be >= batch_size ({self.batch_size}); got {self.window_size}"
                )

    @property
    def speculative(self) -> bool:
        return self.method != "autoregressive"

    @property
    def window(self) -> int:
        """The exspec window W."""
        return self.window_size if self.window_size is not None else WINDOW_MULTIPLE * self.batch_size


def _require_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer; got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
