"""Deriving a draft from the preset's dense target: the target reduced to a subset of its decoder layers."""

from __future__ import annotations

from pathlib import Path

from tqdm.auto import tqdm

from batchspec.models.obtain.cache import hub_offline
from batchspec.models.obtain.catalogue import LayerSubsetDraft, PresetError


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
