"""Loading target and draft models with their tokenizer.

A model spec given to :func:`load_model` is one of:

* ``"<preset>:<role>"`` such as ``"qwen2.5-coder:target"`` or ``"smollm2:draft"``: obtained into the
  cache by :func:`batchspec.models.obtain.obtain_preset` on first use;
* a local ``.gguf`` file: dequantized through transformers; with ``cache_gguf`` the dense result is
  kept in ``<cache>/models/gguf/<name>-<key>/`` so later loads are fast;
* a local directory holding a transformers checkpoint;
* a Hugging Face Hub id such as ``"Qwen/Qwen2.5-Coder-0.5B-Instruct"`` (a ``gguf_file`` inside the
  repository can be named).

:func:`load_pair` loads a target and a draft and checks that they share a vocabulary before any
generation happens.

Every loader takes ``dtype="auto"`` by default and turns it into a concrete dtype with :func:`resolve_dtype`,
the one place where batchspec picks a default dtype: float32, on the CPU and on CUDA alike, where greedy output is
exactly the target's own; half precision only when asked for. ``device="auto"`` (see
:func:`batchspec.devices.resolve_device`) is the first CUDA device when torch sees one, else the CPU: weights are
read on the CPU and then moved there.

``quantize="int8"`` (see :mod:`batchspec.exact.integer`) turns each loaded float32 model into the exact int8 model:
every row's logits are then bit-identical whatever the batch, so greedy output is the quantized model's own with no
near-tie exemption. ``quantize="int4"`` makes the exact int4 model instead (4-bit weights, 8-bit activations): a
model loaded from a GGUF file keeps the file's own 4-bit blocks (:mod:`batchspec.models.gguf_weights`), its other
tensors int8. Both run on the CPU only, on float32 weights, and on their own integer kernels (not oneDNN's packed
ones); :func:`check_quantize_for` refuses the other combinations before anything loads. Once the models are loaded,
:func:`settle_quantize` decides for all of them together: ``"auto"`` leaves them all unquantized unless the int8
forward supports every one, an asked-for ``"int8"`` or ``"int4"`` is refused unless it does.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchspec.config import DRAFT_QUANTIZE, DTYPES, KERNELS, check_option, default_cache_dir, setting_default
from batchspec.devices import resolve_device
from batchspec.engine import TextBridge, bridged
from batchspec.exact import integer
from batchspec.exact.integer.forward import integer_forward
from batchspec.exact.invariant import make_batch_invariant
from batchspec.memory import returned_when_freed
from batchspec.model_checks import vocab_size
from batchspec.models.checkpoint import CheckpointReader, widen_model
from batchspec.models.gguf_weights import GgufOrigin, GgufWeights, four_bit
from batchspec.models.obtain import obtain_preset
from batchspec.models.obtain.cache import build_directory, hub_offline
from batchspec.models.obtain.catalogue import DEFAULT_PRESET, PRESETS, ROLES, GgufSource, get_preset
from batchspec.models.obtain.gguf import dequantize_gguf, load_dequantized, obtain_gguf
from batchspec.models.packing import PackedLinear, can_pack, onednn_linear, pack_linears
from batchspec.models.pair import ModelPair

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

LOAD_DEVICE = "cpu"
QUANTIZED_DTYPES: tuple[str, ...] = ("float32", "float64")  # the float models quantize_model takes


def resolve_dtype(dtype: str = setting_default("dtype")) -> str:
    """The name of the dtype to load models in: ``dtype`` itself, or ``"float32"`` for ``"auto"``, on any device.

    On a CPU float32 gives exact greedy output and, on CPUs without native bf16 matrix kernels, is faster than
    bfloat16 for the multi-token forwards speculation runs. On CUDA it is float32 as well (TF32 stays off, torch's
    default for matrix products): there batched bfloat16 changed 7-10 of 16 real answers against the model's own
    one-prompt decoding, for batchspec and transformers' batched ``generate`` alike, and for a small model
    (SmolLM2-135M, B = 8, on an H100) bfloat16 was also 2.7x slower than float32; float32 was exact in every
    configuration. Half precision halves the memory of a large model; greedy output then equals the target's own
    up to near-ties (see :mod:`batchspec.bench.audit`).
    """
    dtype = check_option("dtype", dtype, DTYPES)
    return "float32" if dtype == "auto" else dtype


def resolve_quantize(quantize: str, dtype: str, kernels: str, device: torch.device) -> str:
    """``quantize`` itself, or for ``"auto"``: on the CPU, when the (resolved) ``dtype`` is float32 and the kernels
    are not ``"packed"``, :func:`batchspec.exact.integer.cpu_default` (``"int8"`` where batchspec's native int8
    kernels run, which it says in one log line); else ``"none"``.

    int8 is the CPU's default there because it keeps the quality of float32 and is faster: on HumanEval's first 40
    problems (chat template, 384 new tokens) the qwen2.5-coder pair passed 37 in int8 and 35 in float32, and int8
    decoded 1.3-2.0x faster with 0.31x the memory (docs/integer.md). Models the int8 forward does not all support (see
    :func:`batchspec.exact.integer.model.check_quantizable`) then load as ``"none"``, all of them
    (:func:`settle_quantize`).
    """
    quantize = integer.check_quantize(quantize)
    if quantize != "auto":
        return quantize
    if device.type != "cpu" or dtype != "float32" or kernels == "packed":
        return "none"
    return integer.cpu_default()


def check_batch_invariant_for(batch_invariant: bool, device: torch.device) -> None:
    """Raise ValueError where the batch-invariant mode (:mod:`batchspec.exact.invariant`) cannot run: its kernels are
    Triton's, for a CUDA device."""
    if batch_invariant and device.type != "cuda":
        raise ValueError(
            f"--batch-invariant runs Triton kernels on a CUDA device; the models would be on {device} "
            "(on the CPU, --quantize int8 is exact by construction)"
        )


