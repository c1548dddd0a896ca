"""Every option batchspec takes, declared once (default, help text, check, command-line form; :func:`option`): the
settings of a run (:class:`SpecConfig`), a request's sampling, budget and seed (:class:`SamplingParams`,
:class:`RequestOptions`) and how the models load (:class:`ModelOptions`). The commands, the server, the Python API
and the adapters take theirs from here; serve's own options are declared beside their users in ``server/``."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, get_type_hints

WINDOW_MULTIPLE = 4
# new tokens per prompt when none are asked for (batchspec.generate, `batchspec generate` and `bench`); a request's
# budget, not a setting of the run (each Sequence carries its own)
DEFAULT_MAX_NEW_TOKENS = 128
# the n-gram lengths prompt lookup matches by default, longest first (engine/lookup.py)
DEFAULT_MAX_NGRAM = 5
DEFAULT_MIN_NGRAM = 1
DEFAULT_DRAFT_VOCABULARY = 32768  # see SpecConfig.draft_vocabulary


def default_cache_dir() -> Path:
    """``$BATCHSPEC_CACHE``, else ``$XDG_CACHE_HOME/batchspec``, else ``~/.cache/batchspec``."""
    explicit = os.environ.get("BATCHSPEC_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "batchspec"
    return Path.home() / ".cache" / "batchspec"


class Method(StrEnum):
    """How batches are formed (and whether a draft proposes at all)."""

    AUTOREGRESSIVE = "autoregressive"
    EQSPEC = "eqspec"
    EXSPEC = "exspec"


METHODS = tuple(m.value for m in Method)


class ProposerKind(StrEnum):
    """Who drafts: a draft model, prompt lookup in the row's own text, or lookup first and the model elsewhere."""

    DRAFT = "draft"
    NGRAM = "ngram"
    HYBRID = "hybrid"


PROPOSERS = tuple(p.value for p in ProposerKind)


def uses_draft_model(method: Method, proposer: ProposerKind | None) -> bool:
    """Whether ``method`` with ``proposer`` (resolved: None only for autoregressive decoding) runs a draft model:
    the one place this is answered."""
    return method is not Method.AUTOREGRESSIVE and proposer in (ProposerKind.DRAFT, ProposerKind.HYBRID)


class CudaGraphs(StrEnum):
    """Whether decode forwards on a GPU are captured as CUDA graphs (:mod:`batchspec.engine.graphs`)."""

    AUTO = "auto"  # on for a CUDA device, off elsewhere (docs/gpu.md)
    ON = "on"
    OFF = "off"


CUDA_GRAPHS = tuple(c.value for c in CudaGraphs)
AUTO = "auto"


class DType(StrEnum):
    """The weights' and compute dtype of both models; auto is float32 (:func:`batchspec.models.resolve_dtype`)."""

    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


class Kernels(StrEnum):
    """The CPU matrix kernels of float32 models (:mod:`batchspec.models.packing`)."""

    AUTO = "auto"
    PACKED = "packed"
    DEFAULT = "default"


class Quantize(StrEnum):
    """Whether the models are made the exact integer ones (:mod:`batchspec.exact.integer`): int8, or int4 weights with
    int8 activations."""

    AUTO = "auto"
    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"


class DraftQuantize(StrEnum):
    """The draft model's weights where the models are quantized: as the target's, or 4 bits (each linear layer but
    the output)."""

    SAME = "same"
    INT4 = "int4"


DTYPES = tuple(d.value for d in DType)
KERNELS = tuple(k.value for k in Kernels)
QUANTIZE = tuple(q.value for q in Quantize)
DRAFT_QUANTIZE = tuple(q.value for q in DraftQuantize)


def check_option(name: str, value: str, choices: tuple[str, ...]) -> str:
    """``value`` as a plain string when it is one of ``choices``, else a ValueError naming ``name``."""
    if value not in choices:
        raise ValueError(f"Unsupported {name} {value!r}; expected one of {', '.join(choices)}")
    return str(value)


def named(kind: type[StrEnum]) -> Callable[[str, Any], Any]:
    """The check of an option held as the plain name of one of ``kind``'s members (:func:`check_option`)."""
    choices = tuple(k.value for k in kind)
    return lambda name, value: check_option(name, value, choices)
