"""Forward costs: what one target and one draft forward cost on this hardware, and what that allows.

A greedy speculative round over ``B`` rows costs ``k`` draft forwards of one new token per row and one target
forward of ``k + 1`` new tokens per row, and gives each row ``E`` tokens on average (the mean accepted length:
accepted drafts plus the bonus token). Plain decoding pays one target forward of one token per row for each
token. Writing ``c_t(B, n)`` and ``c_d(B, n)`` for the seconds of one target / draft forward of ``n`` new tokens
per row over ``B`` rows (on top of a cache of ``context`` columns)::

    round      = k * c_d(B, 1) + c_t(B, k + 1)
    speedup    = E * c_t(B, 1) / round                   (over plain batched decoding at the same B)
    E needed   = round / c_t(B, 1)                       (mean accepted length where speculation breaks even)
    c_d needed = (E * c_t(B, 1) - c_t(B, k + 1)) / k     (draft cost where it breaks even, for a measured E)

Example: ``c_t(8, 1) = 0.40 s``, ``c_t(8, 6) = 0.70 s``, ``c_d(8, 1) = 0.20 s``, ``k = 5``: a round costs
1.70 s, so speculation pays only when rows gain more than 1.70 / 0.40 = 4.25 tokens per round; with ``E = 5.5``
the speedup is 5.5 * 0.40 / 1.70 = 1.29.

Against the limit: a one-token step reads every weight it multiplies by once (:func:`weight_bytes`), so it cannot
take less than those bytes over the device's read bandwidth (:func:`read_bandwidth`, measured). Example: 1.58 GB of
int8 weights at 50 GB/s is a 31.6 ms floor; a step of 76 ms reads them at 20.8 GB/s, 2.4x the floor.

A mixture of experts' forward reads, of each sparse block's experts, only the union its tokens chose: a one-token
step ``top_k`` of them, a verification of ``B (k + 1)`` tokens more. Each timed forward keeps the experts it ran
(:attr:`ForwardCost.experts`, each block's ``touched`` flags after it, which the fused forward writes) and the bytes
they make (:attr:`ForwardCost.bytes_read`), and :func:`union_reads` sets every width of the target against the union
expected of as many tokens (:class:`~batchspec.model_checks.Mixture`, which the draft-length planner's prior
follows) and against its floor, those bytes over the read bandwidth.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch

from batchspec.config import DEFAULT_DRAFT_VOCABULARY
from batchspec.engine import BatchKVCache, BatchState, ModelRunner
from batchspec.exact.integer.moe import SparseMoE
from batchspec.exact.integer.product import PackedWeight
from batchspec.model_checks import mixture_of
from batchspec.models.packing import PackedLinear

DEFAULT_CONTEXT = 128  # cached columns before the timed tokens
DEFAULT_REPEATS = 3  # timed forwards per cost (their median)


@dataclass(frozen=True)
class ForwardCost:
    """Median seconds of one forward of ``new_tokens`` tokens per row over ``batch_size`` rows; ``experts``: per sparse
    block, the experts it ran (none for a dense model), and ``bytes_read``, :func:`weight_bytes` less the experts it
    did not run (:func:`read_bytes`; 0 where not counted)."""

    model: str
    batch_size: int
    new_tokens: int
    context: int
    seconds: float
    experts: tuple[int, ...] = ()
    bytes_read: int = 0


@dataclass(frozen=True)
class SpeculationCost:
    """What the forward costs imply for speculative decoding at one batch size (terms in the module docstring).

    Attributes:
        target_step_s: ``c_t(B, 1)``; verify_s: ``c_t(B, k+1)``; draft_step_s: ``c_d(B, 1)``.
        round_s: ``k * c_d(B, 1) + c_t(B, k+1)``.
        break_even_accepted_length: the ``E`` at which a round costs as much as ``E`` plain steps.
        mean_accepted_length: the measured ``E`` given, if any.
        predicted_speedup: ``E * c_t(B, 1) / round_s`` for the given ``E``.
        break_even_draft_step_s: the ``c_d(B, 1)`` at which speculation breaks even for the given ``E``.
    """

    batch_size: int
    num_draft_tokens: int
    target_step_s: float
    verify_s: float
    draft_step_s: float
    round_s: float
    break_even_accepted_length: float
    mean_accepted_length: float | None
    predicted_speedup: float | None
    break_even_draft_step_s: float | None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a one-token forward of ``model`` reads: every parameter and buffer (an int8 layer's
    packed weight and a float32 layer's oneDNN copy too), each tensor once, except the tables a step reads one row of
    per token: the input embedding table (unless a tied output layer shares it, which reads all of it; a packed one
    reads its own copy) and the rotary embedding's (``rotary_emb``; the int8 model's holds every position's cos and
    sin)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    table = getattr(embedding, "weight", None)  # none where the embedding holds a GGUF file's blocks
    tied = table is not None and getattr(output, "weight", None) is table
    reads_table = tied and not isinstance(output, PackedLinear)
    seen, total = set(), 0
    for name, module in model.named_modules():
        looked_up = module is embedding and not reads_table
        if looked_up or name.endswith("rotary_emb"):
            continue
        packed = getattr(module, "weight", None)
        total += packed.nbytes() if isinstance(packed, PackedWeight) else 0
        if isinstance(module, PackedLinear):  # oneDNN's copy of the weight, held instead of it
            total += module.packed.numel() * module.packed.element_size()
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.numel() * tensor.element_size()
    return total


def sparse_blocks(model: torch.nn.Module) -> list[SparseMoE]:
    """``model``'s mixtures of experts, in layer order (none for a dense model)."""
    return [block for block in model.modules() if isinstance(block, SparseMoE)]


