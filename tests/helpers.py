"""Plain helpers shared by the test modules (the fixtures built on them live in ``conftest.py``).

* ``reference_greedy``: the target's own greedy continuation of one prompt (transformers' ``generate`` on the
  prompt alone, batch size 1), cached; ``cut_after_eos``.
* ``make_prompts_for``: seeded prompts of very different lengths containing the pad and EOS ids.
* ``Checks``: a run's outputs against the reference, its stats against each other and against outside clocks.
* ``forward_log`` and ``replay_eqspec``: independent observations of a run (every model forward, with its
  rows, mask and duration) and an independent recount of greedy EqSpec's rounds and acceptance.
* ``run_cli``: the ``batchspec`` command in process; ``cached_or_skip``: the real presets when cached.
* ``engine_for``: the engine ``batchspec.generate`` builds for a pair and its settings (``batchspec.run``).
* ``exact_joint`` and ``joint_pvalue``: the target's exact distribution of the first two sampled tokens and the
  chi-square p-value of observed pairs against it.
"""

from __future__ import annotations

import os
import random
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import tiny_models
import torch
from scipy import stats

from batchspec.config import SamplingParams
from batchspec.engine.sampling import warp
from batchspec.run import build_run, resolve_loaded

# --------------------------------------------------------------------------------------------------
# reference


def _eos_tuple(eos_token_id) -> tuple[int, ...]:
    if eos_token_id is None:
        return ()
    if isinstance(eos_token_id, int):
        return (eos_token_id,)
    return tuple(int(e) for e in eos_token_id)


def cut_after_eos(tokens: list[int], eos_token_id) -> list[int]:
    eos = set(_eos_tuple(eos_token_id))
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


_REF_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.no_grad()
def reference_greedy(target, prompt: list[int], max_new_tokens: int, eos_token_id) -> list[int]:
    """Greedy continuation of ``prompt`` by ``target`` run alone (batch size 1, no padding).

    Returns the new tokens only, cut right after the first EOS. Cached per (model, prompt,
    max_new_tokens, eos ids).
    """
    per_model = _REF_CACHE.setdefault(target, {})
    eos = _eos_tuple(eos_token_id)
    key = (tuple(prompt), int(max_new_tokens), eos)
    if key in per_model:
        return list(per_model[key])
    assert len(prompt) >= 1
    if max_new_tokens == 0:
        new: list[int] = []
    else:
        pad = target.generation_config.pad_token_id
        if pad is None:
            pad = eos[0] if eos else 0
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=target.device)
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=list(eos) if eos else None,
            pad_token_id=pad,
        )
        new = out[0, ids.shape[1] :].tolist()
        new = cut_after_eos(new, eos)
    assert len(new) <= max_new_tokens
    per_model[key] = tuple(new)
    return list(new)


# --------------------------------------------------------------------------------------------------
# prompts


def make_prompts_for(
    bundle: tiny_models.TargetBundle,
    n: int,
    seed: int,
    min_len: int = 1,
    max_len: int = 50,
    specials: bool = True,
) -> list[list[int]]:
    """``n`` seeded prompts with lengths spread over [min_len, max_len].

    With ``specials`` (and n >= 2), the shortest and longest possible lengths both occur, and the
    pad id and the EOS id appear as real tokens (in the middle, first and last positions).
    """
    rng = random.Random(seed)
    vocab = tiny_models.VOCAB_SIZE
    lengths = [rng.randint(min_len, max_len) for _ in range(n)]
    if n >= 2:
        lengths[0], lengths[1] = min_len, max_len
        rng.shuffle(lengths)
    prompts = [[rng.randrange(vocab) for _ in range(length)] for length in lengths]
    if specials and n >= 2:
        eos, pad = bundle.eos_id, bundle.pad_id
        for i, p in enumerate(prompts):
            mode = (i + seed) % 4
            if mode == 0:  # EOS as the last prompt token
                p[-1] = eos
            elif mode == 1:  # pad at the start (looks like left padding, but it is real)
                p[0] = pad
            elif mode == 2 and len(p) >= 3:  # both inside
                p[rng.randrange(len(p))] = eos
                p[rng.randrange(len(p))] = pad
            # mode 3: untouched
        flat = [t for p in prompts for t in p]
        if eos not in flat:
            prompts[0][-1] = eos
        if pad not in flat:
            prompts[-1][0] = pad
    return prompts


