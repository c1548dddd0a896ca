"""Prove that every build of batchspec's native kernels gives the same bits, x86-64 and aarch64 alike.

Compiles ``scripts/kernel_hashes.c`` with each build's source and flags (``native.BUILDS``, ``native._FLAGS``): the
builds this host runs, natively, and, on a host that is not aarch64, the aarch64 builds (``neon``, ``portable``) with
Debian's cross compiler ``aarch64-linux-gnu-gcc``, run under ``qemu-aarch64 -cpu max`` (which has ARMv8.2's dot
product). Each executable hashes every kernel's outputs over the same random cases; the script prints the hashes of
each build and exits 1 where any kernel's differ between builds (2 where a tool is missing).

Usage: ``python scripts/aarch64_check.py [--cases 1000] [--threads 2] [--keep DIR]`` (``tests/test_kernel_hashes.py``
runs it as a large test).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from batchspec.exact.integer import native

DRIVER = Path(__file__).with_name("kernel_hashes.c")
CROSS_COMPILER = "aarch64-linux-gnu-gcc"
QEMU = ("qemu-aarch64", "-cpu", "max", "-L", "/usr/aarch64-linux-gnu")
# the features of qemu's "max" aarch64 CPU among those native.BUILDS asks for (/proc/cpuinfo's names)
QEMU_FEATURES = frozenset({"fp", "asimd", "asimddp"})


@dataclass(frozen=True)
class Target:
    """One executable to build and run: its label, compiler and flags, the build's source and how to run it."""

    label: str
    compiler: str
    flags: tuple[str, ...]
    source: Path
    runner: tuple[str, ...] = ()


def targets() -> list[Target]:
    """The builds this host runs, natively; then, on a host that is not aarch64, the aarch64 builds under qemu."""
    executable = tuple(flag for flag in native._FLAGS if flag not in ("-shared", "-fPIC"))
    compiler, host = os.environ.get("CC", "cc"), native._cpu_flags()
    found = [Target(f"{name} ({platform.machine()})", compiler, (*executable, *native._build_flags(name, host)),
                    native._SOURCES / _source(name)) for name in native.host_isas()]
    if platform.machine() not in ("aarch64", "arm64"):
        found += [Target(f"{build.name} (aarch64, qemu)", CROSS_COMPILER,
                         (*executable, *native._build_flags(build.name, QEMU_FEATURES)),
                         native._SOURCES / build.source, QEMU)
                  for build in native.BUILDS if native._build_flags(build.name, QEMU_FEATURES) is not None]
    return found


def _source(name: str) -> str:
    return next(build.source for build in native.BUILDS if build.name == name)


def missing_tools(found: list[Target]) -> list[str]:
    """The compilers and emulators ``found`` needs that are not on PATH."""
    needed = {tool for target in found for tool in (target.compiler, *target.runner[:1])}
    return sorted(tool for tool in needed if shutil.which(tool) is None)


def hashes(target: Target, directory: Path, cases: int, threads: int) -> dict[str, str]:
    """``{kernel: hash}`` that ``target``'s executable prints for ``cases`` cases on ``threads`` threads."""
    executable = directory / re.sub(r"[^a-z0-9]+", "-", target.label.lower()).strip("-")  # e.g. neon-aarch64-qemu
    subprocess.run([target.compiler, *target.flags, str(target.source), str(DRIVER), "-o", str(executable), "-lm"],
                   check=True, capture_output=True, timeout=300)
    done = subprocess.run([*target.runner, str(executable), str(cases), str(threads)], check=True,
                          capture_output=True, text=True, timeout=3600)
    (directory / f"{executable.name}.txt").write_text(done.stdout)
    return dict(line.split() for line in done.stdout.splitlines())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000, help="random cases a kernel (default 1000)")
    parser.add_argument("--threads", type=int, default=2, help="OpenMP threads a call (default 2)")
    parser.add_argument("--keep", type=Path, help="a folder to keep the executables and their hash files in")
    arguments = parser.parse_args()
    found = targets()
    if missing := missing_tools(found):
        print(f"missing: {', '.join(missing)} (Debian: apt-get install gcc-aarch64-linux-gnu qemu-user)")
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        directory = arguments.keep or Path(scratch)
        directory.mkdir(parents=True, exist_ok=True)
        results = {target.label: hashes(target, directory, arguments.cases, arguments.threads) for target in found}
    kernels = next(iter(results.values()))
    print(f"{arguments.cases} cases a kernel, {arguments.threads} threads")
    print("kernel".ljust(16), *(label.ljust(26) for label in results))
    differ = [kernel for kernel in kernels if len({result.get(kernel) for result in results.values()}) > 1]
    for kernel in kernels:
        print(kernel.ljust(16), *(result.get(kernel, "-").ljust(26) for result in results.values()),
              "DIFFERS" if kernel in differ else "")
    print(f"{len(differ)} of {len(kernels)} kernels differ between builds" if differ else
          f"every kernel's hash is the same on all {len(results)} builds")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