def check_quantize_for(quantize: str, dtype: str, kernels: str, device: torch.device) -> str:
    """``quantize`` resolved (:func:`resolve_quantize`) when it can apply to models loaded in the (resolved) ``dtype``
    with ``kernels`` on ``device``, else a ValueError (raised before anything loads).

    ``"none"`` applies everywhere. ``"int8"`` and ``"int4"`` need the CPU, float32 and kernels other than
    ``"packed"`` (oneDNN's float32 kernels; the integer layers run their own ones).
    """
    quantize = resolve_quantize(quantize, dtype, kernels, device)
    if quantize == "none":
        return quantize
    if device.type != "cpu":
        raise ValueError(f"--quantize {quantize} runs on the CPU; got device {device} (pass --device cpu)")
    if dtype not in QUANTIZED_DTYPES:
        raise ValueError(f"--quantize {quantize} needs float32 weights (--dtype auto or float32); got {dtype}")
    if kernels == "packed":
        raise ValueError(
            f"--quantize {quantize} runs its own integer kernels, not oneDNN's packed float32 ones: "
            "pass --kernels auto or default"
        )
    return quantize


@dataclass(frozen=True)
class LoadSettings:
    """How models load, every value concrete: made once, by :func:`load_settings`, from what was asked for, and
    handed down whole; nothing below works a setting out again.

    Attributes:
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (``"auto"`` resolved by :func:`resolve_dtype`).
        device: where the models run (``"auto"`` resolved by :func:`batchspec.devices.resolve_device`).
        asked: the ``quantize`` setting as given (``"auto"`` lets :func:`settle_quantize` fall back to ``"none"``).
        quantize: what ``asked`` resolves to before any model is seen: ``"none"``, ``"int8"`` or ``"int4"``.
        kernels: the CPU matrix kernels (see :func:`use_kernels`).
        batch_invariant: the models run on the batch-invariant kernels (CUDA).
        draft_quantize: the draft's weights where the models are quantized: ``"same"`` (as the target's) or
            ``"int4"`` (every linear layer but the output, rounded where its file holds it otherwise).
    """

    dtype: str
    device: torch.device
    asked: str
    quantize: str
    kernels: str
    batch_invariant: bool
    draft_quantize: str

    def rounded(self, role: str) -> bool:
        """Whether a model of ``role`` has every linear layer but the output in int4 where the pair is quantized."""
        return role == "draft" and self.draft_quantize == "int4"

    def width(self, settled: str, role: str) -> str:
        """What a model of ``role`` is made where the pair settled on ``settled``."""
        return "int4" if settled != "none" and self.rounded(role) else settled


