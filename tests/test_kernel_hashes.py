"""Every build of the native kernels gives the same bits on x86-64 and on aarch64: ``scripts/aarch64_check.py`` hashes
every kernel's outputs over random cases (rows holding an inf or a NaN among them) with each build this host runs and,
on an x86-64 host, with the aarch64 builds (``neon``, ``portable``) cross-compiled and run under ``qemu-aarch64``."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "aarch64_check.py"
TOOLS = () if platform.machine() in ("aarch64", "arm64") else ("aarch64-linux-gnu-gcc", "qemu-aarch64")
MISSING = [tool for tool in (os.environ.get("CC", "cc"), *TOOLS) if shutil.which(tool) is None]

LARGE = pytest.mark.skipif(not os.environ.get("BATCHSPEC_LARGE_TESTS"),
                           reason="compiles every build and runs two under qemu (about a minute); set "
                                  "BATCHSPEC_LARGE_TESTS=1")


@LARGE
@pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} (Debian: gcc-aarch64-linux-gnu, qemu-user)")
def test_every_build_hashes_the_same_on_x86_64_and_aarch64():
    """200 random cases a kernel (the product and the int4 product with bias and residual, each quantizer, SiLU,
    RMSNorm, KV packing, the attention; every float16 pattern's conversion): one hash a kernel on every build."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--cases", "200"], capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every kernel's hash is the same" in done.stdout
