"""A run's settings made concrete once, at its entry, into one frozen record handed down whole (:class:`RunConfig`).

Two entries make it, each the one way for what it starts from: :func:`resolve_run` for the models a
:class:`~batchspec.models.ModelChoice` names (``batchspec generate``, ``serve``, ``bench`` and Ray's actors, before
anything loads), :func:`resolve_loaded` for models the caller loaded (``batchspec.generate``, ``hf_generate``, the
server's :func:`~batchspec.server.create_app` handed a pair). Both settle the proposer and ask whether the runner
captures CUDA graphs (:func:`~batchspec.engine.runner_graphs`, called here only); the loaders take the record's
``load`` (:func:`load_run`) and the engine its ``engine`` and ``graphs`` (:func:`build_run`), and neither works a
setting out again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from batchspec.config import ProposerKind, SpecConfig
from batchspec.engine import Engine, GraphMode, build_engine, runner_graphs

if TYPE_CHECKING:
    from batchspec.models.choice import ModelChoice
    from batchspec.models.loading import LoadSettings
    from batchspec.models.pair import ModelPair


@dataclass(frozen=True)
class RunConfig:
    """A run's settings, every value concrete: made once at the entry (:func:`resolve_run`, :func:`resolve_loaded`)
    and handed down whole; it pickles (Ray's actors make theirs from the records they are handed).

    Attributes:
        engine: the engine's settings, the proposer settled (None only for autoregressive decoding); its
            ``uses_draft_model`` answers whether a draft model drafts and its ``adaptive`` the draft-length policy.
        graphs: the runner's graph mode on ``device`` (:func:`~batchspec.engine.runner_graphs`).
        device: where the models run.
        load: how the models load (dtype, device, quantize mode, kernels, batch-invariant mode), or None where the
            caller loaded them.
        choice: which models load, or None where the caller loaded them.
    """

    engine: SpecConfig
    graphs: GraphMode
    device: torch.device
    load: LoadSettings | None = None
    choice: ModelChoice | None = None

    @property
    def uses_draft_model(self) -> bool:
        """Whether a draft model drafts (the target alone loads where none does, unless a draft is named)."""
        return self.engine.uses_draft_model


def resolve_run(engine: SpecConfig, choice: ModelChoice) -> RunConfig:
    """The run of ``engine`` with the models ``choice`` names, checked and made concrete before anything loads:
    the models can run the method (:meth:`~batchspec.models.ModelChoice.check_for`), the proposer, the load
    settings (:meth:`~batchspec.models.ModelChoice.load_settings`) and the graph mode of their device (a
    ``cuda_graphs`` the device cannot run fails here, first). ValueError where they cannot apply."""
    choice.check_for(engine.method, engine.proposer)
    load = choice.load_settings()
    engine = replace(engine, proposer=choice.proposer_for(engine.method, engine.proposer))
    return _resolved(engine, load.device, load, choice)


def resolve_loaded(engine: SpecConfig, target: torch.nn.Module, draft: torch.nn.Module | None) -> RunConfig:
    """The run of ``engine`` with models the caller loaded: the proposer (hybrid with a draft, prompt lookup without)
    and the graph mode of the target's device."""
    proposer = engine.proposer or (ProposerKind.HYBRID if draft is not None else ProposerKind.NGRAM)
    return _resolved(replace(engine, proposer=proposer), next(target.parameters()).device)


def _resolved(engine: SpecConfig, device: torch.device, load: LoadSettings | None = None,
              choice: ModelChoice | None = None) -> RunConfig:
    return RunConfig(engine, runner_graphs(engine, device), device, load, choice)


def load_run(run: RunConfig, progress: bool = True) -> ModelPair:
    """The models of ``run`` (made by :func:`resolve_run`), loaded as its ``load`` says
    (:func:`~batchspec.models.load_models`)."""
    from batchspec.models.choice import load_models

    if run.choice is None or run.load is None:
        raise ValueError("this run's models were loaded by its caller (resolve_loaded): there is nothing to load")
    return load_models(run.choice, run.load, run.engine.method, run.engine.proposer, progress=progress)


def build_run(run: RunConfig, target: torch.nn.Module, draft: torch.nn.Module | None) -> Engine:
    """The engine of ``run`` on ``target`` and ``draft`` (:func:`~batchspec.engine.build_engine`)."""
    return build_engine(target, draft, run.engine, run.graphs)
