"""``batchspec audit``: does each method reproduce the target's own greedy output, and where not, why?

For every method and batch size the outputs are compared with the reference (the target alone, greedy, batch
size 1). Every divergence is reported with its position, the reference's margin between its two highest logits
there, and that margin counted in steps of the dtype's resolution at the top logit.

**The near-tie rule.** A batched forward pass rounds differently from a single-row one, so where the reference's
two best logits are (nearly) tied the argmax may legitimately flip. How near is near depends on the dtype the
models run in: adjacent representable numbers of magnitude ``x`` are ``spacing(x) = 2**(floor(log2 |x|) - m)``
apart, ``m`` being the dtype's mantissa bits (``torch.finfo(dtype).eps == 2**-m``: 7 for bfloat16, 10 for float16,
23 for float32). At logits of magnitude 16 to 32 that is 0.125 in bfloat16 and about 1.9e-6 in float32. A
divergence is a *near-tie* when

    margin <= NEAR_TIE_ULPS * spacing(|top-1 logit|)        (NEAR_TIE_ULPS = 4)

that is, when the two best logits are at most four rounding steps apart, slack for rounding differences that
build up over the layers of the two differently batched forwards. A larger margin cannot be explained by rounding:
it fails the audit and points at a synchronisation bug. A method that goes on where the reference ended has an
infinite margin. ``batchspec audit --near-tie-ulps`` overrides the multiple.

**int8 pairs: no near-ties.** The exact int8 models of ``--quantize int8`` (:mod:`batchspec.exact.integer`) compute
each row's logits with arithmetic that does not depend on the batch, the padding or the tokens beside it: they are
bit-identical in every forward, so rounding cannot flip an argmax and the near-tie rule does not apply. Auditing
an int8 pair judges with :data:`EXACT_RULE`: every divergence is a failure (``near_tie`` is False even at an exact
tie, which the same logits break the same way on both sides), ``near_tie_ulps`` is recorded as 0 and ``audit.json``
records ``"quantize": "int8"`` with a ``near_tie_rule`` saying that the rule does not apply. ``margin_ulps`` is
still given, in spacings of the activations' dtype.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from batchspec.bench.reference import Reference, first_divergence, load_or_compute_reference, match_summary
from batchspec.bench.runners import draft_length, plan_cells, runner_for, runs
from batchspec.bench.workload import Workload
from batchspec.exact.integer import quantization
from batchspec.exact.invariant import batch_invariant
from batchspec.models.pair import ModelPair

NEAR_TIE_ULPS = 4.0
NEAR_TIE_RULE = (
    "near-tie: margin <= near_tie_ulps * spacing(|top-1 logit|), spacing(x) = 2**(floor(log2 x) - mantissa bits "
    "of dtype) = torch.finfo(dtype).eps * 2**floor(log2 x); a larger margin is a failure"
)
EXACT_NEAR_TIE_RULE = (
    "the near-tie rule does not apply (quantize int8): each row's logits are bit-identical whatever the batch, so "
    "every divergence is a failure"
)


def float_dtype(name: str) -> torch.dtype:
    """The torch floating-point dtype called ``name`` (``"bfloat16"``, ``"float32"``, ...)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{name!r} is not a floating-point dtype; near-ties are judged in the models' dtype")
    return dtype


def spacing(magnitude: float, dtype: torch.dtype) -> float:
    """Distance between adjacent numbers of ``dtype`` at ``|magnitude|``: ``2**(floor(log2 |x|) - mantissa bits)``."""
    info = torch.finfo(dtype)
    _, exponent = math.frexp(max(abs(magnitude), info.tiny))  # |x| = f * 2**exponent, 0.5 <= f < 1
    return math.ldexp(info.eps, exponent - 1)


@dataclass(frozen=True)
class NearTieRule:
    """A divergence is a near-tie when the reference's margin is at most ``ulps`` spacings of its top logit; with
    ``exact`` (the rule of an int8 pair, :data:`EXACT_RULE`) no divergence is."""

    ulps: float = NEAR_TIE_ULPS
    exact: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.ulps, bool) or not isinstance(self.ulps, int | float) or not 0 <= self.ulps < math.inf:
            raise ValueError(f"the near-tie multiple must be a finite number >= 0; got {self.ulps!r}")

    def margin_ulps(self, margin: float, top_logit: float | None, dtype: torch.dtype) -> float:
        """``margin`` in spacings of ``dtype`` at ``top_logit`` (infinite without a reference logit)."""
        if top_logit is None:
            return math.inf
        return margin / spacing(top_logit, dtype)

    def holds(self, margin_ulps: float) -> bool:
        return not self.exact and margin_ulps <= self.ulps


EXACT_RULE = NearTieRule(ulps=0.0, exact=True)


def rule_for(pair: ModelPair, workload: Workload, rule: NearTieRule) -> NearTieRule:
    """The rule that judges ``pair``'s outputs: ``rule``, or :data:`EXACT_RULE` for an int8 or int4 pair
    (``pair.quantize``, or its target's modules, say so) and for a batch-invariant one
    (:mod:`batchspec.exact.invariant`). A ValueError when ``workload.quantize`` names another quantization: the
    reference (keyed by the workload) would be another model's."""
    made = quantization(pair.target)
    quantize = made if made != "none" else pair.quantize
    if workload.quantize != quantize:
        raise ValueError(
            f"the workload records quantize {workload.quantize!r} but the models are {quantize!r}: "
            f"build the Workload with quantize={quantize!r}"
        )
    return EXACT_RULE if quantize != "none" or batch_invariant(pair.target) else rule