def load_settings(
    dtype: str = setting_default("dtype"), device: str | torch.device = setting_default("device"),
    quantize: str = setting_default("quantize"), kernels: str = setting_default("kernels"),
    batch_invariant: bool = setting_default("batch_invariant"),
    draft_quantize: str = setting_default("draft_quantize"),
) -> LoadSettings:
    """The load settings made concrete and checked, before anything loads (ValueError where they cannot apply: see
    :func:`check_quantize_for` and :func:`check_batch_invariant_for`); the one place each is resolved."""
    kernels = check_option("kernels", kernels, KERNELS)
    draft_quantize = check_option("draft_quantize", draft_quantize, DRAFT_QUANTIZE)
    dtype, place = resolve_dtype(dtype), resolve_device(device)
    check_batch_invariant_for(batch_invariant, place)
    resolved = check_quantize_for(quantize, dtype, kernels, place)
    return LoadSettings(dtype, place, quantize, resolved, kernels, batch_invariant, draft_quantize)


def settle_quantize(asked: str, resolved: str, models: Sequence[tuple[str, Any]],
                    origins: Sequence[GgufOrigin | None] = ()) -> str:
    """What the loaded ``models`` (``(spec, model)`` pairs) are all made: ``resolved`` (see
    :func:`check_quantize_for`), except that from ``asked="auto"`` an ``"int8"`` is ``"none"`` unless the integer
    forward supports every model (:func:`batchspec.exact.integer.quantizable`), so a pair is never half quantized, and
    the width is :func:`batchspec.exact.integer.width_for`'s: int4 where every model came from a GGUF file that holds
    its weights in 4 bits (``origins``, :func:`~batchspec.models.gguf_weights.four_bit`) on a build where int4 was
    measured faster.

    An ``"int8"`` or ``"int4"`` asked for explicitly raises ValueError naming the first model the integer forward does
    not support and why (before any model is quantized).
    """
    if resolved == "none":
        return resolved
    if asked == "auto":
        if not all(integer.quantizable(model) for _, model in models):
            return "none"
        return integer.width_for(bool(origins) and all(o is not None and four_bit(o) for o in origins))
    for spec, model in models:
        try:
            integer.check_quantizable(model, resolved)
        except ValueError as error:
            raise ValueError(f"{spec}: {error} (--quantize auto or none loads it unquantized)") from None
    return resolved


def _torch_dtype(dtype: str):
    """torch's dtype of a resolved dtype name (:func:`resolve_dtype`)."""
    import torch

    return getattr(torch, dtype)


def parse_preset_spec(spec: str) -> tuple[str, str] | None:
    """``(preset, role)`` when ``spec`` names a preset role like ``"smollm2:draft"``, else None."""
    name, sep, role = spec.rpartition(":")
    if not sep or name not in PRESETS:
        return None
    roles = PRESETS[name].roles
    if role not in roles:
        raise ValueError(f"Unknown role {role!r} in {spec!r}; expected " + " or ".join(f"{name}:{r}" for r in roles)
                         + ("" if "draft" in roles else f" (preset {name} has no draft model; it drafts by prompt "
                            "lookup, --proposer ngram)"))
    return name, role


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or spec.count("/") > 1


