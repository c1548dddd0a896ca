"""How many drafts each row proposes in a round: a fixed ``k``, or (``num_draft_tokens="auto"``) the numbers that
maximise the expected tokens per second of the round, from each row's recent acceptance and measured costs.

Terms (per round over ``B`` rows, row ``i`` proposing ``n_i`` drafts, ``K = max n_i`` the longest proposal):

    E_i(n)  = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_n   tokens row i expects from n drafts (a_j: chance that its j-th
                                                      draft is accepted once the ones before it were)
    cost    = c_0 + c_v x + c_d s(K) + r [x > 0]     seconds of the round: a fixed part, the verification's growth
                                                      per extra token it scores, s(K) draft forwards of c_d, and
                                                      the realignment r its rows' unequal gains cost the next round
    x       = sum_i n_i  (a ragged verification: the fused integer forward scores each row's own drafts only)
              B K        (elsewhere every row is scored over the widest row's K + 1 columns)
    best    = argmax over the n_i of  sum_i E_i(n_i) / cost

With a ragged verification the drafts are dealt out per row: for each ``K``, each row's next draft (its gain
``a_1 ... a_j``, which only falls along a row) is taken in order of gain while it raises the expected rate, i.e. while
``gain > rate * c_v``. A row with little chance of acceptance thus proposes nothing and costs what a plain step of
it costs, while the rows beside it propose many. Elsewhere every row proposes ``min(K, reach_i)``.

``K = 0`` is a plain step of the target (no draft forward at all for greedy rows), so speculation is used only where it
is expected to pay. A row's ``a`` is its recent share of accepted drafts (exponentially weighted), pulled toward the
engine-wide share while it has few observations; lookup drafts and draft-model drafts are counted apart, and within each
source the first draft of a round's run apart from the ones after it (a draft model's first guess is its best, while a
lookup that matched once tends to go on matching: see :class:`~batchspec.engine.acceptance.SourceAcceptance`). Counted
as one share, a draft model's later drafts are overrated and the planner drafts too far. Per batch size, ``c_0`` and
``c_v`` are fitted to every round's measured seconds outside the draft by ridge regression towards a prior that follows
the fitted plain step ``c_0``: an extra token costs ``c_0 / max(B, KNEE_TOKENS)`` (a forward costs about the same for up
to ``KNEE_TOKENS`` tokens, when reading the weights dominates, and grows in proportion to the tokens beyond: on 2 CPU
cores ``c_t(1, 6) = 1.05 c_t(1, 1)`` but ``c_t(8, 6) = 3.5 c_t(8, 1)``), so a width no round has tested yet is priced
from the measured plain step. A mixture-of-experts target's extra token costs more: it may route to experts no
other token of the forward chose, whose bytes the forward then reads too (:func:`prior_slope`). ``c_d`` is
the draft forwards' own measured seconds (a running mean), and until the draft has run at that batch size, the
draft's share of the weights a forward multiplies by, times ``c_0`` (a mixture's plain step of ``B`` rows reads the
union of their experts: the share of that, :meth:`AdaptiveLength._fit`). ``r`` is the measured realignment at the
start of the rounds that follow a round with drafts (a running mean, 0 where none was needed: one row, or rows that
gained alike); it is left out of the round's own seconds, which would otherwise book it on whatever that next round
proposed.

A draft model that has been idle lags: rows that joined or gained lookup tokens while it did not run hold columns
its cache lacks, and its first forward must read them all (on long prompts, many seconds). That catch-up is priced
too, at the measured seconds per column the draft reads (until it has read any, the draft's share of the
weights times the target's measured seconds per prompt column), spread over the rounds the rows have left but at
most :data:`CATCH_UP_ROUNDS`: a draft that has caught up stays caught up only while it runs, and one that stops
soon after (its drafts rejected) has paid the whole catch-up for a few rounds of drafts. A round whose first draft
forward caught up times those columns, not a draft step (:meth:`AdaptiveLength._draft_steps_read`).

With prompt lookup and a draft model (hybrid), rows without a lookup would make every drafted position a draft
forward for the whole batch; each round therefore also weighs proposing the lookups alone (rows without one take a
plain step) and takes whichever is expected to be faster. While a source's drafts at a place go untested (the draft
idle, or a row proposing only its first lookup) their counts fade toward the prior (the engine-wide share, which
itself fades toward an optimistic 0.6), so that acceptance is probed again now and then; a first lookup needs no
probe, since a plain step checks the first lookup of every row for free.

What a token is worth depends on what follows the batch. While finished rows are replaced (the server, and
offline runs while prompts wait), every token is worth the same. Once no prompt waits, an offline batch instead
*drains*: it lasts as long as its slowest row, and a row far ahead of the others gains the batch only the columns
its tokens would take in later steps. ``best`` then weighs each row's tokens by how much
sooner they end the batch (:meth:`AdaptiveLength._worth`): rows that hold the batch up draft boldly, rows far ahead
not at all. Where rows end at EOS instead of their budget, any of them may turn out the longest, and the tokens
are weighed alike again, by the share of finished rows that ran to their budget.

Two corrections keep a round of several rows from drafting where it would pay by a little, and lose: each source's
expected gains are scaled by how far its proposed drafts gave what they were expected to (:class:`Trust`: the rows
that propose are the ones whose shares were high, and their drafts are overrated; a row alone is priced on its own
share, :meth:`AdaptiveLength._trust`), and what drafting adds to a round is priced at
:data:`UNEQUAL_MARGIN` times its fitted seconds (:class:`CostFit`: rows that gain unequally cost later what no
round's seconds show). And at several rows a :class:`Ledger` keeps what drafting has earned, measured: where its
recent rounds lost more than a small share of the time, the next rounds propose nothing until the loss has faded.

Example: B = 1, ``a = 0.8`` and cost = 0.25 + 0.05 x + 0.09 s: K = 0 gives 1 / 0.25 = 4.0 tokens/s; K = 3 with a
draft model gives (1 + .8 + .64 + .51) / 0.67 = 4.4; K = 3 with lookups only (s = 0) gives 2.95 / 0.40 = 7.4.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate
from typing import NamedTuple

from batchspec.config import SpecConfig
from batchspec.engine.acceptance import RowAcceptance
from batchspec.engine.state import FINISH_LENGTH
from batchspec.model_checks import Mixture

# a source's first draft before any was tested, by source: measured on SpecBench and HumanEval (int8, the preset pair),
# a row's first lookup draft was accepted 0.17-0.46 of the time, the draft model's first 0.69-0.88
FIRST_PRIOR = {"lookup": 0.3, "model": 0.7}
ROW_DECAY = 0.8  # weight of a row's earlier rounds when a round is observed
ENGINE_DECAY = 0.97
IDLE_DECAY = 0.97  # per idle round: how fast unobserved counts fade toward their prior
PRIOR_WEIGHT = 1.0  # pseudo-observations of the engine-wide share in a row's estimate
LONE_PRIOR_WEIGHT = 4.0  # the same for a row alone in its batch (see AdaptiveLength._shares)
ENGINE_PRIOR_WEIGHT = 4.0  # pseudo-observations of FIRST_PRIOR in the engine-wide share: one rejection of a
# draft that has just started does not halve it
COST_DECAY = 0.95
DRAFT_DECAY = 0.8  # weight of the earlier draft-forward timings in their running mean
READ_DECAY = 0.5  # weight of the earlier prompt-reading timings in their running mean
CATCH_UP_ROUNDS = 16  # rounds of drafts a draft model's catch-up is spread over, at most
REALIGN_DECAY = 0.8  # weight of the earlier realignments after a round with drafts in their running mean
RIDGE = 0.5  # pseudo-observations of the prior, the least it weighs (see CostFit)
SLOPE_SPREAD = 0.5  # how far the prior slope is taken to be from the true one, as a share of it (see CostFit)
UNEQUAL_MARGIN = 1.5  # what drafting adds to a round of several rows is priced at, over its fitted seconds: see CostFit
TRUST_DECAY = 0.95  # weight of a source's earlier rounds of drafts in its Trust
TRUST_PRIOR = 2.0  # expected tokens taken as borne out in a source's Trust: a few rejections do not halve it
LEDGER_DECAY = 0.98  # weight of the earlier rounds in the Ledger, per round of several rows: about 50 rounds remembered
LEDGER_SHARE = 0.005  # the share of its rounds' seconds that drafting at several rows may have lost before it pauses
KNEE_TOKENS = 16  # tokens a target forward takes for about the price of one
ENDED_KEPT = 64  # finished rows whose lengths tell how long rows go on (:meth:`AdaptiveLength._expected_left`)
TAIL_PRIOR_TOKENS = 4.0  # tokens at the chance over all tokens in the chance that a token past a length ends a row
PRIOR_BUDGET_SHARE = 0.5  # the share of rows taken to run to their budget before any has finished
OVERRUN_KEPT = 64  # drafted rounds whose seconds over their plan's tell how far a plan runs over (Overrun)
OVERRUN_QUANTILE = 0.9
OVERRUN_LEAST = 8  # drafted rounds observed before their overrun counts
LAST_ROUNDS = 2.0  # rounds ahead of a draining batch's slowest row over which a row's chance to finish last falls by e
_PLACES = (("lookup", "first"), ("lookup", "later"), ("model", "first"), ("model", "later"))  # see Shares


@dataclass
class CostFit:
    """Round seconds at one batch size: the target's part ``theta · [1, x]`` (``x`` the extra tokens scored: see the
    module docstring), fitted to decayed observations by
    ridge regression toward ``c_0 · [1, slope]`` (``c_0`` the fitted intercept; ``start`` its first guess: the
    nearest batch size's, else the first round's; None before any round, when only ratios matter; the fitted slope
    is never negative), and ``draft_s``, the measured seconds of one draft forward (``draft_share * c_0`` until the
    draft has run).

    The prior slope weighs what the rounds' noise says it should: a round of ``x`` extra tokens tells the slope with
    the weight ``x^2`` and the noise ``s``, the spread of the plain rounds' seconds, and the prior, taken to be within
    :data:`SLOPE_SPREAD` of the truth, with ``s^2 / (SLOPE_SPREAD c_0 slope)^2`` (at least :data:`RIDGE`). On a
    shared host a plain round's seconds spread by 5-8% (2 vCPUs of a Zen 4, B = 1, 4 and 8), a few times what one
    more verified token costs at several rows, so a round of one or two extra tokens says little about the slope,
    and a round of dozens a lot. With the prior at 0.5 one round of one extra token 8% faster than the plain step
    (B = 8, SpecBench writing) fitted a slope of 0, and the next round verified 10 lookups for each of 7 rows, 4.5
    plain steps long, with 10 accepted.

    ``margin``: what drafting adds to a round (its verified tokens, draft forwards, realignment and catch-up) is
    priced at that many times its fitted seconds when the planner chooses. 1 for one row; for several,
    :data:`UNEQUAL_MARGIN`: rows that gain unequally cost what no round's seconds show (KV gathers the rounds after,
    rows that finish in another order and read the next prompts in more chunks), and a round that was to pay by a
    little lost (SpecBench at B = 4, int8, the preset pair, writing: 17 drafted rounds of 128 cost 2% of the time
    with 7 tokens gained; with nothing proposed the same run kept plain's pace).

    The fit is plain float arithmetic (a 2 x 2 system), solved once per observed round and kept: the planner
    prices every candidate of every round from it, so it must cost the host next to nothing.
    """

    slope: float
    draft_share: float
    start: float | None = None
    margin: float = 1.0
    draft_s: float | None = None
    realign_s: float = 0.0
    gram: tuple[float, float, float] = (0.0, 0.0, 0.0)  # decayed sums of 1, K, K^2
    moment: tuple[float, float] = (0.0, 0.0)  # decayed sums of t, K t
    plain: tuple[float, float, float] = (0.0, 0.0, 0.0)  # decayed sums of 1, t, t^2 over the plain rounds
    theta: tuple[float, float] = field(init=False)

    def __post_init__(self) -> None:
        self.theta = self._solve()

    def observe(self, k: int, forwards: int, seconds: float, draft_seconds: float) -> None:
        target = seconds - draft_seconds
        if self.start is None:
            self.start = target / (1 + self.slope * k)
        ones, ks, squares = self.gram
        self.gram = (COST_DECAY * ones + 1, COST_DECAY * ks + k, COST_DECAY * squares + k * k)
        self.moment = (COST_DECAY * self.moment[0] + target, COST_DECAY * self.moment[1] + k * target)
        if not k:
            count, total, total_sq = self.plain
            self.plain = (COST_DECAY * count + 1, COST_DECAY * total + target, COST_DECAY * total_sq + target * target)
        if forwards:
            each = draft_seconds / forwards
            self.draft_s = each if self.draft_s is None else DRAFT_DECAY * self.draft_s + (1 - DRAFT_DECAY) * each
        self.theta = self._solve()

    def _solve(self) -> tuple[float, float]:
        """``(c_0, c_v)`` by two solves: the first fixes the intercept the prior is scaled to, the second the slope."""
        ones, ks, squares = self.gram
        c0 = 1.0 if self.start is None else self.start
        c_v = 0.0
        for _ in range(2):
            ridge = max(RIDGE, self._variance() / (SLOPE_SPREAD * self.slope * c0) ** 2)
            a, b, d = ones + RIDGE, ks, squares + ridge  # the system's matrix [[a, b], [b, d]]
            r0, r1 = self.moment[0] + RIDGE * c0, self.moment[1] + ridge * self.slope * c0
            det = a * d - b * b
            c0, c_v = max((d * r0 - b * r1) / det, 1e-9), (a * r1 - b * r0) / det
        return c0, max(c_v, 0.0)

    def _variance(self) -> float:
        """The spread of the plain rounds' seconds, squared (0 before two were observed)."""
        count, total, squares = self.plain
        return max(squares / count - (total / count) ** 2, 0.0) if count > 1 else 0.0

    def predict(self, x: int, steps: int) -> float:
        """:meth:`seconds`, what drafting adds to a plain step priced at :attr:`margin` times its fitted seconds."""
        c0 = self.theta[0]
        return c0 + self.margin * (self.seconds(x, steps) - c0)

    def seconds(self, x: int, steps: int) -> float:
        """A round's fitted seconds with ``x`` extra tokens verified and ``steps`` draft forwards."""
        c0, slope = self.theta
        return c0 + slope * x + self.draft(steps) + (self.realign_s if x else 0.0)

    def realigned(self, seconds: float) -> None:
        """The realignment after a round with drafts took ``seconds``."""
        self.realign_s = REALIGN_DECAY * self.realign_s + (1 - REALIGN_DECAY) * seconds

    def draft(self, steps: int) -> float:
        """Seconds of ``steps`` draft forwards."""
        each = self.draft_share * self.theta[0] if self.draft_s is None else self.draft_s
        return each * steps


@dataclass
class Trust:
    """How far a source's drafts gave the tokens the planner expected of them: ``factor``, the decayed tokens
    accepted over the decayed tokens expected (at the shares the planner planned with), at most 1, with
    :data:`TRUST_PRIOR` expected tokens taken as borne out. The planner scales the source's expected gains by it.

    The shares are unbiased estimates of a row's acceptance, but the drafts a round proposes are the ones whose
    shares were high: chosen for being high, they are overrated (on SpecBench at B = 4, int8, the preset pair: the
    proposed drafts were expected to give 1.3-1.4x the tokens they gave), and a draft that was to pay by a little
    loses. Where a source's drafts give what they were expected to, its factor stays near 1."""

    expected: float = 0.0
    accepted: float = 0.0

    @property
    def factor(self) -> float:
        return min(1.0, (self.accepted + TRUST_PRIOR) / (self.expected + TRUST_PRIOR))

    def observe(self, expected: float, accepted: int) -> None:
        self.expected = TRUST_DECAY * self.expected + expected
        self.accepted = TRUST_DECAY * self.accepted + accepted

    def fade(self, decay: float) -> None:
        """No draft of the source was proposed: what was measured counts less (the factor drifts toward 1)."""
        self.expected *= decay
        self.accepted *= decay


@dataclass
class Overrun:
    """How far a drafted round's measured seconds run over the seconds it was planned to take: the
    :data:`OVERRUN_QUANTILE` of the last :data:`OVERRUN_KEPT` rounds' ratios (``factor``; 1 until
    :data:`OVERRUN_LEAST` were observed, and never below 1). A round held within a cap (streams wait on it: the
    server's) is planned within the cap over this factor, so that its seconds, not only its fit, stay within it: on
    SpecBench's served chats at 4 clients (int8, the preset pair, 2 vCPUs of a Zen 4) drafted rounds ran at 1.00x
    their plan at the median but 1.18x at the 90th percentile, and the longest, planned just within the cap of two
    plain steps, took 2.6 plain steps, where plain decoding's longest rounds (a step and a prompt chunk) took 2.0."""

    ratios: deque[float] = field(default_factory=lambda: deque(maxlen=OVERRUN_KEPT))
    factor: float = 1.0

    def observe(self, ratio: float) -> None:
        self.ratios.append(ratio)
        if len(self.ratios) >= OVERRUN_LEAST:
            ordered = sorted(self.ratios)
            self.factor = max(1.0, ordered[int(OVERRUN_QUANTILE * (len(ordered) - 1))])


@dataclass
class Ledger:
    """What drafting at several rows has earned, measured round by round: ``balance``, the decayed seconds its rounds'
    accepted tokens saved (each at what a token of its row is worth to the plain step, as the round's plan weighed it)
    less the seconds drafting added (a round's measured seconds over the fitted plain step, and the realignment the
    next round needed; a draft's catch-up, which the planner prices as an investment over the rounds after it, left
    out), and ``seconds``, the decayed seconds of all its rounds. While the balance is below :data:`LEDGER_SHARE` of
    those seconds, rounds of several rows propose nothing (:attr:`paying`); the loss fades by :data:`LEDGER_DECAY` a
    round, and drafting is tried again.

    Trust and the margin price what drafts are expected to give; the ledger bounds what they lost, whatever the
    pricing got wrong: in the planner's simulator, a draft that runs a forward per row priced as one forward for the
    batch ran at 0.82x plain steps at B = 8, and within 4% of them with the ledger. What rounds cost outside their own
    seconds (KV gathers later, prompts read in more chunks) it does not see: that is the margin's part. On SpecBench
    (int8, the preset pair) the drafted rounds at B = 4 and 8 broke even by their own seconds, and it never paused."""

    balance: float = 0.0
    seconds: float = 0.0

    @property
    def paying(self) -> bool:
        return self.balance >= -LEDGER_SHARE * self.seconds

    def observe(self, seconds: float, earned: float) -> None:
        """A round of ``seconds``, in which drafting earned ``earned`` seconds (negative: it lost them)."""
        self.balance = LEDGER_DECAY * self.balance + earned
        self.seconds = LEDGER_DECAY * self.seconds + seconds


class Shares(NamedTuple):
    """A row's chances that a draft is accepted once the ones before it were, by source and place
    (:class:`~batchspec.engine.acceptance.SourceAcceptance`)."""

    lookup_first: float
    lookup_later: float
    model_first: float
    model_later: float


@dataclass(frozen=True)
class Reach:
    """How far each row of a round could draft.

    Attributes:
        lookups: per row, lookup drafts found in a row (0 without prompt lookup).
        uses_draft_model: a draft model proposes the positions after the lookups (draft and hybrid proposers).
        first: per row, its first lookup draft (None: none), checked for free when the row proposes nothing.
        lag: per row, columns before its pending token that the draft model's cache lacks (None: none).
        per_row: the draft model runs one row at a time (a draft of another tokenizer: each row's text has its own
            length in the draft's tokens), so each row's drafts past its lookups cost forwards of their own.
        closed: rows that propose nothing this round (their prompts are read in it: :mod:`batchspec.engine.riding`).
    """

    lookups: list[int]
    uses_draft_model: bool
    first: list[int | None] | None = None
    lag: list[int] | None = None
    per_row: bool = False
    closed: frozenset[int] = frozenset()

    def available(self, row: int, cap: int) -> int:
        """Drafts row ``row`` can propose within ``cap``."""
        if row in self.closed:
            return 0
        return cap if self.uses_draft_model else min(cap, self.lookups[row])


@dataclass(frozen=True)
class RoundRecord:
    """What one round proposed and what came of it, for :meth:`AdaptiveLength.observe`.

    Attributes:
        lengths, accepted: per row, drafts proposed and accepted.
        chained: per row, which proposed positions the planner priced as lookup drafts: the row's lookup chain when
            it planned (:attr:`Reach.lookups`); a lookup found on the device past it counts with the draft model's
            positions, as the planner priced it.
        shadow: per row that proposed nothing, whether its first lookup draft equals the token it gained
            (None: no lookup draft).
        k, forwards: the round's longest proposal and the draft forwards it ran.
        seconds: the round's decode time but its realignment, of which ``draft_seconds`` were spent proposing.
        realign_seconds: the realignment at the round's start (what the round before it left unequal).
        draft_width: columns per row the draft's first forward read (its catch-up where it was idle; 0: no forward).
        riding: prompt columns verified besides the rows' pending tokens and drafts (prompts read in the round:
            :mod:`batchspec.engine.riding`); priced as drafts are, by the columns they add.
    """

    lengths: list[int]
    accepted: list[int]
    chained: list[list[bool]]
    shadow: list[bool | None]
    k: int
    forwards: int
    seconds: float
    draft_seconds: float = 0.0
    realign_seconds: float = 0.0
    draft_width: int = 0
    riding: int = 0

    def scored(self, ragged: bool) -> int:
        """The extra tokens the round's verification scored past one a row: each row's own drafts where it is
        ``ragged``, else ``k`` a row; and the riding prompt columns."""
        return (sum(self.lengths) if ragged else len(self.lengths) * self.k) + self.riding


class FixedLength:
    """``k`` drafts per row, capped by each row's remaining budget. Its rounds' seconds are fitted as the adaptive
    planner's are (:class:`CostFit`, no draft share), for what a plain step and a verified column take."""

    def __init__(self, k: int, *, ragged: bool = False) -> None:
        self.k = k
        self.limit = k
        self.drafting = k > 0
        self.ragged = ragged
        self.planned_s: float | None = None  # no round's seconds are planned here
        self.fits: dict[int, CostFit] = {}

    def lengths(self, rows, reach: Reach, sampled: bool, *, draining: bool = False,
                cap: float | None = None) -> list[int]:
        return [reach.available(i, min(self.k, row.remaining - 1)) for i, row in enumerate(rows)]

    def observe(self, rows, record: RoundRecord) -> None:
        fit = self.fits.setdefault(len(rows), CostFit(prior_slope(len(rows), self.k, None), 0.0))
        fit.observe(record.scored(self.ragged), record.forwards, record.seconds, record.draft_seconds)

    def read(self, tokens: int, seconds: float, *, draft: bool) -> None:
        return None

    def plain_step_s(self, rows: int, seconds: float) -> float:
        """What a plain step of ``rows`` rows takes: :func:`fitted` (``seconds``, the last round's, before any)."""
        return fitted(self.fits, rows, seconds)[0]

    def column_s(self, rows: int) -> float | None:
        """What a verified column adds to a round of ``rows`` rows: :func:`fitted` (None before any round)."""
        return fitted(self.fits, rows, None)[1]


def fitted(fits: dict[int, CostFit], rows: int, seconds: float | None) -> tuple[float | None, float | None]:
    """``(c_0, c_v)``: a plain step of ``rows`` rows and what a verified column adds to it, as their rounds were
    fitted (:class:`CostFit`); ``(seconds, None)`` before any round of ``rows`` rows was observed."""
    fit = fits.get(rows)
    return (seconds, None) if fit is None or fit.start is None else fit.theta


class AdaptiveLength:
    """Chooses each round's ``K`` for the highest expected tokens per second (see the module docstring)."""

    def __init__(self, max_k: int, draft_ratio: float, *, ragged: bool = False, mixture: Mixture | None = None,
                 model_prior: float | None = None, margin: float = UNEQUAL_MARGIN) -> None:
        self.max_k = max_k
        self.margin = margin  # the price of what drafting adds to a round of several rows (CostFit.margin)
        self.first_prior = FIRST_PRIOR if model_prior is None else {**FIRST_PRIOR, "model": model_prior}
        self.mixture = mixture  # the target's experts (None: dense), for the cost prior of an extra token
        self.ragged = ragged  # the verification scores each row's own drafts only (see the module docstring)
        self.proposed = 0  # the rows of the last round, where it had drafts (else 0)
        self.limit = max_k
        self.drafting = False  # new prompts are read by the draft when it next runs, not with the target's: see read
        self.draft_ratio = draft_ratio
        self.engine = RowAcceptance()
        self.fits: dict[int, CostFit] = {}
        self.read_s: dict[bool, float] = {}  # seconds per prompt column read, by the draft (True) or the target
        self.finished = (0, 0)  # rows that finished at their budget, rows that finished
        self.decoded = 0  # tokens the rows gained, over all rounds
        self.ended: deque[tuple[int, bool]] = deque(maxlen=ENDED_KEPT)  # the last rows that finished: tokens, at EOS
        self.trust = {"lookup": Trust(), "model": Trust()}  # how far each source's expected tokens were borne out
        self.expected: list[list[float]] | None = None  # the last plan's gains per row, before trust
        self.ledger = Ledger()  # what drafting at several rows earned: see Ledger
        self.worth: list[float] = []  # the last plan's worth of a token per row (its ledger's prices)
        self.planned_s: float | None = None  # the last plan's fitted seconds (None: a plain round, not priced)
        self.overrun = Overrun()  # how far drafted rounds ran over their plans: a cap holds their seconds

    def lengths(self, rows, reach: Reach, sampled: bool, *, draining: bool = False,
                cap: float | None = None) -> list[int]:
        """Each row's drafts this round; ``draining``: no row takes the place of one that finishes before the batch
        ends (see :meth:`_worth`); ``cap``: the seconds the round may take at most (streams waiting on it: the
        server's rounds, :meth:`~batchspec.engine.prefill.ChunkBudget.round_cap`; a drafted round's fitted seconds
        are held within it over how far such rounds ran over their plans, :class:`Overrun`), None for none. A round
        longer than a plain one would make its rows' clients wait longer for their next tokens than plain decoding ever
        makes them wait: on SpecBench's served chats at 8 clients, the longest gaps were rounds verifying 10 lookups
        for each of 8 rows, three plain steps long."""
        self.planned_s, self.expected, self.worth = None, None, []
        if len(rows) > 1 and not self.ledger.paying:
            return [0] * len(rows)
        fit = self._fit(len(rows))
        limits = [min(self.max_k, row.remaining - 1) for row in rows]
        variants = [[reach.available(i, limit) for i, limit in enumerate(limits)]]
        if reach.uses_draft_model and any(reach.lookups):  # also: the lookups alone, no draft forward for the rest
            variants.append([min(limit, found) for limit, found in zip(limits, reach.lookups, strict=True)])
        shares = [self._shares(row, alone=len(rows) == 1) for row in rows]
        raw = [[_gains(cap, found, row_shares, reach.uses_draft_model)
                for cap, found, row_shares in zip(caps, reach.lookups, shares, strict=True)] for caps in variants]
        trust = self._trust(len(rows))
        gains_of = [[_trusted(row, found, trust) for row, found in zip(gains, reach.lookups, strict=True)]
                    for gains in raw]
        # a row's rate where the batch drains: the tokens it gains where it drafts all it can
        worth = self._worth(rows, fit, [1 + sum(row) for row in gains_of[0]]) if draining else [1.0] * len(rows)
        if not sampled and self._idle([row[0] if row else 0.0 for row in raw[0]], worth, fit, trust):
            return [0] * len(rows)
        self.expected, self.worth = raw[0], worth  # what each row's drafts were expected to give: see _calibrate
        return self._best(rows, reach, sampled, (variants, gains_of, worth), fit, cap)

    def _best(self, rows, reach: Reach, sampled: bool, plan: tuple[list[list[int]], list[list[list[float]]],
              list[float]], fit: CostFit, cap: float | None) -> list[int]:
        """The rows' drafts of the highest expected rate: over the ``plan``'s variants (each row's drafts at most, and
        their trusted gains) and every longest proposal ``K``, each dealt by :meth:`_deal` at the rows' ``worth``
        and priced with the draft's catch-up; none past the ``cap`` over the :class:`Overrun`."""
        variants, gains_of, worth = plan
        catch_up_s = self._catch_up_s(reach)
        left = self._expected_left(rows) if catch_up_s else 0.0
        best, best_rate = [0] * len(rows), 0.0
        limit = math.inf if cap is None else cap / self.overrun.factor  # a drafted round's seconds within the cap
        deal = self._deal_rows if reach.per_row else self._deal
        for caps, gains in zip(variants, gains_of, strict=True):
            totals = [list(accumulate(row, initial=0)) for row in gains]  # totals[i][n]: the sum of gains[i][:n]
            ranked = _ranked(gains, worth) if self.ragged else []
            for k in range(max(caps, default=0) + 1):
                lengths, value, extra, steps = deal(totals, ranked, worth, (k, _draft_steps(k, caps, reach, sampled)),
                                                    fit, reach.lookups, limit)
                tokens = len(rows) + sum(total[n] for total, n in zip(totals, lengths, strict=True))
                catch_up = catch_up_s / min(left / tokens, CATCH_UP_ROUNDS) if steps and left else 0.0
                if extra and fit.seconds(extra, steps) + catch_up > limit:
                    continue
                rate = value / max(fit.predict(extra, steps) + fit.margin * catch_up, 1e-6)
                if rate > best_rate * (1 + 1e-6):
                    best, best_rate, self.planned_s = lengths, rate, fit.seconds(extra, steps)
        return best

    def _idle(self, firsts: list[float], worth: list[float], fit: CostFit, trust: tuple[float, float]) -> bool:
        """Whether no draft can pay this round, by a bound that spares pricing every option. ``firsts``: each row's
        first draft's gain (0: none), at its source's share; ``worth``: what a token of each row is worth
        (:meth:`_worth`; 1 each where the batch does not drain); ``trust``: the sources' factors (:meth:`_trust`). A
        round whose verification scores ``x`` extra tokens gives at most ``x G`` more worth, ``G = max_i worth_i g_i``
        times the larger trust (gains only fall along a row), and costs at least ``c_0 + margin c_v x``; it beats a
        plain step's ``sum(worth) / c_0`` only if ``G c_0 > sum(worth) margin c_v``. Where it cannot, :meth:`lengths`
        would choose nothing: a property test checks it, draining and not."""
        best = max((w * g for w, g in zip(worth, firsts, strict=True)), default=0.0)
        c0, per_token = fit.theta
        return best * max(trust) * c0 <= sum(worth) * fit.margin * per_token

    def _trust(self, rows: int) -> tuple[float, float]:
        """The lookups' and the draft model's :attr:`Trust.factor` in a round of ``rows`` rows; 1 each for one row.

        Trust corrects the choice among rows: of several rows, the ones whose shares happen to be high propose, and
        their drafts are overrated. A row alone proposes or not on its own share, which counts every draft it was
        tested on; there the factor only repeated one rejection. On SpecBench at one row (int8, the preset pair, the
        planner replayed over the target's answers, the draft's own choices at each of their positions and the
        measured forward costs: ``scripts/one_row_replay.py``) one draft model chain of 7 rejected at its first draft
        halved the model's factor, and the draft then sat out the 58 rounds left of that writing prompt, whose first
        drafts it would have got right 70% of the time. Rounds of one row still teach the factors, for the rounds of
        several rows after them."""
        if rows == 1:
            return 1.0, 1.0
        return self.trust["lookup"].factor, self.trust["model"].factor

    def _deal(self, totals: list[list[float]], ranked: list[tuple[float, int, int]], worth: list[float],
              round_: tuple[int, int], fit: CostFit, found: list[int],
              limit: float = math.inf) -> tuple[list[int], float, int, int]:
        """Each row's drafts for a round of longest proposal ``k`` and ``steps`` draft forwards (``round_``), the worth
        of the tokens they are expected to give, the extra tokens the verification scores and the draft forwards;
        ragged, no draft is dealt past the round's fitted seconds ``limit``.
        ``totals[i][n]``: the tokens row ``i``'s first ``n`` drafts add, each worth ``worth[i]``; ``ranked``: every
        draft by worth (:func:`_ranked`). Ragged: drafts taken in order of worth while each raises the expected rate;
        else ``min(k, reach)`` for all. (``found``, the rows' lookups, matters only to :meth:`_deal_rows`.)"""
        k, steps = round_
        if not self.ragged:
            lengths = [min(k, len(total) - 1) for total in totals]
            value = sum(w * (1 + total[n]) for total, w, n in zip(totals, worth, lengths, strict=True))
            return lengths, value, k * len(totals), steps
        c0, fitted = fit.theta
        per_token = fit.margin * fitted
        lengths = [0] * len(totals)
        value, cost = sum(worth), c0 + fit.margin * fit.draft(steps)
        seconds = fit.seconds(0, steps) + fit.realign_s
        for adds, i, _ in (draft for draft in ranked if draft[2] < k):
            if adds * cost <= value * per_token or seconds + fitted > limit:  # the worth only falls from here on
                break
            lengths[i] += 1
            value, cost, seconds = value + adds, cost + per_token, seconds + fitted
        return lengths, value, sum(lengths), steps

    def _deal_rows(self, totals: list[list[float]], ranked: list[tuple[float, int, int]], worth: list[float],
                   round_: tuple[int, int], fit: CostFit, found: list[int],
                   limit: float = math.inf) -> tuple[list[int], float, int, int]:
        """:meth:`_deal` for a draft model that runs one row at a time (:attr:`Reach.per_row`): a row's draft past
        its ``found`` lookups costs a draft forward of its own besides its verification, so the drafts are priced one
        by one, and the forwards returned are the rows' (ragged: a draft is taken while it raises the expected rate,
        after the row's drafts before it; else ``min(k, reach)`` for all)."""
        k, _ = round_
        if not self.ragged:
            lengths, value, extra, _ = self._deal(totals, ranked, worth, (k, 0), fit, found)
            return lengths, value, extra, sum(max(0, n - f) for n, f in zip(lengths, found, strict=True))
        c0, fitted = fit.theta
        lengths, forwards = [0] * len(totals), 0
        value, cost, seconds = sum(worth), c0, c0 + fit.realign_s
        for adds, i, j in (draft for draft in ranked if draft[2] < k):
            modelled = j >= found[i]
            took = fitted + fit.draft(1) * modelled
            if lengths[i] != j or adds * cost <= value * fit.margin * took or seconds + took > limit:
                continue
            lengths[i] += 1
            forwards += modelled
            value, cost, seconds = value + adds, cost + fit.margin * took, seconds + took
        return lengths, value, sum(lengths), forwards

    def _worth(self, rows, fit: CostFit, rates: list[float]) -> list[float]:
        """What a token of each row is worth to a batch that drains: :func:`_drain_worth` where rows run to their
        budget, whose ends it knows; ``c_0 / B`` each where they end at EOS, when any row may turn out the longest. The
        two are weighed by the share of the finished rows that ran to their budget (``PRIOR_BUDGET_SHARE`` before
        any finished). On HumanEval (answers ending at EOS, 157 of 164) the budget alone made every row that drew
        ahead stop drafting: 5,384 rounds for 32,041 tokens, against 3,074 with this weighing."""
        budget = (self.finished[0] + PRIOR_BUDGET_SHARE) / (self.finished[1] + 1)
        even = fit.theta[0] / len(rows)
        return [budget * worth + (1 - budget) * even for worth in _drain_worth(rows, fit, rates)]

    def observe(self, rows, record: RoundRecord) -> None:
        """Account a round: acceptance per row and source, and its cost."""
        ended = [row for row in rows if row.finished]
        self.finished = (self.finished[0] + sum(row.finish_reason == FINISH_LENGTH for row in ended),
                         self.finished[1] + len(ended))
        self.decoded += len(rows) + sum(record.accepted)
        self.ended.extend((len(row.output), row.finish_reason != FINISH_LENGTH) for row in ended)
        self._count(rows, record)
        self._calibrate(record)
        fit = self._fit(len(rows))
        after = self.proposed == len(rows)  # the round before had drafts, over as many rows
        if after:
            fit.realigned(record.realign_seconds)
        drafted = record.scored(self.ragged) - record.riding  # extra tokens verified as drafts
        self.proposed = len(rows) if drafted else 0
        steps, catch_up = self._draft_steps_read(rows, record, fit)
        if drafted and self.planned_s and not (record.riding or catch_up):
            self.overrun.observe(record.seconds / self.planned_s)
        if len(rows) > 1 and fit.start is not None and not record.riding:  # a prompt's columns: neither way
            self._account(record, fit, drafted or record.forwards, catch_up, after)
        fit.observe(record.scored(self.ragged), steps, record.seconds, record.draft_seconds)

    def _account(self, record: RoundRecord, fit: CostFit, drafted: int, catch_up: float, after: bool) -> None:
        """A round of several rows into the :class:`Ledger`: where it ``drafted``, the seconds its accepted tokens
        saved (a token of row ``i`` at ``c_0`` times its share of the plan's worth) less its seconds over the fitted
        plain step ``c_0`` but its draft's ``catch_up``; ``after`` a round with drafts, less its realignment."""
        c0 = fit.theta[0]
        earned = -record.realign_seconds if after else 0.0
        if drafted:
            worth = self.worth if len(self.worth) == len(record.accepted) else [1.0] * len(record.accepted)
            saved = c0 * sum(w * a for w, a in zip(worth, record.accepted, strict=True)) / sum(worth)
            earned += saved - (record.seconds - c0 - catch_up)
        self.ledger.observe(record.seconds + record.realign_seconds, earned)

    def _calibrate(self, record: RoundRecord) -> None:
        """Each source's drafts of the round: the tokens the planner expected of them (at the rows' shares as it
        planned, :attr:`expected`) against the ones the target accepted, into that source's :class:`Trust`; a
        source that proposed nothing fades toward full trust."""
        planned = self.expected is not None and len(self.expected) == len(record.lengths)
        gains = self.expected if planned else [[]] * len(record.lengths)  # no plan of these rows: nothing to compare
        tally = {"lookup": [0.0, 0], "model": [0.0, 0]}
        for row_gains, n, a, chained in zip(gains, record.lengths, record.accepted, record.chained, strict=True):
            for j in range(min(n, len(row_gains))):
                source = tally["lookup" if chained[j] else "model"]
                source[0] += row_gains[j]
                source[1] += int(j < a)
        for source, (expected, accepted) in tally.items():
            if expected:
                self.trust[source].observe(expected, accepted)
            else:
                self.trust[source].fade(IDLE_DECAY)
        self.expected = None

    def _count(self, rows, record: RoundRecord) -> None:
        """Each row's tested drafts, by source and place, into its counts and the engine's; a count that no draft
        tested this round fades toward its prior (a row's, and the engine's where no row tested one), so that a
        source or place left idle after a few rejections is tried again."""
        tested_any = set()
        for row, n, a, chained, shadow in zip(
            rows, record.lengths, record.accepted, record.chained, record.shadow, strict=True
        ):
            counts = _tests(n, a, chained)
            if shadow is not None:
                accepted, tested = counts["lookup", "first"]
                counts["lookup", "first"] = (accepted + int(shadow), tested + 1)
            for (source, place), (accepted, tested) in counts.items():
                mine = getattr(getattr(row.acceptance, source), place)
                if tested:
                    mine.observe(accepted, tested, ROW_DECAY)
                    getattr(getattr(self.engine, source), place).observe(accepted, tested, ENGINE_DECAY)
                    tested_any.add((source, place))
                else:
                    mine.fade(IDLE_DECAY)
        for source, place in _PLACES:
            if (source, place) not in tested_any:
                getattr(getattr(self.engine, source), place).fade(IDLE_DECAY)

    def _draft_steps_read(self, rows, record: RoundRecord, fit: CostFit) -> tuple[int, float]:
        """The round's draft forwards that time a draft step, and the seconds of its draft's catch-up: all of them and
        none, or, where the first one also caught up (read more columns than a round re-reads: the draft was idle),
        none, its seconds then timing the catch-up's columns instead (less the steps' own, at the draft step's price
        so far). Booked as steps, a catch-up prices every later step at several times its cost, and the draft may
        never run again.

        The seconds are those of every column the first forward read past the step's one a row, and are divided by
        them all: divided by the columns past what a round re-reads (a catch-up's price, :meth:`_catch_up_s`), a
        short catch-up priced a column at several times its cost. On SpecBench's writing at one row (the replay of
        :meth:`_trust`) a catch-up of 15 columns, 3 of them past the 12 a round re-reads, priced a column at 4.3 ms
        where the draft reads one in 1.5, and the draft sat out the next prompts' answers, whose catch-up of 74
        columns it then priced at 0.32 s."""
        if record.draft_width - 1 <= self._steady_lag:
            return record.forwards, 0.0
        seconds = record.draft_seconds - fit.draft(record.forwards)
        self.read(len(rows) * (record.draft_width - 1), seconds, draft=True)
        return 0, seconds

    def plain_step_s(self, rows: int, seconds: float) -> float:
        """What a plain step of ``rows`` rows takes: the fitted intercept ``c_0`` of their rounds' cost, or the last
        round's ``seconds`` before any round of ``rows`` rows was observed (:func:`fitted`)."""
        return fitted(self.fits, rows, seconds)[0]

    def column_s(self, rows: int) -> float | None:
        """What a verified column adds to a round of ``rows`` rows: the fitted ``c_v`` (None before any round)."""
        return fitted(self.fits, rows, None)[1]

    def read(self, tokens: int, seconds: float, *, draft: bool) -> None:
        """Reading prompt columns (``tokens`` of them, over all rows) took one model ``seconds``.

        The draft reads a new prompt only where it drafts for that row (``drafting`` False: the engine does not have
        it read prompts along with the target's), its catch-up priced by the planner where it would run. Read along,
        a prompt the draft never drafts for (short answers, batch sizes where it does not pay) costs its whole
        reading."""
        if tokens > 0 and seconds > 0:
            each = seconds / tokens
            before = self.read_s.get(draft)
            self.read_s[draft] = each if before is None else READ_DECAY * before + (1 - READ_DECAY) * each

    def _expected_left(self, rows) -> float:
        """The tokens ``rows`` are expected to gain still, over which a draft's catch-up is spread: their budgets,
        where no row ended at EOS; else, for a row of ``L`` tokens with ``R`` left, ``(1 - (1 - h)^R) / h`` at the
        chance ``h`` that a token past ``L`` ends a row: the rows that ended at EOS past ``L`` over the tokens rows
        gained past ``L`` (the last :data:`ENDED_KEPT` finished rows and these), with :data:`TAIL_PRIOR_TOKENS`
        tokens at the chance over all tokens; and no more than :data:`TAIL_PRIOR_TOKENS` past the longest finished
        row (a catch-up is an investment, and no row was seen to go on beyond it). On SpecBench's translation (answers
        of 9-37 tokens for a budget of 64) the draft caught up a batch's last row, 33 tokens long, for drafts its end 4
        tokens later never repaid (0.15 s, 3-4% of the run at B = 4 and 8)."""
        ends = self.finished[1] - self.finished[0]  # rows that ended at EOS, ever (as ``decoded`` counts)
        if not ends:
            return float(sum(row.remaining for row in rows))
        overall = ends / max(self.decoded, ends)
        lengths = [length for length, _ in self.ended] + [len(row.output) for row in rows]
        longest = max(length for length, _ in self.ended)
        left = 0.0
        for row in rows:
            past = len(row.output)
            tail = sum(at_eos and length > past for length, at_eos in self.ended)
            gained = sum(max(0, length - past) for length in lengths)
            chance = (tail + TAIL_PRIOR_TOKENS * overall) / (gained + TAIL_PRIOR_TOKENS)
            left += min((1 - (1 - chance) ** row.remaining) / chance, max(longest - past, 0) + TAIL_PRIOR_TOKENS)
        return left

    def _catch_up_s(self, reach: Reach) -> float:
        """Seconds the draft model needs to read the columns it lacks beyond the ones every round re-reads."""
        if not reach.uses_draft_model or not reach.lag:
            return 0.0
        per_column = self.read_s.get(True, self.draft_ratio * self.read_s.get(False, 0.0))
        return per_column * sum(max(0, lag - self._steady_lag) for lag in reach.lag)

    @property
    def _steady_lag(self) -> int:
        """Columns a row's draft may lack after a round in which it ran: the drafts the target accepted past the ones
        the draft read, and the bonus token; a round's first draft forward re-reads them."""
        return self.max_k + 1

    def _shares(self, row, *, alone: bool = False) -> Shares:
        """The row's chances of acceptance by source and place. A ``first`` share is pulled toward the engine-wide
        one; a ``later`` share toward the engine-wide ``later`` share, which is itself pulled toward the row's own
        ``first`` until enough ``later`` drafts were tested: a later draft is proposed only where the first's share
        makes it pay, and an engine-wide prior alone could keep it from ever being tested.

        The engine-wide share weighs :data:`PRIOR_WEIGHT` observations in a row's estimate, :data:`LONE_PRIOR_WEIGHT`
        where the row is ``alone`` in its batch: rows differ (one copies its prompt, the next does not), but a row
        alone has no other rows to differ from, and the engine-wide share is then its own longer memory (this
        row's drafts and the rows' before it). With one pseudo-observation, a row's two good rounds priced the draft
        model's later drafts at 0.95 and one rejected chain halved its first share; on SpecBench at one row (the
        replay of :meth:`_trust`) the weight of 4 gave 1.6-1.8% more tokens per second than 1, with the factor at 1."""
        weight = LONE_PRIOR_WEIGHT if alone else PRIOR_WEIGHT
        return Shares(*self._source_shares(row, "lookup", weight), *self._source_shares(row, "model", weight))

    def _source_shares(self, row, source: str, weight: float) -> tuple[float, float]:
        engine, mine = getattr(self.engine, source), getattr(row.acceptance, source)
        first = mine.first.estimate(engine.first.estimate(self.first_prior[source], ENGINE_PRIOR_WEIGHT), weight)
        return first, mine.later.estimate(engine.later.estimate(first, ENGINE_PRIOR_WEIGHT), weight)

    def _fit(self, rows: int) -> CostFit:
        """The cost fit of ``rows`` rows, started from the nearest batch size's plain step. A mixture's plain step of
        ``B`` rows reads the union of their experts, ``weights(B)`` of a one-token forward's weights, while a dense
        draft reads its own once whatever ``B``: its share of the step is ``draft_ratio / weights(B)``."""
        if rows not in self.fits:
            start = self.fits[min(self.fits, key=lambda b: abs(b - rows))].theta[0] if self.fits else None
            slope = prior_slope(rows, self.max_k, self.mixture)  # c_0 per extra token
            share = self.draft_ratio if self.mixture is None else self.draft_ratio / self.mixture.weights(rows)
            self.fits[rows] = CostFit(slope, share, start, margin=1.0 if rows == 1 else self.margin)
        return self.fits[rows]


def prior_slope(rows: int, max_k: int, mixture: Mixture | None) -> float:
    """The cost fit's prior for an extra verified token at ``rows`` rows, in plain steps ``c_0``.

    Dense: ``1 / max(B, KNEE_TOKENS)`` (the module docstring): the weights are read once whatever the tokens, and a
    token adds its arithmetic. A mixture of experts adds the bytes of the experts its extra tokens bring into the
    union (:class:`~batchspec.model_checks.Mixture`): a plain step's ``B`` tokens read ``weights(B)`` of a one-token
    forward's weights, a verification of ``x`` more ``weights(B + x)``, so the extra tokens cost
    ``(weights(B + x) - weights(B)) / weights(B)`` plain steps beyond their arithmetic. The union grows ever slower
    (concave), so a linear price is a chord; it is taken to the widest verification the planner may choose
    (``x = B max_k``): below it the chord prices a round low, above it no round goes. A round priced low is run,
    and its measured seconds teach the fit its slope; one priced high is never run at that batch size, and its
    price would never be corrected. At ``B = 1``, 8 experts, top 2 and the experts 0.65 of the weights, ``max_k``
    8: ``1/16 + (2.75 - 1) / 8 = 0.28`` (a dense target's 0.0625); once ``B`` tokens already run every expert, the
    dense slope alone."""
    dense = 1 / max(rows, KNEE_TOKENS)
    if mixture is None:
        return dense
    widest = rows * max(max_k, 1)
    now = mixture.weights(rows)
    return dense + (mixture.weights(rows + widest) - now) / (widest * now)


def planner_for(config: SpecConfig, draft_share: float, *, ragged: bool, mixture: Mixture | None = None,
                model_prior: float | None = None) -> FixedLength | AdaptiveLength:
    """The draft-length policy of ``config``: no drafts without speculation, a fixed ``num_draft_tokens``, or (``auto``)
    the adaptive planner, whose cost prior is ``draft_share``, the weights a draft forward multiplies by over a target
    forward's (0 for prompt lookup), and ``mixture``, the target's experts (None: dense, see :func:`prior_slope`);
    it deals drafts out per row where the verification is ``ragged``. ``model_prior``: the draft model's first draft's
    chance before any was tested, where its proposer knows it better than :data:`FIRST_PRIOR` (None: that)."""
    if not config.speculative:
        return FixedLength(0, ragged=ragged)
    if not config.adaptive:
        return FixedLength(config.num_draft_tokens, ragged=ragged)
    return AdaptiveLength(config.max_draft_tokens, draft_share, ragged=ragged, mixture=mixture, model_prior=model_prior)


def _drain_worth(rows, fit: CostFit, rates: list[float]) -> list[float]:
    """What a token of each row is worth to a batch that drains (no row takes the place of one that finishes: an
    offline batch once no prompt waits). The batch ends when its last row does: a token
    shortens it only where it shortens the row that finishes last; any row's token saves the column it would have
    taken in a later step.

    From now on the batch costs about ``shared * max_i T_i + c_v * sum_i left_i``: ``T_i = left_i / rates[i]`` is the
    rounds row ``i`` still needs at the tokens it gains a round, and ``shared`` the part of a step no row's absence
    saves (reading the weights: the fitted plain step ``c_0`` less its rows' columns at the fitted ``c_v`` each). A
    row's token is thus worth ``c_v`` plus its share of ``shared``: its chance of finishing last, taken as falling
    by ``e`` for every :data:`LAST_ROUNDS` rounds it is ahead of the slowest row. Where every row is as far from its
    end (the start of an offline batch), each token is worth ``c_0 / B``, what every token is worth while finished
    rows are replaced; a row far ahead is worth ``c_v`` a token and drafts only where its drafts cost less than the
    columns they save, while the rows that hold the batch up draft more boldly.
    """
    c0, per_token = fit.theta
    shared = max(c0 - len(rows) * per_token, 0.0)
    rounds = [row.remaining / rate for row, rate in zip(rows, rates, strict=True)]
    last = [math.exp((left - max(rounds)) / LAST_ROUNDS) for left in rounds]
    return [per_token + shared * chance / sum(last) for chance in last]


def _gains(cap: int, found: int, shares: Shares, uses_draft_model: bool) -> list[float]:
    """What each of a row's drafts ``1 .. cap`` adds to its expected tokens (``E(m) = 1 + sum(gains[:m])``): its
    ``found`` lookups first, then the draft model's, each source's first draft at its ``first`` share and the ones
    after it at its ``later`` one; a row without a draft model stops at its lookups."""
    gains, chance = [], 1.0
    for j in range(1, cap + 1):
        if j > found and not uses_draft_model:
            break
        if j <= found:
            chance *= shares.lookup_first if j == 1 else shares.lookup_later
        else:
            chance *= shares.model_first if j == found + 1 else shares.model_later
        gains.append(chance)
    return gains


def _trusted(gains: list[float], found: int, trust: tuple[float, float]) -> list[float]:
    """A row's :func:`_gains`, each scaled by its source's :attr:`Trust.factor` (``trust``: the lookups', the
    draft model's; its first ``found`` drafts are lookups)."""
    return [gain * trust[j >= found] for j, gain in enumerate(gains)]


def _ranked(gains: list[list[float]], worth: list[float]) -> list[tuple[float, int, int]]:
    """Every draft ``(worth[i] * gains[i][j], i, j)`` (row ``i``'s ``(j+1)``-th), the most worth first: a round of
    longest proposal ``k`` deals the ones with ``j < k`` in this order."""
    return sorted(((worth[i] * g, i, j) for i, row in enumerate(gains) for j, g in enumerate(row)), reverse=True)


def _draft_steps(k: int, caps: list[int], reach: Reach, sampled: bool) -> int:
    """Draft forwards a round of longest proposal ``k`` runs."""
    if not reach.uses_draft_model:
        return 0
    needs_model = any(min(k, cap) > found for cap, found in zip(caps, reach.lookups, strict=True))
    return (k if needs_model else 0) + int(sampled)


def _tests(n: int, a: int, chained: list[bool]) -> dict[tuple[str, str], tuple[int, int]]:
    """``{(source, place): (accepted, tested)}`` of one row: drafts ``1 .. a`` were accepted and draft ``a + 1`` (if
    it was proposed) rejected; each counts for the source the planner priced it as (``chained``: a lookup), as that
    source's ``first`` draft or a ``later`` one."""
    counts = dict.fromkeys(_PLACES, (0, 0))
    for j in range(min(a + 1, n)):
        source = "lookup" if chained[j] else "model"
        place = "first" if j == 0 or chained[j - 1] != chained[j] else "later"
        accepted, tested = counts[source, place]
        counts[source, place] = (accepted + int(j < a), tested + 1)
    return counts
