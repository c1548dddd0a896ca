"""Acceptance of drafts, counted: what each row (:class:`~batchspec.engine.state.Sequence`) remembers of its recent
rounds, and the engine-wide shares; the draft-length policy (:mod:`batchspec.engine.draft_length`) reads them. Kept
apart from the policy, so that a row's state does not depend on how draft lengths are chosen."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Share:
    """An exponentially weighted count of accepted drafts out of the drafts that were tested."""

    accepted: float = 0.0
    tested: float = 0.0

    def observe(self, accepted: int, tested: int, decay: float) -> None:
        self.accepted = decay * self.accepted + accepted
        self.tested = decay * self.tested + tested

    def fade(self, decay: float) -> None:
        self.accepted *= decay
        self.tested *= decay

    def estimate(self, prior: float, weight: float) -> float:
        return (self.accepted + weight * prior) / (self.tested + weight)


@dataclass
class RowAcceptance:
    """One row's recent acceptance of draft-model and of lookup drafts."""

    model: Share = field(default_factory=Share)
    lookup: Share = field(default_factory=Share)