def _load_dir(directory: Path, dtype: str, stored: bool = False) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with hub_offline():
        model = AutoModelForCausalLM.from_pretrained(
            directory, dtype="auto" if stored else _torch_dtype(dtype), local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return model.eval(), tokenizer


def _gguf_cache_dir(gguf: Path, cache_dir: Path) -> tuple[Path, dict]:
    stat = gguf.stat()
    fingerprint = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    key = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
    identity = {"format": 1, "gguf": str(gguf.resolve()), "fingerprint": key}
    return cache_dir / "models" / "gguf" / f"{gguf.stem}-{key}", identity


def _load_gguf(gguf: Path, dtype: str, cache_gguf: bool, cache_dir: Path, progress: bool,
               stored: bool = False) -> tuple[Any, Any]:
    if cache_gguf:
        directory, identity = _gguf_cache_dir(gguf, cache_dir)
        build_directory(directory, identity, lambda tmp: dequantize_gguf(gguf, tmp, progress))
        return _load_dir(directory, dtype, stored)
    model, tokenizer = load_dequantized(gguf, _torch_dtype(dtype))
    return model.eval(), tokenizer


def _load_hub(repo_id: str, dtype: str, gguf_file: str | None) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    extra: dict[str, Any] = {}
    if gguf_file is not None:
        from transformers import GgufConfig

        extra = {"gguf_file": gguf_file, "quantization_config": GgufConfig(dequantize=True)}
    try:
        model = AutoModelForCausalLM.from_pretrained(repo_id, dtype=_torch_dtype(dtype), **extra)
        tokenizer = AutoTokenizer.from_pretrained(repo_id, **({"gguf_file": gguf_file} if gguf_file else {}))
    except OSError as error:
        raise FileNotFoundError(
            f"Model {repo_id!r} could not be found locally or on the Hugging Face Hub "
            f"(no such local path, and the Hub could not provide it: {error}). "
            f"Known presets: {', '.join('/'.join(f'{n}:{r}' for r in PRESETS[n].roles) for n in sorted(PRESETS))}"
        ) from error
    return model.eval(), tokenizer


def load_model(
    spec: str,
    dtype: str = setting_default("dtype"),
    *,
    cache_dir: str | Path | None = None,
    cache_gguf: bool = True,
    gguf_file: str | None = None,
    progress: bool = True,
    kernels: str = setting_default("kernels"),
    device: str = setting_default("device"),
    quantize: str = setting_default("quantize"),
    batch_invariant: bool = setting_default("batch_invariant"),
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for ``spec``: a preset role, a local GGUF file or directory, or a Hub id.

    ``dtype`` is ``"auto"`` (float32 on the CPU, see :func:`resolve_dtype`), ``"bfloat16"``, ``"float16"`` or
    ``"float32"``; the presets' cached bf16 weights load exactly in any of them (float32 is an exact upcast at
    twice the memory). The model is returned in eval mode. ``cache_dir``
    defaults to :func:`batchspec.config.default_cache_dir`. ``gguf_file`` names a GGUF file
    inside a Hub repository or local directory. ``kernels`` picks the CPU matrix kernels (see :func:`use_kernels`).
    ``device`` is where the model runs (``auto``: CUDA when available, see :func:`batchspec.devices.resolve_device`).
    ``quantize="int8"`` makes the loaded model the exact int8 model (see
    :func:`batchspec.exact.integer.quantize_model`) instead of packing its kernels; :func:`check_quantize_for` says
    where it applies, before loading, and :func:`settle_quantize` whether the int8 forward supports the model
    (``"auto"``: else it loads as ``"none"``; ``"int8"``: else a ValueError). ``batch_invariant`` runs the model on
    the batch-invariant kernels (CUDA only, see :mod:`batchspec.exact.invariant`).
    """
    settings = load_settings(dtype, device, quantize, kernels, batch_invariant)
    (loaded,) = load_specs([spec], settings, cache_dir=cache_dir, cache_gguf=cache_gguf, gguf_file=gguf_file,
                           progress=progress)
    return loaded


def load_specs(
    specs: list[str], settings: LoadSettings, *, cache_dir: str | Path | None = None, cache_gguf: bool = True,
    gguf_file: str | None = None, progress: bool = True, roles: Sequence[str] = (),
) -> list[tuple[Any, Any]]:
    """``(model, tokenizer)`` for each of ``specs``, loaded as ``settings`` say: on their device, then all quantized
    (:func:`settle_quantize`; a spec whose ``roles`` entry is ``"draft"`` in the settings' draft width, the others
    alike) or all put on the batch-invariant or the chosen CPU kernels; what the load frees goes back to the system
    (:func:`batchspec.memory.returned_when_freed`)."""
    with returned_when_freed():
        # on the CPU, models load in their files' dtype and widen a tensor at a time (quantize_model, _finish)
        place, resolved = settings.device, settings.quantize
        stored = place.type == "cpu" and (resolved != "none" or settings.dtype == "float32")
        loaded = [_load_on(spec, settings.dtype, place, cache_dir, cache_gguf, gguf_file, progress, stored)
                  for spec in specs]
        models = [model for model, _ in loaded]
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        roles = list(roles) or ["target"] * len(specs)
        # int4 needs the file's blocks; int8 takes its embedding's where the file is at hand
        fetch = "int4" in {settings.width(resolved, role) for role in roles}
        quantized = resolved != "none"
        origins = [_origin(spec, root, gguf_file, progress, fetch) for spec in specs] if quantized else []
        resolved = settle_quantize(settings.asked, resolved, list(zip(specs, models, strict=True)), origins)
        for index, (model, tokenizer) in enumerate(loaded):
            reader = CheckpointReader.of(model) if stored else None
            fresh = None if reader is None else reader.fresh
            origin = origins[index] if resolved != "none" else None
            source = None if origin is None else GgufWeights(origin, model, fresh)
            _finish(model, tokenizer, settings.width(resolved, roles[index]), settings, source, fresh,
                    rounded=settings.rounded(roles[index]))
        return loaded


def _origin(spec: str, root: Path, gguf_file: str | None, progress: bool, fetch: bool) -> GgufOrigin | None:
    """The GGUF file ``spec``'s weights were read from (a preset's, obtained again if it left the cache and ``fetch``;
    a local file), or None (a checkpoint directory, a Hub id, a preset's file gone and not fetched)."""
    preset_role = parse_preset_spec(spec)
    if preset_role is not None:
        preset = get_preset(preset_role[0])
        source = preset.role(preset_role[1]).source
        layers = None if isinstance(source, GgufSource) else source.layers
        target = source if isinstance(source, GgufSource) else preset.target.source
        path = root / "gguf" / target.filename
        if not path.is_file() or path.stat().st_size != target.size:
            if not fetch:
                return None
            path = obtain_gguf(target, root, progress=progress)
        return GgufOrigin(path, layers)
    path = Path(spec).expanduser()
    if path.is_dir() and gguf_file is not None:
        path = path / gguf_file
    return GgufOrigin(path) if path.is_file() and path.suffix == ".gguf" else None


def _load_on(
    spec: str, dtype: str, place: torch.device, cache_dir: str | Path | None, cache_gguf: bool,
    gguf_file: str | None, progress: bool, stored: bool = False,
) -> tuple[Any, Any]:
    """``spec`` loaded and moved to ``place``: in ``dtype``, or where ``stored``, a checkpoint directory in the
    dtype its weights are stored in (a preset's bfloat16: half of float32's memory, for quantize_model to widen)."""
    model, tokenizer = _load_any(spec, dtype, cache_dir, cache_gguf, gguf_file, progress, stored)
    return (model if place.type == LOAD_DEVICE else model.to(place)), tokenizer


def _finish(model: Any, tokenizer: Any, quantize: str, settings: LoadSettings, source: GgufWeights | None = None,
            fresh: Any = None, *, rounded: bool = False) -> None:
    """Make the loaded ``model`` the exact integer one (``quantize``, settled; the GGUF file's own blocks from
    ``source`` where given; its weights read afresh through ``fresh``, see
    :class:`~batchspec.models.checkpoint.CheckpointReader`; ``rounded``: a draft's, its int4 layers that the file
    holds otherwise rounded to int4 rather than kept int8), else batch-invariant, else the settings' dtype (widened
    a tensor at a time where loaded narrower, each linear layer packed as it is widened where the kernels pack) on
    the settings' kernels."""
    if quantize != "none":
        integer.quantize_model(model, tokenizer, quantize, source, fresh, round_rest=rounded)
        integer_forward(model)  # its stacked weights laid out now, while the load's freed memory goes back
        return
    import torch

    dtype, kernels = _torch_dtype(settings.dtype), settings.kernels
    if next(model.parameters()).dtype != dtype:
        packs = kernels != "default" and dtype == torch.float32 and onednn_linear()
        widen_model(model, dtype, fresh or (lambda name, tensor: tensor), PackedLinear if packs else None)
    if settings.batch_invariant:
        make_batch_invariant(model)
    else:
        use_kernels(model, kernels)


def use_kernels(model: Any, kernels: str = setting_default("kernels")) -> bool:
    """Put ``model``'s linear layers on the chosen CPU kernels; returns whether they are packed.

    ``"packed"`` and ``"auto"`` swap a float32 CPU model's linear layers for oneDNN ones with prepacked weights
    (:mod:`batchspec.models.packing`: 1.4-2x faster steps and verifications on the CPUs measured, same float32
    arithmetic in another summation order); ``"auto"`` leaves other models alone, ``"packed"`` raises for them.
    ``"default"`` keeps PyTorch's own kernels.
    """
    check_option("kernels", kernels, KERNELS)
    if kernels == "default":
        return False
    if not can_pack(model):
        if kernels == "packed":
            raise ValueError("kernels='packed' needs a float32 model on the CPU and a PyTorch built with oneDNN")
        return False
    pack_linears(model)
    return True


def _load_any(
    spec: str, dtype: str, cache_dir: str | Path | None, cache_gguf: bool, gguf_file: str | None, progress: bool,
    stored: bool = False,
) -> tuple[Any, Any]:
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    preset_role = parse_preset_spec(spec)
    if preset_role is not None:
        name, role = preset_role
        paths = obtain_preset(name, root, progress)
        return _load_dir(paths.target_dir if role == "target" else paths.draft_dir, dtype, stored)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"{path} is a file but not a .gguf file; pass a model directory, GGUF file or Hub id"
            )
        return _load_gguf(path, dtype, cache_gguf, root, progress, stored)
    if path.is_dir():
        if gguf_file is not None:
            return _load_gguf(path / gguf_file, dtype, cache_gguf, root, progress, stored)
        return _load_dir(path, dtype, stored)
    if _looks_like_path(spec):
        raise FileNotFoundError(f"Model path {spec!r} does not exist")
    return _load_hub(spec, dtype, gguf_file)


_SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def check_compatible(target: Any, draft: Any, target_tokenizer: Any, draft_tokenizer: Any) -> bool:
    """Whether target and draft share one tokenizer (its length, special token ids and token-to-id map); ValueError
    where they do but their output layers score different numbers of tokens. A draft of another tokenizer drafts
    through text (:mod:`batchspec.engine.retokenize`)."""
    if _tokenizers_differ(target_tokenizer, draft_tokenizer):
        return False
    target_rows, draft_rows = vocab_size(target), vocab_size(draft)
    if target_rows != draft_rows:
        raise ValueError(
            f"Target and draft have different vocabulary sizes: target lm_head has {target_rows} rows, "
            f"draft lm_head has {draft_rows}; speculative decoding needs one shared vocabulary"
        )
    return True


def _tokenizers_differ(target_tokenizer: Any, draft_tokenizer: Any) -> bool:
    if len(target_tokenizer) != len(draft_tokenizer):
        return True
    if any(getattr(target_tokenizer, a, None) != getattr(draft_tokenizer, a, None) for a in _SPECIAL_TOKENS):
        return True
    return target_tokenizer.get_vocab() != draft_tokenizer.get_vocab()


def _bridge_unless_shared(target: Any, draft: Any, target_tokenizer: Any, draft_tokenizer: Any) -> None:
    """Mark ``draft`` as a draft of another tokenizer where it is one (:func:`~batchspec.engine.retokenize.bridged`),
    and say so."""
    if check_compatible(target, draft, target_tokenizer, draft_tokenizer):
        return
    bridged(draft, TextBridge.of(target_tokenizer, draft_tokenizer))
    logger.info("the draft's tokenizer is not the target's: its drafts reach the target as text (exact all the same: "
                "the target verifies every token)")