# --------------------------------------------------------------------------------------------------
# shared assertions


class Checks:
    @staticmethod
    def result_matches(result, prompts, refs, max_new_tokens, eos_token_id) -> None:
        eos = set(_eos_tuple(eos_token_id))
        assert len(result.sequences) == len(prompts), "one sequence per prompt"
        assert len(result.finish_reasons) == len(prompts), "one finish reason per prompt"
        mismatches = []
        for i, (seq, ref) in enumerate(zip(result.sequences, refs, strict=True)):
            seq = list(seq)
            assert all(isinstance(t, int) for t in seq), f"row {i}: tokens must be python ints"
            assert len(seq) <= max_new_tokens, f"row {i}: {len(seq)} tokens > max_new_tokens={max_new_tokens}"
            if seq != ref:
                first = next(
                    (j for j, (a, b) in enumerate(zip(seq, ref, strict=False)) if a != b),
                    min(len(seq), len(ref)),
                )
                mismatches.append(
                    f"row {i} (prompt len {len(prompts[i])}): first diff at {first}\n"
                    f"   got {seq}\n   ref {ref}"
                )
                continue
            eos_positions = [j for j, t in enumerate(seq) if t in eos]
            assert eos_positions in ([], [len(seq) - 1]), f"row {i}: tokens after EOS: {seq}"
            reason = result.finish_reasons[i]
            if seq and seq[-1] in eos:
                assert reason == "eos", f"row {i}: ends with EOS but finish_reason={reason!r}"
            else:
                assert len(seq) == max_new_tokens, f"row {i}: stopped early without EOS: {seq}"
                assert reason == "length", f"row {i}: finish_reason={reason!r}, expected 'length'"
        assert not mismatches, "outputs differ from the batch-size-1 reference:\n" + "\n".join(mismatches)

    @staticmethod
    def stats_consistent(result, method: str, num_draft_tokens: int) -> None:
        """Counters that must agree with the outputs and with each other (none holds by definition).

        ``test_stats_agree_with_a_replay_and_the_clock`` checks them against an independent replay and clock.
        """
        from batchspec.engine.metrics import STAGES

        st = result.stats
        total = sum(len(s) for s in result.sequences)
        assert st.generated_tokens == total
        hist = dict(st.accepted_length_histogram)
        assert all(isinstance(n, int) and 0 <= n <= num_draft_tokens for n in hist), hist
        assert sum(hist.values()) <= st.row_rounds, (hist, st.row_rounds)  # rounds drafting nothing have no entry
        assert st.row_rounds <= total, "every row gains at least one token in every round it takes part in"
        if method == "autoregressive":
            assert st.draft_tokens_proposed == st.draft_tokens_accepted == 0 and not hist
            assert st.ragged_rounds == 0 and st.row_rounds == total
        else:
            assert sum(n * c for n, c in hist.items()) == st.draft_tokens_accepted <= st.draft_tokens_proposed, hist
            assert st.draft_tokens_proposed <= num_draft_tokens * st.row_rounds
            assert total <= st.draft_tokens_accepted + st.row_rounds  # a row gains its accepted drafts + 1 at most
        assert (st.rounds >= 1) == (total > 0) and st.rounds <= st.row_rounds
        parts = [getattr(st, f"{stage}_s") for stage in STAGES]
        assert sum(parts) <= st.wall_s * (1 + 1e-9), f"the stages overlap: {parts} add up to more than {st.wall_s}"

    @staticmethod
    def clock_consistent(result, elapsed: float, forwards: dict[str, list[ForwardCall]]) -> None:
        """The stage times against clocks outside them: the whole call took ``elapsed`` seconds, and every forward
        in ``forwards[stage]`` (timed by hooks on the model) ran inside that stage."""
        from batchspec.engine.metrics import STAGES

        st = result.stats
        assert 0.0 < st.wall_s <= elapsed
        assert sum(getattr(st, f"{stage}_s") for stage in STAGES) <= st.wall_s * (1 + 1e-9)
        for stage, calls in forwards.items():
            inside = sum(call.seconds for call in calls)
            assert 0.0 < inside <= getattr(st, f"{stage}_s") + 1e-9, (stage, inside, st.to_dict())


