"""A request's penalties and logit bias, as each row (:class:`~batchspec.engine.state.Sequence`) carries them; the
verifier applies them to the target's logits (:mod:`batchspec.engine.shaping`). A record of its own, so that a row's
state does not import the code that shapes logits, which reads rows."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_BIAS = 100.0


@dataclass(frozen=True)
class Penalties:
    """A row's penalties and logit bias (the defaults change nothing).

    Attributes:
        presence: subtracted from the logit of every token the output holds (OpenAI's ``presence_penalty``).
        frequency: subtracted once per occurrence in the output (``frequency_penalty``).
        repetition: > 0; a token seen in the prompt or output has its logit divided by it if positive, multiplied
            by it otherwise (``repetition_penalty``; 1 is none).
        logit_bias: ``(token id, bias)`` pairs added to the logits, each bias in ``[-100, 100]``.
    """

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("presence", "frequency", "repetition"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.repetition <= 0:
            raise ValueError(f"repetition must be > 0, got {self.repetition}")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {bias!r}")

    @property
    def neutral(self) -> bool:
        return self.presence == 0 and self.frequency == 0 and self.repetition == 1 and not self.logit_bias
