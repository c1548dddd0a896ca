"""Shared fixtures for the batchspec test suite.

* ``bundles``: session-scoped tiny targets (llama, qwen2) with their three drafts and EOS/pad ids.
* ``reference``: ``reference_greedy`` (HF ``generate`` on one prompt alone, batch size 1), cached.
* ``make_prompts``: seeded prompts of very different lengths containing the pad and EOS ids.
* ``check``: result/stat assertions shared by the test modules.
"""

from __future__ import annotations

import importlib.util
import math
import random
import sys
import weakref
from pathlib import Path

import pytest
import torch

# The package uses a src layout; make it importable when it is not installed in the environment.
_SRC = Path(__file__).resolve().parents[1] / "src"
if importlib.util.find_spec("batchspec") is None and _SRC.is_dir():
    sys.path.insert(0, str(_SRC))

import tiny_models  # noqa: E402  (tests/ is on sys.path under pytest's default import mode)

torch.set_num_threads(2)


# --------------------------------------------------------------------------------------------------
# models


@pytest.fixture(scope="session")
def bundles() -> dict[str, tiny_models.TargetBundle]:
    return {kind: tiny_models.build_bundle(kind) for kind in tiny_models.TARGET_KINDS}


@pytest.fixture(scope="session")
def llama(bundles) -> tiny_models.TargetBundle:
    return bundles["llama"]


@pytest.fixture(scope="session")
def qwen2(bundles) -> tiny_models.TargetBundle:
    return bundles["qwen2"]


@pytest.fixture(scope="session")
def bs():
    """The library under test (imported lazily so model-helper tests run without it)."""
    import batchspec

    return batchspec


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
        ids = torch.tensor([list(prompt)], dtype=torch.long)
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


@pytest.fixture(scope="session")
def reference():
    return reference_greedy


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


@pytest.fixture(scope="session")
def make_prompts():
    return make_prompts_for


# --------------------------------------------------------------------------------------------------
# shared assertions


class Checks:
    @staticmethod
    def result_matches(result, prompts, refs, max_new_tokens, eos_token_id) -> None:
        eos = set(_eos_tuple(eos_token_id))
        assert isinstance(result.sequences, list)
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
        st = result.stats
        total = sum(len(s) for s in result.sequences)
        assert st.generated_tokens == total
        assert 0 <= st.draft_tokens_accepted <= st.draft_tokens_proposed
        assert st.rounds >= 0
        assert 0 <= st.ragged_rounds <= st.rounds
        assert 0.0 <= st.acceptance_rate <= 1.0
        if st.draft_tokens_proposed > 0:
            assert st.acceptance_rate == pytest.approx(st.draft_tokens_accepted / st.draft_tokens_proposed)
        hist = dict(st.accepted_length_histogram)
        assert all(isinstance(n, int) and 0 <= n <= num_draft_tokens for n in hist), hist
        assert all(c >= 0 for c in hist.values()), hist
        if method == "autoregressive":
            assert st.draft_tokens_proposed == 0
            assert st.draft_tokens_accepted == 0
            assert st.ragged_rounds == 0
        else:
            assert sum(n * c for n, c in hist.items()) == st.draft_tokens_accepted, hist
        if total > 0:
            assert st.rounds >= 1
            # every round emits at least one token for every row that takes part in it
            assert math.isfinite(st.mean_tokens_per_row_round)
            assert st.mean_tokens_per_row_round >= 1.0 - 1e-9
            if method == "autoregressive":
                assert st.mean_tokens_per_row_round == pytest.approx(1.0)
        parts = [st.prefill_s, st.draft_s, st.verify_s, st.realign_s, st.other_s]
        assert all(p >= 0.0 for p in parts), parts
        assert st.wall_s >= 0.0
        assert abs(sum(parts) - st.wall_s) <= max(0.10 * st.wall_s, 0.005), (parts, st.wall_s)
        if method == "autoregressive":
            assert st.draft_s <= max(0.10 * st.wall_s, 0.005)


@pytest.fixture(scope="session")
def check() -> type[Checks]:
    return Checks