MAX_AUTO_DRAFT_TOKENS = 10


def read_auto_or_count(text: str) -> int | str:
    """``"auto"`` or an integer >= 1, read from the command line (``--num-draft-tokens``, ``--prefill-chunk``)."""
    if text == AUTO:
        return AUTO
    try:
        k = int(text)
    except ValueError:
        raise ValueError(f"expected 'auto' or an integer >= 1; got {text!r}") from None
    if k < 1:
        raise ValueError(f"expected 'auto' or an integer >= 1; got {text!r}")
    return k


SIZE_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def read_size(text: str) -> int | str:
    """``"auto"`` or a number of bytes >= 0 with an optional unit (``512MiB``, ``2GB``), read from the command line
    (``--prefix-cache-size``)."""
    if text == AUTO:
        return AUTO
    number = text.rstrip("kKmMgGiIbB")
    unit = text[len(number):].upper()
    try:
        size = int(float(number) * SIZE_UNITS[unit])
    except (ValueError, KeyError):
        raise ValueError(f"expected 'auto' or a size such as 0, 512MiB or 2GB; got {text!r}") from None
    if size < 0:
        raise ValueError(f"expected a size >= 0; got {text!r}")
    return size


def option(default: Any, help: str, *, check: Callable[[str, Any], Any] | None = None, **cli: Any) -> Any:
    """A field of :class:`SpecConfig` declared once: its default, its help text (the command line's and the
    documentation's), its check (``check(name, value)`` returns the value to keep or raises ValueError) and how the
    command line reads it (``cli``: ``metavar``, ``short``, ``read`` a text parser, ``minimum`` and ``maximum``,
    ``choices`` an enum of the allowed names, ``switch`` for a bool given as ``--name/--no-name``, ``flag=False`` for
    a field no command line sets, or any other keyword of ``typer.Option``)."""
    return field(default=default, metadata={"help": help, "check": check, "cli": cli})


def one_of(kind: type[StrEnum]) -> Callable[[str, Any], Any]:
    """The check of an enum-valued option: the value as ``kind``, or a ValueError listing the choices."""
    choices = ", ".join(k.value for k in kind)

    def check(name: str, value: Any) -> Any:
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"{name} must be one of {choices}; got {value!r}") from None

    return check


def integer(minimum: int, *, auto: bool = False) -> Callable[[str, Any], Any]:
    """The check of an integer option >= ``minimum``; with ``auto``, ``"auto"`` is allowed as well."""

    def check(name: str, value: Any) -> Any:
        if auto and value == AUTO:
            return value
        if auto and isinstance(value, str):
            raise ValueError(f"{name} must be an integer >= {minimum} or 'auto'; got {value!r}")
        require_int(name, value, minimum=minimum)
        return value

    return check


