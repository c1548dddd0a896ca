"""Complete directories in the cache and the offline guard.

A directory is built under a temporary name, marked with what it was built from (``batchspec-complete.json``) and
renamed into place; it is reused only while its marker matches. Leftovers of interrupted runs are removed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

COMPLETE_MARKER = "batchspec-complete.json"


def remove_stale(directory: Path, prefix: str) -> None:
    """Remove leftovers of interrupted runs (temporary files or directories starting with ``prefix``)."""
    if not directory.is_dir():
        return
    for leftover in directory.iterdir():
        if leftover.name.startswith(prefix):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)


def _read_marker(directory: Path) -> dict | None:
    try:
        return json.loads((directory / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_complete(directory: Path, identity: dict) -> bool:
    """Whether ``directory`` holds a finished build whose marker matches ``identity``."""
    marker = _read_marker(directory)
    return marker is not None and all(marker.get(key) == value for key, value in identity.items())


def build_directory(final: Path, identity: dict, build: Callable[[Path], None]) -> bool:
    """Make ``final`` by ``build(temporary_dir)``, marked with ``identity``; reuse it if already complete.

    Returns True when it was built, False when a complete directory was reused. An incomplete or
    mismatching ``final`` is removed and rebuilt; the build happens in a temporary directory that is
    renamed into place only once the marker is written.
    """
    if is_complete(final, identity):
        return False
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(final.parent, f".{final.name}.tmp-")
    if final.exists():
        shutil.rmtree(final)
    temporary = final.parent / f".{final.name}.tmp-{os.getpid()}"
    try:
        temporary.mkdir()
        build(temporary)
        marker = {**identity, "completed_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (temporary / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        os.replace(temporary, final)
    finally:
        if temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)
    return True


@contextmanager
def hub_offline() -> Iterator[None]:
    """Set ``HF_HUB_OFFLINE=1`` for the duration, restoring the previous value."""
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = previous