# --------------------------------------------------------------------------------------------------
# independent observations of a run


@dataclass(frozen=True)
class ForwardCall:
    """One forward of a model: its batch rows, each row's attended (mask = 1) columns, and its seconds."""

    rows: int
    attended: tuple[int, ...]
    seconds: float


def attended_columns(mask: torch.Tensor) -> tuple[int, ...]:
    """Per row, the columns its last input attends to: from a 2D padding mask ``[B, C]``, or from the 4D mask
    ``[B, 1, q, C]`` the model runner builds (boolean for sdpa, additive with 0 for a seen column for eager)."""
    if mask.dim() == 2:
        return tuple(mask.sum(dim=1).tolist())
    seen = mask[:, 0, -1] if mask.dtype == torch.bool else mask[:, 0, -1] == 0  # [B, C]
    return tuple(seen.sum(dim=1).tolist())


@contextmanager
def forward_log(model) -> Iterator[list[ForwardCall]]:
    """Every forward call of ``model`` while inside, timed by hooks around the module's own forward."""
    calls: list[ForwardCall] = []
    started: list[float] = []

    def before(module, args, kwargs) -> None:
        started.append(time.perf_counter())

    def after(module, args, kwargs, output) -> None:
        seconds = time.perf_counter() - started.pop()
        calls.append(ForwardCall(kwargs["input_ids"].shape[0], attended_columns(kwargs["attention_mask"]), seconds))

    handles = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class Replay:
    """Greedy EqSpec's counters, recounted by :func:`replay_eqspec`."""

    outputs: list[list[int]]
    rounds: int = 0
    row_rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    ragged_rounds: int = 0
    histogram: Counter = field(default_factory=Counter)


@torch.no_grad()
def _replay_row(target, draft, prefix: list[int], k: int) -> tuple[int, list[int]]:
    """``(accepted drafts, tokens gained)`` of one row whose draft proposes ``k`` tokens after ``prefix``: plain
    forwards of the whole sequence, no cache, no padding."""
    ids = list(prefix)
    for _ in range(k):
        ids.append(int(draft(torch.tensor([ids])).logits[0, -1].argmax()))
    drafts = ids[len(prefix) :]
    truth = target(torch.tensor([ids])).logits[0, len(prefix) - 1 :].argmax(dim=-1).tolist()  # [k + 1]
    accepted = next((j for j in range(k) if drafts[j] != truth[j]), k)
    return accepted, truth[: accepted + 1]


def replay_eqspec(target, draft, prompts, *, batch_size: int, k: int, max_new: int, eos: int) -> Replay:
    """Greedy EqSpec recounted one row at a time with plain model calls, sharing no code with batchspec: one batch
    of at most ``batch_size`` rows, the next prompt in order joining before a round as soon as a row has finished;
    each round every unfinished row drafts ``min(k, its own budget left - 1)`` tokens and keeps those equal to the
    target's own greedy tokens, plus one of the target's."""
    replay = Replay(outputs=[[] for _ in prompts])
    queue, active = list(range(len(prompts))), []
    while queue or active:
        active, queue = active + queue[: batch_size - len(active)], queue[batch_size - len(active) :]
        drafting = []  # accepted drafts of the rows that proposed any
        for i in active:
            k_row = min(k, max_new - len(replay.outputs[i]) - 1)
            a, gained = _replay_row(target, draft, list(prompts[i]) + replay.outputs[i], k_row)
            drafting += [a] if k_row else []
            replay.proposed += k_row
            replay.accepted += a
            kept = gained[: max_new - len(replay.outputs[i])]
            replay.outputs[i] += kept[: kept.index(eos) + 1] if eos in kept else kept
        replay.rounds += 1
        replay.row_rounds += len(active)
        replay.ragged_rounds += int(len(set(drafting)) > 1)
        replay.histogram.update(drafting)
        active = [i for i in active if len(replay.outputs[i]) < max_new and eos not in replay.outputs[i]]
    return replay