@dataclass(frozen=True)
class Divergence:
    """Where one output first differs from the reference.

    Attributes:
        prompt: prompt index.
        position: generated-token index of the first difference.
        expected, got: the reference's token and the method's (None where a sequence had already ended).
        top_logit: the reference's top-1 logit at ``position`` (None where the reference had ended).
        margin: the reference's top-1 minus top-2 logit at ``position`` (infinite where it had ended).
        margin_ulps: ``margin`` in spacings of the dtype at ``top_logit`` (see the module docstring).
        near_tie: ``margin_ulps`` is within the audit's near-tie multiple.
    """

    prompt: int
    position: int
    expected: int | None
    got: int | None
    top_logit: float | None
    margin: float
    margin_ulps: float
    near_tie: bool


@dataclass
class AuditCell:
    """One method at one batch size (and draft length ``num_draft_tokens``) against the reference."""

    method: str
    batch_size: int
    exact_match: float
    partial_match: float
    divergences: list[Divergence] = field(default_factory=list)
    num_draft_tokens: int | str | None = None
    proposer: str | None = None

    @property
    def failures(self) -> list[Divergence]:
        return [d for d in self.divergences if not d.near_tie]


@dataclass
class AuditReport:
    """Every audited cell of one workload, judged with the near-tie multiple ``near_tie_ulps``, or, for an int8
    workload (``quantize``), with no near-ties at all (see the module docstring)."""

    model: str
    dtype: str
    prompts: int
    max_new_tokens: int
    near_tie_ulps: float
    cells: list[AuditCell]
    quantize: str = "none"

    @property
    def passed(self) -> bool:
        return not any(cell.failures for cell in self.cells)

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["near_tie_rule"] = NEAR_TIE_RULE if self.quantize == "none" else EXACT_NEAR_TIE_RULE
        out["passed"] = self.passed
        return out

    def write(self, out_dir: Path) -> None:
        """Write ``audit.json`` into ``out_dir``."""
        (out_dir / "audit.json").write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")


def empty_report(workload: Workload, rule: NearTieRule) -> AuditReport:
    """A report of ``workload`` with no cells yet."""
    return AuditReport(
        workload.model, workload.dtype, len(workload.prompts), workload.max_new_tokens, rule.ulps, [],
        workload.quantize,
    )


def audit_cell(
    method: str,
    batch_size: int,
    workload: Workload,
    sequences: list[list[int]],
    reference: Reference,
    rule: NearTieRule,
    proposer: str | None = None,
) -> AuditCell:
    """``sequences`` (a method's output at ``batch_size`` on ``workload``, with ``proposer``) against the
    reference."""
    match = match_summary(sequences, reference.sequences)
    divergences = find_divergences(sequences, reference, rule, float_dtype(workload.dtype))
    return AuditCell(
        method, batch_size, match.exact_match, match.partial_match, divergences,
        draft_length(method, workload.num_draft_tokens), proposer,
    )


def find_divergences(
    sequences: list[list[int]], reference: Reference, rule: NearTieRule, dtype: torch.dtype
) -> list[Divergence]:
    """The first divergence of every sequence that differs from the reference, judged by ``rule`` in ``dtype``."""
    found = []
    for prompt, (got, expected) in enumerate(zip(sequences, reference.sequences, strict=True)):
        position = first_divergence(got, expected)
        if position is None:
            continue
        ended = position >= len(expected)  # the method went on where the reference had stopped
        top = None if ended else reference.top_logits[prompt][position]
        margin = math.inf if ended else reference.margins[prompt][position]
        ulps = rule.margin_ulps(margin, top, dtype)
        found.append(
            Divergence(
                prompt=prompt,
                position=position,
                expected=None if ended else expected[position],
                got=got[position] if position < len(got) else None,
                top_logit=top,
                margin=margin,
                margin_ulps=ulps,
                near_tie=rule.holds(ulps),
            )
        )
    return found


def run_audit(
    pair: ModelPair,
    workload: Workload,
    methods: tuple[str, ...],
    batch_sizes: tuple[int, ...],
    *,
    proposers: tuple[str, ...] = ("draft",),
    rule: NearTieRule = NearTieRule(),
    out_dir: Path | None = None,
    progress: bool = True,
) -> AuditReport:
    """Audit ``methods`` (the speculative ones with each of ``proposers``) at ``batch_sizes``; writes
    ``audit.json`` into ``out_dir`` when given. An int8 pair is judged with :data:`EXACT_RULE` instead of
    ``rule`` (see :func:`rule_for`)."""
    float_dtype(workload.dtype)
    rule = rule_for(pair, workload, rule)
    cache = None if out_dir is None else out_dir / "reference.json"
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    reference = load_or_compute_reference(pair, workload, cache, progress)
    report = empty_report(workload, rule)
    todo = [where for where in plan_cells(methods, proposers, batch_sizes) if runs(where)]
    for method, proposer, batch_size in tqdm(todo, desc="audit", unit="cell", disable=not progress):
        sequences = runner_for(method)(pair, workload, batch_size, progress=progress, proposer=proposer).sequences
        report.cells.append(audit_cell(method, batch_size, workload, sequences, reference, rule, proposer))
    if out_dir is not None:
        report.write(out_dir)
    return report