def optional(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    """``check``, letting None through."""
    return lambda name, value: None if value is None else check(name, value)


def number(minimum: float, maximum: float | None = None, *, above: bool = False) -> Callable[[str, Any], Any]:
    """The check of a finite real option >= ``minimum`` (> with ``above``) and <= ``maximum``."""
    low = f"> {minimum:g}" if above else f">= {minimum:g}"
    bounds = low if maximum is None else f"{low} and <= {maximum:g}"

    def check(name: str, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} must be a number; got {value!r}")
        inside = (value > minimum if above else value >= minimum) and (maximum is None or value <= maximum)
        if not math.isfinite(value) or not inside:
            raise ValueError(f"{name} must be finite, {bounds}; got {value!r}")
        return value

    return check


def check_fields(record: Any) -> None:
    """Run the check each field of the frozen dataclass ``record`` declares (:func:`option`), keeping what it
    returns (an enum's member for its name, ...)."""
    for spec in fields(record):
        check = spec.metadata.get("check")
        if check is not None:
            object.__setattr__(record, spec.name, check(spec.name, getattr(record, spec.name)))


def eos_ids(name: str, value: Any) -> Any:
    for eos in value or ():
        require_int("eos_token_id", eos, minimum=0)
    return value


@dataclass(frozen=True)
class SpecConfig:
    """The settings of a run: every option of the engine, declared once here (default, help text, check and how the
    command line reads it, see :func:`option`), checked on construction. ``batchspec generate``, ``serve`` and
    ``bench``, ``batchspec.generate``, the server, the Ray predictor and ``hf_generate`` take theirs from here. The
    budget of new tokens and the sampling settings are not here: each request carries its own
    (:class:`~batchspec.engine.state.Sequence`).
    """

    method: Method = option(
        Method.EQSPEC, check=one_of(Method), short="-m",
        help="eqspec: speculative, the batch realigned after every round (serving: one running batch, predictable "
        "latency); exspec: speculative, batches regrouped from a window of sequences by length (more throughput, "
        "longer tail latency); autoregressive: the target alone, batched (no draft is loaded when only --target "
        "is given).",
    )
    batch_size: int = option(
        8, check=integer(1), short="-b", metavar="B", minimum=1,
        help="Rows decoded together at most (serving: requests decoded together per round).",
    )
    num_draft_tokens: int | str = option(
        AUTO, check=integer(1, auto=True), short="-k", metavar="K|auto", read=read_auto_or_count,
        help="Drafts per row and round (each row's capped by its own budget), or 'auto': chosen every round for "
        "the most expected tokens per second from the rows' recent acceptance and the measured costs, down to "
        "plain steps where speculation does not pay.",
    )
    max_draft_tokens: int = option(
        MAX_AUTO_DRAFT_TOKENS, check=integer(1), flag=False, help="The longest proposal 'auto' may choose.",
    )
    proposer: ProposerKind | None = option(
        None, check=optional(one_of(ProposerKind)),
        help="Who drafts: draft (the draft model), ngram (prompt lookup in each prompt and its output: no draft "
        "model is loaded) or hybrid (lookup where it finds a match, the draft model elsewhere). Default: hybrid, "
        "or ngram when only --target is given.",
    )
    draft_vocabulary: int = option(
        DEFAULT_DRAFT_VOCABULARY, check=integer(0), metavar="N",
        help="The draft model proposes among the first N token ids only (FR-Spec's idea, with the tokenizer's own "
        "order, its earliest merges first, as the frequency ranking): on the CPU's fused integer forward its output "
        "layer then reads N of its rows. The target still verifies over its whole vocabulary, so the output is "
        "unchanged. 0: the whole vocabulary.",
    )
    ngram_min: int = option(DEFAULT_MIN_NGRAM, check=integer(1), flag=False,
                            help="The shortest suffix prompt lookup matches.")
    ngram_max: int = option(DEFAULT_MAX_NGRAM, check=integer(1), flag=False,
                            help="The longest suffix prompt lookup matches (>= ngram_min).")
    eos_token_ids: tuple[int, ...] | None = option(
        None, check=eos_ids, flag=False,
        help="Tokens that end a sequence (empty: only the budget ends it; None: the target's default, filled in by "
        "batchspec.engine.core.build_engine).",
    )
    pad_token_id: int | None = option(
        None, check=optional(integer(0)), flag=False,
        help="Filler written into padding columns, never read back as padding (None: the target's default).",
    )
    window_size: int | None = option(
        None, check=optional(integer(1)), metavar="W", minimum=1,
        help="exspec only: sequences (serving: requests) active at once, >= the batch size; default 4 x B.",
    )
    sort_by_length: bool = option(True, flag=False,
                                  help="exspec only: admit prompts into the window in order of length.")
    check_invariants: bool = option(
        False, flag=False,
        help="Verify the batch invariants (I1, I2, token streams, cache lengths) every round (slow; for tests).",
    )
    timing: bool = option(
        True, switch=True,
        help="Split round time into stages (prefill/draft/verify/realign/other; for /metrics when serving; cheap: "
        "on a GPU one device synchronisation a round); wall time is always measured.",
    )
    prefill_chunk: int | str | None = option(
        None, check=optional(integer(1, auto=True)), metavar="N|auto", read=read_auto_or_count,
        help="Columns of new prompts read per round while other rows decode (chunked prefill): a long prompt then "
        "delays the running streams a bounded amount per round. auto: as many columns as take about one decode "
        "round to read (measured as it runs), so a stream waits about two rounds at most. Unset (batchspec.generate's "
        "default), every prompt is read in one piece. On the fused integer forward (int8, int4) a chunk rides in the "
        "decoding rows' verification forward instead of a forward of its own.",
    )
    cuda_graphs: CudaGraphs = option(
        CudaGraphs.AUTO, check=one_of(CudaGraphs),
        help="on: capture the decode forwards of models on a CUDA device as CUDA graphs and replay them (needs "
        "--device cuda); off: run them as they come; auto (default): on for a CUDA device, off elsewhere.",
    )
    prefix_cache_size: int | str = option(
        AUTO, check=integer(0, auto=True), metavar="BYTES|auto", read=read_size,
        help="Keys and values of read prompts kept for later prompts that start the same way (multi-turn chats, "
        "shared system prompts), least recently used first out: 0 turns it off; auto: a quarter of free memory, "
        "at most 4 GiB. Outputs are the same either way (with int8, the reused KV is the same bits).",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        require_int("ngram_max", self.ngram_max, minimum=self.ngram_min)
        if self.window_size is not None and self.window_size < self.batch_size:
            raise ValueError(f"window_size must be >= batch_size ({self.batch_size}); got {self.window_size}")

    @property
    def speculative(self) -> bool:
        return self.method is not Method.AUTOREGRESSIVE

    @property
    def adaptive(self) -> bool:
        """The draft length is chosen every round (``num_draft_tokens="auto"``)."""
        return self.num_draft_tokens == AUTO

    @property
    def uses_draft_model(self) -> bool:
        return uses_draft_model(self.method, self.proposer)

    @property
    def window(self) -> int:
        """The exspec window W."""
        return self.window_size if self.window_size is not None else WINDOW_MULTIPLE * self.batch_size


@dataclass(frozen=True)
class SamplingParams:
    """How a request samples, each setting declared once here like :class:`SpecConfig`'s (default, help text, check
    and command-line reading) and checked on construction: ``batchspec generate``, ``batchspec.generate``, the
    server and the adapters take theirs from here. The default (temperature 0) is greedy decoding. The seed is a
    request's as well (:class:`RequestOptions`); each row samples with one derived from it.
    """

    temperature: float = option(
        0.0, check=number(0.0), short="-t", metavar="T", minimum=0.0,
        help="0 decodes greedily; above 0 samples from the target's logits divided by it, and speculative outputs "
        "follow the target's own distribution at this temperature.",
    )
    top_k: int | None = option(
        None, check=optional(integer(1)), metavar="K", minimum=1,
        help="Sample only from the K most probable tokens (tokens tied with the K-th are kept too; T > 0).",
    )
    top_p: float | None = option(
        None, check=optional(number(0.0, 1.0, above=True)), metavar="P", minimum=0.0, maximum=1.0,
        help="Sample only from the smallest set of most probable tokens whose probability reaches P, 0 < P <= 1 "
        "(T > 0).",
    )

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class ModelOptions:
    """How the models load and run, each option declared once here like :class:`SpecConfig`'s (default, help text,
    check and command-line reading) and checked on construction; names are kept as plain strings.
    :class:`~batchspec.models.ModelChoice` adds which models; ``batchspec.models.load_pair`` and the Ray predictor
    take these defaults.
    """

    dtype: str = option(
        AUTO, check=named(DType), choices=DType,
        help="Weights and compute dtype of both models. auto (default): float32, on the CPU and on CUDA, where "
        "greedy output is exactly the target's own; bfloat16 or float16 halve the memory, and greedy output then "
        "equals the target's up to near-ties (and on CPUs without native bf16 kernels bfloat16 is also slower).",
    )
    kernels: str = option(
        AUTO, check=named(Kernels), choices=Kernels,
        help="CPU matrix kernels. auto (default): float32 models on the CPU run their linear layers on oneDNN with "
        "weights prepacked once (faster steps and verifications, twice the memory for the weights); packed "
        "insists on it; default keeps PyTorch's own kernels.",
    )
    quantize: str = option(
        AUTO, check=named(Quantize), choices=Quantize,
        help="auto (default): on the CPU in float32 where batchspec's native kernels run (x86-64 with AVX2), int4 "
        "on the avx2 build for models read from GGUF files that hold 4-bit weights (the presets: the model as "
        "published), int8 otherwise (on the VNNI builds int8 reads prompts and verifies drafts faster); none "
        "elsewhere (see docs/integer.md). int8: int8 weights and per-token int8 activations with "
        "integer-exact attention: each row's logits are bit-identical whatever the batch, so output equals the "
        "quantized model's own decoding exactly; CPU only. int4: the same with 4-bit weights (a GGUF file's own "
        "Q4_0/Q4_1/Q4_K blocks, its other tensors int8) and int8 activations per block of 256: half the bytes a "
        "step reads. none: the dtype's own arithmetic (float32 on the CPU: the original model).",
    )
    draft_quantize: str = option(
        "same", check=named(DraftQuantize), choices=DraftQuantize,
        help="The draft model's weights where the models are quantized (--quantize int8 or int4). same (default): "
        "as --quantize makes the target (in int4 a GGUF file's own Q4 blocks, its other tensors int8). int4: every "
        "linear layer but the output in 4 bits, a GGUF file's own Q4 blocks where it holds them and the rest rounded "
        "to the same grid: a one-row draft step reads about half the bytes (faster at B = 1, slower from B = 4 on, "
        "where the int4 product is bound by its arithmetic; docs/integer.md). The draft's weights never change the "
        "output: the target verifies every token.",
    )
    cache_dir: Path | None = option(
        None, metavar="DIR", file_okay=False,
        help="Where presets and dequantized GGUF files are cached; default $BATCHSPEC_CACHE, else "
        f"$XDG_CACHE_HOME/batchspec, else ~/.cache/batchspec (now: {default_cache_dir()}).",
    )
    device: str = option(
        AUTO, metavar="auto|cpu|cuda|cuda:N",
        help="Where the models run. auto (default): the first CUDA device when torch sees one, else the CPU.",
    )
    batch_invariant: bool = option(
        False,
        help="Run the models on batch-invariant Triton kernels (CUDA only): each row's logits are the same bits "
        "whatever the batch, so greedy output equals the model's own one-prompt decoding exactly in any dtype, and "
        "a seed gives the same samples at any batch size. On the CPU, --quantize int8 does this.",
    )

    def __post_init__(self) -> None:
        check_fields(self)


SEED_LIMIT = 1 << 63  # seeds are in [0, 2**63): an int64 on any device


def one_seed(name: str, value: Any) -> Any:
    """The check of one seed: an int in ``[0, 2**63)``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_LIMIT:
        raise ValueError(f"{name} must be an int in [0, 2**63); got {value!r}")
    return value


@dataclass(frozen=True)
class RequestOptions:
    """What a request carries besides its sampling, declared as :class:`SamplingParams`'s fields are: its budget of new
    tokens (a request's, not a setting of the run: each Sequence carries its own) and its seed (each row samples with
    one derived from it). Only the declarations are read (:func:`declaration`); the API and the commands take the two
    as keywords."""

    max_new_tokens: int = option(DEFAULT_MAX_NEW_TOKENS, check=integer(0), metavar="N", minimum=0,
                                 help="New tokens per prompt at most.")
    seed: int | None = option(
        None, check=optional(one_seed), metavar="S",
        help="Seed for sampling (T > 0): with a draft, the same seed gives the same outputs whatever the batch size, "
        "draft length or method (eqspec, exspec).",
    )


DECLARING = (SpecConfig, SamplingParams, RequestOptions, ModelOptions)


def declaration(name: str) -> tuple[Any, Any]:
    """The declaration of the option ``name`` (a field of :class:`SpecConfig`, :class:`SamplingParams`,
    :class:`RequestOptions` or :class:`ModelOptions`) and its type; a KeyError for any other name."""
    record = next((r for r in DECLARING if name in r.__dataclass_fields__), None)
    if record is None:
        raise KeyError(f"no option {name!r} is declared in config.py")
    return record.__dataclass_fields__[name], get_type_hints(record)[name]


def setting_default(name: str) -> Any:
    """The default declared for the option ``name`` (for holders that must not write it again)."""
    return declaration(name)[0].default


def require_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is an integer (not a bool) in ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer; got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}; got {value}")
