"""Verification: the target scores ``[pending, d_1 .. d_k]`` in one forward and each row keeps the longest
prefix of drafts it accepts, plus one more token, so a row gains ``a + 1`` tokens per round.

Terms (used throughout batchspec; ``j`` counts the new tokens of a round from 1, stored at index ``j - 1``):
    d_j: the ``j``-th drafted token; ``d_0`` is the pending token.
    p: the target's next-token distribution; ``p_j`` (scored at input ``d_{j-1}``) is the distribution of
       the ``j``-th new token, ``[B, k+1, V]`` for ``j = 1 .. k+1``. Greedy verification takes it as logits,
       sampling as probabilities after :func:`batchspec.engine.sampling.warp`.
    q: the draft's distribution at the same positions, warped the same way (not needed for greedy).
    accepted (``a``): number of leading drafts ``d_1 .. d_a`` accepted, ``0 <= a <= k``.
    recovered token: the token a row takes at its first rejected position instead of the rejected draft.
    bonus token: the ``(k+1)``-th token, taken when all ``k`` drafts were accepted. The row's final token is
       the recovered or the bonus token (realign, metrics and the CLI call either one "the bonus token").

Greedy (:func:`verify_greedy`): ``d_j`` is accepted while ``d_j == argmax p_j``; the row gains
``argmax p_1 .. argmax p_{a+1}``, exactly the target's own greedy tokens.

Sampling (:func:`verify_sampling`, lossless speculative sampling): the draft proposes ``k + 1`` tokens, each
``d_j`` drawn from ``q_j``. For ``j = 1 .. k+1`` in turn, ``d_j`` is accepted with probability
``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection the recovered token is drawn from
``norm(max(0, p_j - q_j))`` (from ``p_j`` when that residual is all zeros by rounding) and the row stops
there. A token chosen this way has marginal ``p_j``: it is ``x`` with probability
``q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) norm(max(0, p - q))(x) = min(p(x), q(x)) + max(0, p(x) - q(x))``.
The bonus position ``k+1`` gets the same test with ``d_{k+1}``, so its token also has marginal ``p_{k+1}``.
Every random number a row uses is keyed by (its seed, the output position of the token, a stream)
(:class:`batchspec.engine.sampling.RowRandom`), so each token is a function of the prefix, the seed and its position
(and of the draft model: another draft gives different, equally distributed text). Where a round ends, how
many drafts it has, and which other rows share the batch do not change it. That is why the bonus position is
treated like every other one: drawing the bonus token directly from ``p_{k+1}`` would give the same marginal,
but a different realisation from the accept/recover test the same position gets when a round ends later, so a
seeded request's text would change with ``k`` and thus with batch composition. The cost is one extra draft
forward per round when sampling.

Per-row lengths: row ``i`` proposes ``lengths[i]`` drafts (0 .. k; a row with nothing to propose takes a plain
step inside the same target forward) and accepts at most that many. A sampling row without a draft for its
bonus position (no draft model, or a lookup that found nothing) draws that token from ``p`` with its
``Stream.DRAFT`` uniform: the token a draft equal to the target would propose and have accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchspec.engine.sampling import RowRandom, Stream, inverse_cdf


@dataclass(frozen=True)
class Verdict:
    """Outcome of one verification.

    Attributes:
        accepted: ``[B]`` drafts accepted per row (``a``).
        tokens: ``[B, k+1]`` the tokens each row gains are ``tokens[i, :accepted[i] + 1]``.
    """

    accepted: torch.Tensor  # [B]
    tokens: torch.Tensor  # [B, k+1]

    @property
    def gained(self) -> torch.Tensor:  # [B]
        return self.accepted + 1


def accepted_prefix(passed: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B]`` leading ``True`` entries of ``passed`` ``[B, k]``, at most ``lengths[i]`` in row ``i``.

    Example: passed ``[[T, T, F], [T, T, T]]``, lengths ``[3, 1]`` → ``[2, 1]``.
    """
    within = torch.arange(passed.shape[1], device=passed.device) < lengths[:, None]  # [B, k]
    return (passed & within).long().cumprod(dim=1).sum(dim=1)


def verify_greedy(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, lengths: torch.Tensor | None = None
) -> Verdict:
    """Greedy verification of ``draft_tokens`` ``[B, k]`` (row ``i`` proposes its first ``lengths[i]``, default
    all ``k``) against ``target_logits`` ``[B, k+1, V]``."""
    target_tokens = target_logits.argmax(dim=-1)  # [B, k+1]
    k = draft_tokens.shape[1]
    if lengths is None:
        lengths = torch.full((draft_tokens.shape[0],), k, dtype=torch.long, device=draft_tokens.device)
    accepted = accepted_prefix(draft_tokens == target_tokens[:, :k], lengths)  # [B]
    return Verdict(accepted=accepted, tokens=target_tokens)