# --------------------------------------------------------------------------------------------------
# the command line and the real presets


def engine_for(target, draft, config):
    """The engine of ``config`` on ``target`` and ``draft`` as ``batchspec.generate`` makes it: the run resolved for
    the loaded pair (:func:`batchspec.run.resolve_loaded`), then built (:func:`batchspec.run.build_run`)."""
    return build_run(resolve_loaded(config, target, draft), target, draft)


def run_cli(*args: str):
    """``batchspec ARGS...`` in process (typer's runner): the result with its exit code and output."""
    from typer.testing import CliRunner

    from batchspec.cli import app

    return CliRunner().invoke(app, list(args))


# Obtained by ``scripts/setup.sh test`` before pytest runs; qwen2.5-coder (1.6 GB of wheels, minutes of
# conversion) is only tested where a developer has fetched it.
CI_PRESETS = ("smollm2", "gemma3")


def cached_or_skip(name: str):
    """The cached preset's paths; skip when it is not cached, but fail in CI for the presets CI obtains."""
    from batchspec.config import default_cache_dir
    from batchspec.models.obtain import cached_preset

    paths = cached_preset(name)
    if paths is None:
        cache = default_cache_dir()
        message = f"preset {name} is not in the cache {cache}; run: batchspec fetch --preset {name}"
        if os.environ.get("CI") and name in CI_PRESETS:
            pytest.fail(message)
        pytest.skip(message)
    return paths


# --------------------------------------------------------------------------------------------------
# the joint distribution of the first two sampled tokens

MIN_EXPECTED = 5  # chi-square cells expecting fewer samples are pooled into one


@torch.no_grad()
def exact_joint(
    target: torch.nn.Module, prompt: list[int], params: SamplingParams, shaped=None
) -> torch.Tensor:
    """``[V, V]`` probability of the first two new tokens ``(t1, t2)``: warped target ``P(t1) P(t2 | t1)``, the
    logits passed first through ``shaped(logits [V], output so far)`` when given."""
    vocab = target.config.vocab_size
    shaped = shaped or (lambda logits, output: logits)
    first = warp(shaped(target(torch.tensor([prompt])).logits[0, -1], []), params)  # [V]
    extended = torch.tensor([prompt + [t] for t in range(vocab)])  # [V, len + 1]
    logits = target(extended).logits[:, -1]  # [V, V]
    second = torch.stack([warp(shaped(logits[t], [t]), params) for t in range(vocab)])  # [V, V]
    return first[:, None] * second


def joint_pvalue(sequences: list[list[int]], joint: torch.Tensor) -> float:
    """Chi-square p-value of the observed pairs against ``joint`` ``[V, V]``; 0 when a pair of probability 0
    occurs. Cells expecting fewer than ``MIN_EXPECTED`` samples are pooled into one."""
    vocab = joint.shape[0]
    pairs = torch.tensor(sequences)  # [n, 2]
    counts = torch.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab).double()  # [V * V]
    probs = joint.flatten()  # [V * V]
    if float(counts[probs == 0].sum()) > 0:
        return 0.0
    expected = probs * pairs.shape[0]  # [V * V]
    large, small = expected >= MIN_EXPECTED, (expected < MIN_EXPECTED) & (probs > 0)
    observed = torch.cat([counts[large], counts[small].sum()[None]])
    expected = torch.cat([expected[large], expected[small].sum()[None]])
    observed, expected = observed[expected > 0], expected[expected > 0]
    expected = expected * observed.sum() / expected.sum()  # exactly the observed total, as chisquare requires
    return float(stats.chisquare(observed.numpy(), expected.numpy()).pvalue)