def _pair_specs(preset: str | None, target: str | None, draft: str | None) -> tuple[str | None, str, str]:
    """The preset in use and the target and draft specs to load (the preset's where not given)."""
    if preset is None and (target is None) != (draft is None):
        raise ValueError("Give both target= and draft=, or a preset= whose models fill in the missing one")
    if preset is None and target is None:
        preset = DEFAULT_PRESET
    if preset is not None:
        get_preset(preset)
        target = target or f"{preset}:target"
        draft = draft or f"{preset}:draft"
    return preset, target, draft


def load_pair(
    preset: str | None = None,
    target: str | None = None,
    draft: str | None = None,
    dtype: str = setting_default("dtype"),
    *,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    kernels: str = setting_default("kernels"),
    device: str = setting_default("device"),
    quantize: str = setting_default("quantize"),
    batch_invariant: bool = setting_default("batch_invariant"),
    draft_quantize: str = setting_default("draft_quantize"),
) -> ModelPair:
    """Load a target and a draft sharing one tokenizer, both in ``dtype`` (``"auto"``: see :func:`resolve_dtype`)
    on ``device`` (``"auto"``: CUDA when available) and, on the CPU, the kernels ``kernels`` (see
    :func:`use_kernels`), or both quantized (``quantize``, see :func:`load_model`: ``"auto"`` quantizes both or
    neither, see :func:`settle_quantize`; the draft's weights in int4 with ``draft_quantize="int4"``), or both
    batch-invariant.

    With no arguments the default preset is used. ``target`` and ``draft`` (any spec accepted by
    :func:`load_model`) replace the preset's models; without a ``preset`` both must be given. The pair's
    ``seconds`` count loading and quantizing both.
    """
    settings = load_settings(dtype, device, quantize, kernels, batch_invariant, draft_quantize)
    return load_specified_pair(preset, target, draft, settings, cache_dir=cache_dir, progress=progress)


def load_specified_pair(
    preset: str | None, target: str | None, draft: str | None, settings: LoadSettings, *,
    cache_dir: str | Path | None = None, progress: bool = True,
) -> ModelPair:
    """:func:`load_pair` with its settings made concrete (:func:`load_settings`)."""
    preset, target, draft = _pair_specs(preset, target, draft)
    started = time.perf_counter()
    (target_model, target_tokenizer), (draft_model, draft_tokenizer) = load_specs(
        [target, draft], settings, cache_dir=cache_dir, progress=progress, roles=ROLES
    )
    _bridge_unless_shared(target_model, draft_model, target_tokenizer, draft_tokenizer)
    uses_preset = target == f"{preset}:target" and draft == f"{preset}:draft"
    name = preset if uses_preset else f"{target} + {draft}"
    return ModelPair.loaded(target_model, draft_model, target_tokenizer, name, settings.dtype, settings.device,
                            time.perf_counter() - started)
