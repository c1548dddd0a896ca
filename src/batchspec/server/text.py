"""Incremental detokenization with stop strings.

After every round a request's output has grown by a few tokens. :class:`TextTracker` decodes the output, finds
the first stop string, and releases only text that is final: nothing past a stop string, no trailing partial
UTF-8 character (decoded as U+FFFD), and no tail that could still turn into a stop string once more tokens
arrive. The released pieces concatenate to the text a non-streaming response returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class TextUpdate:
    """What one round added: ``delta`` is new final text; ``stop_tokens`` is the output length that ends at the
    token completing a stop string (None when no stop string was found)."""

    delta: str
    stop_tokens: int | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_tokens is not None


@dataclass
class TextTracker:
    """Decodes one request's output as it grows and cuts it at the first of ``stop`` strings."""

    tokenizer: Any
    stop: tuple[str, ...] = ()
    emitted: str = ""
    _decoded_upto: int = field(default=0, repr=False)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def update(self, output: list[int], *, final: bool) -> TextUpdate:
        """Text released after the output grew to ``output``; ``final`` releases everything left."""
        previous, self._decoded_upto = self._decoded_upto, len(output)
        text = self.decode(output)
        cut = self._first_stop(text)
        if cut is not None:
            return TextUpdate(self._release(text[:cut]), stop_tokens=self._stop_length(output, previous))
        if not final:
            text = text[: self._safe_end(text)]
        return TextUpdate(self._release(text))

    def _release(self, text: str) -> str:
        delta = text[len(self.emitted) :] if len(text) > len(self.emitted) else ""
        self.emitted += delta
        return delta

    def _first_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _safe_end(self, text: str) -> int:
        """Where final text ends: before a trailing partial character or a tail that starts a stop string."""
        end = len(text.rstrip(REPLACEMENT))
        hold = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, end), hold, -1):
                if text.endswith(stop[:size], 0, end):
                    hold = size
                    break
        return end - hold

    def _stop_length(self, output: list[int], previous: int) -> int:
        """The shortest output length, past ``previous``, whose text holds a stop string."""
        for length in range(previous + 1, len(output)):
            if self._first_stop(self.decode(output[:length])) is not None:
                return length
        return len(output)