def verify_sampling(
    draft_tokens: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    rand: RowRandom,
    lengths: torch.Tensor | None = None,
    bonus_drafted: torch.Tensor | None = None,
) -> Verdict:
    """Speculative-sampling verification of ``draft_tokens`` ``[B, k+1]`` (``d_j`` drawn from ``q_j``).

    ``q`` and ``p`` are ``[B, k+1, V]`` probabilities (any float dtype: only the entries used are taken to float64,
    never the whole tensors); ``rand`` keys each row's uniforms by the output position of ``d_1`` (its
    ``offsets``). Row ``i`` proposes ``d_1 .. d_{lengths[i]}`` (default all ``k``); ``d_{lengths[i]+1}`` is its draft
    for the bonus position when ``bonus_drafted[i]`` (default: every row has one), else that token is drawn from
    ``p`` with the row's ``Stream.DRAFT`` uniform. Returns ``tokens[i, :accepted[i] + 1]`` as row ``i``'s gain:
    ``d_1 .. d_a`` and then the recovered token or the outcome of the bonus position.
    """
    _check_sampling_inputs(draft_tokens, q, p, rand)
    rows, steps = draft_tokens.shape
    if lengths is None:
        lengths = torch.full((rows,), steps - 1, dtype=torch.long, device=draft_tokens.device)
    if bonus_drafted is None:
        bonus_drafted = torch.ones(rows, dtype=torch.bool, device=draft_tokens.device)
    p_draft = p.gather(-1, draft_tokens[..., None]).squeeze(-1).to(torch.float64)  # [B, k+1]
    q_draft = q.gather(-1, draft_tokens[..., None]).squeeze(-1).to(torch.float64)  # [B, k+1]
    passed = _accept(rand.uniforms(Stream.ACCEPT, steps), p_draft, q_draft)  # [B, k+1]
    accepted = accepted_prefix(passed[:, :-1], lengths)  # [B]
    stop = accepted[:, None]  # [B, 1]: index of the row's final token
    stop_rows = stop[..., None].expand(-1, 1, p.shape[-1])  # [B, 1, V]
    p_stop = p.gather(1, stop_rows).squeeze(1).to(torch.float64)  # [B, V]
    q_stop = q.gather(1, stop_rows).squeeze(1).to(torch.float64)  # [B, V]
    u_recover = rand.uniforms(Stream.RECOVER, steps).gather(1, stop).squeeze(1)  # [B]
    u_plain = rand.uniforms(Stream.DRAFT, steps).gather(1, stop).squeeze(1)  # [B]
    recovered = inverse_cdf(_residual(p_stop, q_stop), u_recover)[:, None]  # [B, 1]
    plain = inverse_cdf(p_stop, u_plain)[:, None]  # [B, 1]
    drafted = (accepted < lengths) | bonus_drafted  # [B]: a draft stands at the final position
    final = torch.where(passed.gather(1, stop), draft_tokens.gather(1, stop), recovered)  # [B, 1]
    final = torch.where(drafted[:, None], final, plain)  # [B, 1]
    return Verdict(accepted=accepted, tokens=draft_tokens.scatter(1, stop, final))


def _accept(u: torch.Tensor, p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """``[B, k+1]`` accept tests: ``u < p(d) / q(d)``, i.e. probability ``min(1, p(d) / q(d))``."""
    return u * q_draft < p_draft


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` unnormalised ``max(0, p - q)``, or ``p`` for rows where it is all zeros."""
    residual = (p - q).clamp(min=0)  # [B, V]
    return torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)


def _check_sampling_inputs(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor, rand: RowRandom) -> None:
    if draft_tokens.dim() != 2 or draft_tokens.shape[1] < 1:
        raise ValueError(f"draft_tokens must be [B, k+1] with k >= 0, got {list(draft_tokens.shape)}")
    if q.shape != p.shape or q.dim() != 3 or q.shape[:2] != draft_tokens.shape:
        raise ValueError(f"q and p must be [B, k+1, V] to match draft_tokens, got {list(q.shape)}, {list(p.shape)}")
    if rand.seeds.shape != draft_tokens.shape[:1]:
        raise ValueError(f"rand must hold one seed per row, got {list(rand.seeds.shape)} for {draft_tokens.shape[0]}")