def idle_expert_bytes(model: torch.nn.Module) -> int:
    """``weight_bytes`` of the experts no row of the last forward chose (0 for a dense model)."""
    return sum(weight_bytes(expert) for block in sparse_blocks(model)
               for expert, ran in zip(block.experts, block.touched.tolist(), strict=True) if not ran)


def read_bytes(model: torch.nn.Module) -> tuple[tuple[int, ...], int]:
    """What ``model``'s last forward read: the experts each sparse block ran (its ``touched``, a view of
    :attr:`~batchspec.exact.integer.forward.IntegerForward.touched` where the fused forward ran it) and the bytes,
    :func:`weight_bytes` less the experts it did not run."""
    ran = tuple(int(block.touched.sum()) for block in sparse_blocks(model))
    return ran, weight_bytes(model) - idle_expert_bytes(model)


@torch.inference_mode()
def read_bandwidth(device: torch.device | str, size: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second at which ``device`` reads a ``size``-byte float32 buffer it cannot cache (a sum over it,
    every thread torch uses; the median of ``repeats`` after a discarded first read)."""
    runner = ModelRunner(torch.device(device))
    buffer = torch.ones(size // 4, device=runner.device)  # [size / 4] float32
    seconds = []
    for _ in range(repeats + 1):
        start = runner.mark()
        buffer.sum()
        end = runner.mark()
        runner.wait()
        seconds.append(runner.seconds(start, end))
    return size / statistics.median(seconds[1:])


@dataclass(frozen=True)
class StepFloor:
    """A one-token step of ``model`` at ``batch_size`` against its floor: ``weight_bytes`` over the measured
    ``bandwidth`` (bytes/s).

    Attributes:
        floor_s: ``weight_bytes / bandwidth``, the least a step can take.
        achieved: bytes per second the step read its weights at (``weight_bytes / seconds``).
        over_floor: ``seconds / floor_s`` (1.0 is the limit).
    """

    model: str
    batch_size: int
    seconds: float
    weight_bytes: int
    bandwidth: float
    floor_s: float
    achieved: float
    over_floor: float


def step_floors(costs: list[ForwardCost], weights: dict[str, int], bandwidth: float) -> list[StepFloor]:
    """Each one-token step of ``costs`` (``c_t(B, 1)``, ``c_d(B, 1)``) against the bytes it read (``bytes_read``: a
    mixture's step reads only the experts it ran; where not counted, ``weights[model]``) at ``bandwidth`` bytes/s."""
    floors = []
    for cost in (c for c in costs if c.new_tokens == 1):
        size = cost.bytes_read or weights[cost.model]
        floor = size / bandwidth
        floors.append(StepFloor(cost.model, cost.batch_size, cost.seconds, size, bandwidth, floor,
                                size / cost.seconds, cost.seconds / floor))
    return floors


@torch.inference_mode()
def time_forward(model: torch.nn.Module, batch_size: int, new_tokens: int, context: int, repeats: int,
                 vocabulary: int = 0) -> float:
    """Median seconds of a forward of ``[batch_size, new_tokens]`` random tokens after ``context`` cached ones,
    through batchspec's model runner (timed on the device: CUDA events on a GPU); ``vocabulary``: a draft's
    (``SpecConfig.draft_vocabulary``; 0: every logit)."""
    runner = ModelRunner(next(model.parameters()).device)
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, (batch_size, context + new_tokens), generator=generator).to(runner.device)  # [B, C+n]
    cache = BatchKVCache.for_model(model)
    batch = BatchState.dense(ids, cache)
    runner.read(model, batch, cache, ids[:, :context])
    seconds = []
    for _ in range(repeats + 1):
        cache.crop(context)
        start = runner.mark()
        runner.logits(model, batch, cache, ids[:, context:], keep=new_tokens, vocabulary=vocabulary)
        end = runner.mark()
        runner.wait()
        seconds.append(runner.seconds(start, end))
    return statistics.median(seconds[1:])


def measure_forward_costs(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    batch_sizes: tuple[int, ...],
    draft_lengths: tuple[int, ...],
    *,
    context: int = DEFAULT_CONTEXT,
    repeats: int = DEFAULT_REPEATS,
    draft_vocabulary: int = DEFAULT_DRAFT_VOCABULARY,
) -> list[ForwardCost]:
    """``c_t(B, 1)``, ``c_t(B, k+1)`` for every ``k`` in ``draft_lengths`` and ``c_d(B, 1)``, for every ``B``
    (each median of ``repeats`` forwards after a discarded warm-up); the draft's over its first ``draft_vocabulary``
    ids, as it drafts (0: all)."""
    sizes = (*batch_sizes, *draft_lengths)
    if not batch_sizes or not draft_lengths or min(sizes) < 1 or context < 1 or repeats < 1:
        raise ValueError("need batch sizes and draft lengths, and every one of them, context and repeats >= 1")
    widths = sorted({1, *(k + 1 for k in draft_lengths)})
    plan = [("target", target, n, 0) for n in widths] + [("draft", draft, 1, draft_vocabulary)]
    costs = []
    for b in batch_sizes:
        for name, model, n, vocabulary in plan:
            seconds = time_forward(model, b, n, context, repeats, vocabulary)
            costs.append(ForwardCost(name, b, n, context, seconds, *read_bytes(model)))
    return costs


@dataclass(frozen=True)
class UnionRead:
    """One target forward of a mixture of experts (``B`` rows of ``new_tokens`` tokens each) against the union of
    experts its tokens touched.

    Attributes:
        experts_run: the experts a sparse block ran, the mean over the blocks (``top_k`` at one token).
        expected_union: the experts ``B * new_tokens`` uniformly routed tokens run in a block on average
            (:meth:`~batchspec.model_checks.Mixture.union`).
        bytes_read: :func:`weight_bytes` less the experts the forward did not run; expected_bytes: less those the
            expected union leaves out.
        floor_s: ``bytes_read / bandwidth``; over_floor: ``seconds / floor_s``.
    """

    batch_size: int
    new_tokens: int
    seconds: float
    experts_run: float
    expected_union: float
    bytes_read: int
    expected_bytes: int
    bandwidth: float
    floor_s: float
    over_floor: float


def union_reads(costs: list[ForwardCost], target: torch.nn.Module, bandwidth: float) -> list[UnionRead]:
    """Every target forward of ``costs`` (measured on ``target``) against the experts it touched and its floor at
    ``bandwidth`` bytes/s; none for a dense target."""
    mixture, blocks = mixture_of(target), sparse_blocks(target)
    if mixture is None or not blocks:
        return []
    every, expert = weight_bytes(target), weight_bytes(blocks[0].experts[0])  # every expert of one size
    reads = []
    for cost in (c for c in costs if c.model == "target" and c.experts):
        expected = mixture.union(cost.batch_size * cost.new_tokens)
        expected_bytes = every - round(len(blocks) * (mixture.experts - expected) * expert)
        floor = cost.bytes_read / bandwidth
        reads.append(UnionRead(cost.batch_size, cost.new_tokens, cost.seconds, sum(cost.experts) / len(blocks),
                               expected, cost.bytes_read, expected_bytes, bandwidth, floor, cost.seconds / floor))
    return reads


def speculation_costs(costs: list[ForwardCost], mean_accepted_length: float | None = None) -> list[SpeculationCost]:
    """The break-even figures for every batch size and draft length ``k`` that ``costs`` (as measured by
    :func:`measure_forward_costs`) cover."""
    table = {(c.model, c.batch_size, c.new_tokens): c.seconds for c in costs}
    pairs = sorted((b, n - 1) for model, b, n in table if model == "target" and n > 1)
    out = []
    for b, k in pairs:
        step, verify, draft = table[("target", b, 1)], table[("target", b, k + 1)], table[("draft", b, 1)]
        round_s = k * draft + verify
        e = mean_accepted_length
        out.append(
            SpeculationCost(
                batch_size=b,
                num_draft_tokens=k,
                target_step_s=step,
                verify_s=verify,
                draft_step_s=draft,
                round_s=round_s,
                break_even_accepted_length=round_s / step,
                mean_accepted_length=e,
                predicted_speedup=None if e is None else e * step / round_s,
                break_even_draft_step_s=None if e is None else (e * step - verify) / k,
            )
        )
    return out
