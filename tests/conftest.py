"""Shared fixtures for the batchspec test suite (the plain helpers they use are in ``helpers.py``,
``fabricated.py`` and ``serving.py``; test modules import those, never each other).

* ``bundles``: session-scoped tiny targets (llama, qwen2, qwen3, mistral) with their three drafts and EOS/pad ids.
* ``reference``: ``reference_greedy`` (HF ``generate`` on one prompt alone, batch size 1), cached.
* ``make_prompts``: seeded prompts of very different lengths containing the pad and EOS ids.
* ``check``: result/stat assertions shared by the test modules.
* ``future_warnings_from_batchspec_fail`` (every test): a FutureWarning raised under a batchspec call fails the test.
* ``bench_tiny`` and ``tiny_dirs``: a tiny pair with a workload for the bench and audit, and tiny saved models for
  the ``bench``, ``audit`` and ``costs`` commands.
* ``served`` and ``served_dirs``: tiny models with a word tokenizer as the server serves them, and saved to
  directories for servers started as a process.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
import warnings
from functools import partial
from pathlib import Path

# A CPU build of torch runs the batch-invariant Triton kernels in Triton's interpreter (tests/test_invariant.py).
# It must be chosen before triton is first imported, which importing torch can do.
if "+cpu" in importlib.metadata.version("torch"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# The package uses a src layout; make it importable when it is not installed in the environment.
_SRC = Path(__file__).resolve().parents[1] / "src"
if importlib.util.find_spec("batchspec") is None and _SRC.is_dir():
    sys.path.insert(0, str(_SRC))

import tiny_models  # noqa: E402  (tests/ is on sys.path under pytest's default import mode)
from helpers import Checks, make_prompts_for, reference_greedy  # noqa: E402

# two workers (pytest -n 2, as scripts/setup.sh runs the suite) share the two cores: one torch thread each
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


# --------------------------------------------------------------------------------------------------
# deprecations

BATCHSPEC_DIR = str(Path(importlib.util.find_spec("batchspec").origin).parent) + os.sep


def batchspec_caller(frame) -> str | None:
    """The module (path under ``batchspec/``) of the innermost batchspec frame on the stack from ``frame`` up, the
    batchspec call that led there; None when batchspec's code is not on the stack."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(BATCHSPEC_DIR):
            return filename.removeprefix(BATCHSPEC_DIR).replace(os.sep, "/")
        frame = frame.f_back
    return None


def raise_if_from_batchspec(log, message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` while a test runs: a FutureWarning raised under a batchspec call is raised as an
    error where it is warned; any other warning is kept in ``log``."""
    if issubclass(category, FutureWarning) and batchspec_caller(sys._getframe(1)) is not None:
        raise message
    log.append(warnings.WarningMessage(message, category, filename, lineno, file, line))


@pytest.fixture(autouse=True)
def future_warnings_from_batchspec_fail():
    """A FutureWarning raised while batchspec's own code is on the stack fails the test, so that a name transformers
    or torch deprecates is caught the day the deprecation lands, wherever the warning says it comes from
    (transformers' deprecated arguments name ``torch.nn.Module.__call__`` as the caller, not batchspec).

    Other warnings, and FutureWarnings of the tests' own calls of transformers, are handed on to pytest as they
    came. pyproject.toml's ``error::FutureWarning:batchspec`` filter covers the warnings ascribed to a batchspec
    module outside a test (at import, during collection).
    """
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always", FutureWarning)
        warnings.showwarning = partial(raise_if_from_batchspec, log)
        yield
    shown: dict = {}  # as a module's registry: a warning the filters show once is shown once
    for caught in log:
        warnings.warn_explicit(
            caught.message, caught.category, caught.filename, caught.lineno, registry=shown, source=caught.source
        )


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


@pytest.fixture(scope="session")
def reference():
    return reference_greedy


@pytest.fixture(scope="session")
def make_prompts():
    return make_prompts_for


@pytest.fixture(scope="session")
def check() -> type[Checks]:
    return Checks


# --------------------------------------------------------------------------------------------------
# the bench, the audit and the commands


@pytest.fixture(scope="module")
def bench_tiny(bundles):
    """A tiny llama pair (the perturbed draft) and a workload of five random prompts for it."""
    from batchspec.bench import Workload
    from batchspec.models import ModelPair

    bundle = bundles["llama"]
    pair = ModelPair(bundle.target, bundle.drafts["perturbed"], None, "tiny-llama", "float64")
    prompts = make_prompts_for(bundle, 5, seed=300, max_len=30)
    workload = Workload(
        model="tiny-llama", dtype="float64", prompt_source="random", prompts=tuple(tuple(p) for p in prompts),
        max_new_tokens=12, num_draft_tokens=3, eos_token_ids=(bundle.eos_id,), pad_token_id=bundle.pad_id,
    )
    return pair, workload


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """Tiny bf16 target and draft saved to ``target/`` and ``draft/``, and three prompts in ``prompts.txt``."""
    from fabricated import save_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    save_tiny_model(root / "target")
    save_tiny_model(root / "draft", layers=2)
    (root / "prompts.txt").write_text("hello world\ndef x\nreturn hello\n")
    return root


# --------------------------------------------------------------------------------------------------
# the server


@pytest.fixture(scope="module")
def served(llama):
    """The tiny llama pair with the word tokenizer, as the server serves it, and references for its prompts."""
    from serving import Served, word_tokenizer

    from batchspec.models import ModelPair

    models = ModelPair(llama.target, llama.drafts["perturbed"], word_tokenizer(llama.eos_id), "tiny", "float64")
    return Served(models, {})


@pytest.fixture(scope="module")
def served_dirs(served, tmp_path_factory) -> dict[str, Path]:
    """The served target and draft saved with their tokenizer, for servers started as a process."""
    root = tmp_path_factory.mktemp("served")
    dirs = {"target": root / "target", "draft": root / "draft"}
    for role, model in (("target", served.models.target), ("draft", served.models.draft)):
        model.save_pretrained(dirs[role])
        served.tokenizer.save_pretrained(dirs[role])
    return dirs
