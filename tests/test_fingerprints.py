"""The committed fingerprints (``src/batchspec/bench/fingerprints.json``) recomputed on this host in a process whose
torch dispatches to its scalar code (``ATEN_CPU_CAPABILITY=default``, what a CPU without AVX2 runs): the exact pairs'
logits, greedy tokens and seeded sampled tokens with their logprobs, int8 and int4 (large tests,
``BATCHSPEC_LARGE_TESTS=1``). ``tests/test_real_model.py`` checks smollm2's in CI on this CPU's build (and every
build's logits against it), and that one changed bit of one weight moves them; the qwen2.5-coder pair here under every
build and thread count too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import cached_or_skip

from batchspec.bench.fingerprint import committed, fingerprint
from batchspec.exact.integer import native
from batchspec.models import loading

LARGE = pytest.mark.skipif(not os.environ.get("BATCHSPEC_LARGE_TESTS"),
                           reason="loads a pair in processes of their own (1-4 minutes); set BATCHSPEC_LARGE_TESTS=1")
MODES = ("int8", "int4")


@LARGE
@pytest.mark.parametrize("preset", ["smollm2", "qwen2.5-coder"])
def test_torchs_scalar_dispatch_gives_the_committed_fingerprints(preset):
    """In a process of its own, as a CPU without AVX2 runs torch: the rotary frequencies (torch's vector ``pow``
    rounds Qwen's 37th the other way) and every other table are the same bits. A large test: a process of its own
    loading the pair took 40-85 s of CI's 8 minutes on a 2-core host; CI checks the scalar dispatch on tiny models
    (``tests/test_integer_builds.py``) and the frequencies' rounding on any host (``tests/test_int8.py``)."""
    cached_or_skip(preset)
    environment = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    done = subprocess.run([sys.executable, "-m", "batchspec.bench.fingerprint", preset, *MODES], env=environment,
                          capture_output=True, text=True, timeout=900, check=True)
    assert json.loads(done.stdout) == {mode: committed(preset)[mode] for mode in MODES}


@LARGE
@pytest.mark.parametrize("mode", MODES)
def test_the_qwen_pair_gives_its_committed_fingerprint_on_every_build_and_thread_count(mode):
    cached_or_skip("qwen2.5-coder")
    pair, want = loading.load_pair("qwen2.5-coder", quantize=mode, progress=False), committed("qwen2.5-coder")[mode]
    threads = torch.get_num_threads()
    try:
        for isa, count in [(isa, 2) for isa in native.host_isas()] + [(native.isa(), 1), (native.isa(), 16)]:
            torch.set_num_threads(count)
            with native.using(isa):
                assert fingerprint(pair) == want, (isa, count)
    finally:
        torch.set_num_threads(threads)
