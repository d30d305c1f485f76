"""What the proposers that draft from the target's features share (:mod:`.medusa`, :mod:`.eagle`).

Both take a trained drafter (:mod:`specdecode.drafters.heads`) and read the target's *features*
``f_p`` (its final hidden states, ``lm_head(f_p)`` scores token ``p + 1``), which the engine passes
to ``observe_features`` (``needs_target_features = True``, see :mod:`.base`). Their drafts are
scored over the drafter's token map (``head_ids``, N tokens): greedy takes the argmax over the map;
sampling applies the request's temperature / top-k / top-p to the map's logits and returns ``q``
over the full vocabulary, zero outside the map, so rejection sampling stays exact (as
:class:`~specdecode.proposers.draft_model.DraftModelProposer` does with a token map).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from specdecode.drafters import find_drafter_dir
from specdecode.drafters.heads import CONFIG_FILE, WEIGHTS_FILE, EagleHead, MedusaHeads, load_drafter
from specdecode.models.backends import runner_capabilities
from specdecode.proposers.hybrid import (
    check_prompt_lookup,
    prompt_lookup_max_field,
    prompt_lookup_min_field,
    prompt_lookup_model_k_field,
)
from specdecode.sampling import SamplingParams, argmax_on_device, logits_to_probs, sample

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Per target: (kind, folder, head quantization) -> (the files' modification times, the drafter loaded from them).
_LOADED: weakref.WeakKeyDictionary[
    PreTrainedModel, dict[tuple[str, str, str], tuple[tuple[int, int], MedusaHeads | EagleHead]]
] = weakref.WeakKeyDictionary()

HEAD_QUANTIZATIONS = ("auto", "none", "int8")


def resolve_head_quantization(value: str | None, target: PreTrainedModel) -> str:
    """What ``head_quantization`` means for ``target``: ``"int8"`` or ``"none"`` (``"auto"``: int8
    when the target is on the CPU; None: ``"none"``)."""
    if value == "auto":
        if not runner_capabilities(target).model_insides:  # rows read from its file (a GGUF): on the CPU
            return "int8"
        return "int8" if target.get_output_embeddings().weight.device.type == "cpu" else "none"
    return value or "none"


@dataclass(frozen=True)
class TrainedDrafterConfig:
    """Options of the proposers with a trained drafter (:class:`~.medusa.MedusaConfig`,
    :class:`~.eagle.EagleConfig`).

    Attributes:
        drafter: the drafter's folder (``drafter.json`` + ``model.safetensors``, written by
            ``specdecode train-drafter``); None: the target's own default, the user's drafter in the
            cache if there is one, else the one shipped with specdecode
            (:func:`specdecode.drafters.find_drafter_dir`).
        draft_confidence: stop drafting as soon as the drafter's top probability (over its token
            map, after the request's temperature / top-k / top-p; plain softmax when greedy) falls
            below this value, in [0, 1); 0 drafts all k tokens (as in
            :class:`~specdecode.proposers.draft_model.DraftModelConfig`).
        prompt_lookup_min, prompt_lookup_max: prompt lookup first, the drafter otherwise
            (:mod:`specdecode.proposers.hybrid`; 0 = off), as in ``DraftModelConfig``.
        prompt_lookup_model_k: with prompt lookup first, the most tokens the drafter drafts in a
            step lookup missed (None: its default k, 2); k bounds lookup's drafts.
        head_quantization: ``"int8"`` scores the drafts with a dynamic int8 copy of the target's
            LM-head rows the drafter borrows (:meth:`~specdecode.drafters.heads.Drafter.quantize_head`:
            half the memory of bfloat16 rows, a quarter of float32, and 8x faster on the reference
            CPU at the same held-out agreement); ``"auto"`` (default) does so on the CPU (torch's
            dynamic int8 linear has no GPU kernel), ``"none"`` (or None) keeps the rows in the target's dtype.
            Drafts stay exact under verification either way.

    Raises:
        ValueError: ``draft_confidence`` outside [0, 1), ``drafter`` not a path, bad
            ``prompt_lookup_min`` / ``prompt_lookup_max`` / ``prompt_lookup_model_k``, or
            ``head_quantization`` not one of ``"auto"``, ``"none"``, ``"int8"``.
        FileNotFoundError: ``drafter`` names a folder without a saved drafter (checked here, before
            any model loads).
    """

    kind: ClassVar[str] = ""  # the drafter kind, set by each subclass (not an option)

    drafter: str | None = field(
        default=None,
        metadata={
            "help": "folder of a trained drafter (default: <cache>/drafters/KIND-TARGET from train-drafter, "
            "else the one shipped with specdecode)"
        },
    )
    draft_confidence: float = field(default=0.0, metadata={"help": "stop drafting when top prob < this (0 = off)"})
    prompt_lookup_min: int = prompt_lookup_min_field()
    prompt_lookup_max: int = prompt_lookup_max_field()
    prompt_lookup_model_k: int | None = prompt_lookup_model_k_field()
    head_quantization: str | None = field(
        default="auto",
        metadata={"help": "auto (default: int8 on the CPU), none, or int8: the copied LM-head rows in dynamic int8"},
    )

    def __post_init__(self) -> None:
        check_prompt_lookup(self)
        if self.head_quantization is None:  # as draft_quantization: None is "none"
            object.__setattr__(self, "head_quantization", "none")
        if self.head_quantization not in HEAD_QUANTIZATIONS:
            raise ValueError(
                f"head_quantization must be one of {list(HEAD_QUANTIZATIONS)}, got {self.head_quantization!r}"
            )
        if not isinstance(self.draft_confidence, int | float) or not 0.0 <= self.draft_confidence < 1.0:
            raise ValueError(f"draft_confidence must be a number in [0, 1), got {self.draft_confidence!r}")
        if self.drafter is not None:
            if not isinstance(self.drafter, str | os.PathLike) or not str(self.drafter):
                raise ValueError(f"drafter must be a folder path, got {self.drafter!r}")
            object.__setattr__(self, "drafter", str(self.drafter))
            check_drafter_dir(Path(self.drafter), self.kind)


def check_drafter_dir(path: Path, kind: str, default: bool = False) -> None:
    """Raise FileNotFoundError, saying how to make one, unless ``path`` holds a saved drafter."""
    if (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file():
        return
    where = f"the default drafter folder {path}" if default else f"--drafter {path}"
    raise FileNotFoundError(
        f"{kind} proposer: {where} holds no trained drafter ({CONFIG_FILE} and {WEIGHTS_FILE}); train one "
        f"with `specdecode train-drafter --kind {kind}`" + (" or give --drafter DIR" if default else "")
    )


def load_for_target(kind: str, config: TrainedDrafterConfig, target: PreTrainedModel | None) -> MedusaHeads | EagleHead:
    """The drafter of ``config`` (or the default one for ``target``), attached to ``target``, its
    LM-head rows in int8 where ``config.head_quantization`` says so.

    Raises:
        ValueError: no target given.
        FileNotFoundError: no saved drafter there (the message names ``specdecode train-drafter``).
        IncompatibleModelsError: the drafter was trained for another target.
    """
    if target is None:
        raise ValueError(f"proposer {kind!r} needs the target model (its drafter reads the target's features)")
    if not runner_capabilities(target).model_insides:  # no torch LM head to borrow: rows from its GGUF file
        return _load_for_gguf(kind, config, target)
    default = config.drafter is None
    path = find_drafter_dir(kind, target) if default else Path(config.drafter)  # type: ignore[arg-type]
    check_drafter_dir(path, kind, default)
    # One loaded drafter per (target, kind, folder), reloaded when its files change: proposers keep
    # their state (caches, features) to themselves and only read its weights, so requests share it.
    quantization = resolve_head_quantization(config.head_quantization, target)
    key = (kind, str(path.resolve()), quantization)
    version = ((path / WEIGHTS_FILE).stat().st_mtime_ns, (path / CONFIG_FILE).stat().st_mtime_ns)
    loaded = _LOADED.setdefault(target, {})
    if key not in loaded or loaded[key][0] != version:
        drafter = load_drafter(path, target, kind)
        loaded[key] = (version, drafter.quantize_head() if quantization == "int8" else drafter)  # type: ignore[misc]
    return loaded[key][1]


# A GGUF target's embeddings and LM head, read from its file once per loaded model.
_GGUF_PARTS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_DTYPE_SUFFIXES = ("-bf16", "-bfloat16", "-fp16", "-float16", "-fp32", "-float32")


def gguf_target_name(model: Any) -> str:
    """The name a GGUF target goes by for drafters: its file's stem without the quantization
    (``Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf`` -> ``Qwen2.5-Coder-1.5B-Instruct``)."""
    stem = Path(model.path).stem
    head, _, last = stem.rpartition("-")
    return head if head and last[:1] in "QFBI" and any(c.isdigit() for c in last) else stem


def _trained_for(config: Any) -> str:
    """The target name a drafter's config records, without the folder and a dtype suffix."""
    name = Path(str(config.target.get("name", "")).rstrip("/\\")).name
    for suffix in _DTYPE_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


def _check_gguf_target(config: Any, model: Any, path: Path) -> None:
    """Raise IncompatibleModelsError unless the drafter's hidden size and vocabulary are the GGUF model's."""
    from specdecode.errors import IncompatibleModelsError

    for key, mine in (("hidden_size", model.hidden_size), ("vocab_size", model.vocab_size)):
        theirs = getattr(config, key)
        if theirs != mine:
            raise IncompatibleModelsError(
                f"drafter {path} was trained for a target with {key} {theirs}; the GGUF target {model.path.name} "
                f"has {mine}. Train one for it: specdecode train-drafter"
            )


def find_gguf_drafter_dir(kind: str, model: Any) -> Path:
    """The drafter folder ``--proposer KIND`` uses without ``--drafter`` for a GGUF target: the
    user's drafters (``specdecode train-drafter``, in the cache) first, then the shipped ones, whose
    ``drafter.json`` records a target of the GGUF's name (:func:`gguf_target_name`; a dtype suffix
    such as ``-bf16`` ignored), hidden size and vocabulary. A quantized GGUF has no bfloat16
    weights to compare with the recorded weights hash, so the name stands in for it. None found:
    the user's default folder (which then holds none: the proposers say how to train one)."""
    from specdecode.drafters import default_drafter_dir, shipped_drafters_root
    from specdecode.drafters.heads import read_drafter_config
    from specdecode.models.default import cache_dir

    name = gguf_target_name(model)
    folders = sorted((cache_dir() / "drafters").glob(f"{kind}-*")) + sorted(shipped_drafters_root().glob(f"{kind}-*"))
    for folder in folders:
        if not ((folder / CONFIG_FILE).is_file() and (folder / WEIGHTS_FILE).is_file()):
            continue
        try:
            config = read_drafter_config(folder)
        except ValueError:
            continue
        if (
            _trained_for(config).lower() == name.lower()
            and config.hidden_size == model.hidden_size
            and config.vocab_size == model.vocab_size
        ):
            return folder
    return default_drafter_dir(kind, name)


def _load_for_gguf(kind: str, config: TrainedDrafterConfig, model: Any) -> MedusaHeads | EagleHead:
    """:func:`load_for_target` for a GGUF target on llama.cpp: the drafter in float32, attached to
    the LM-head rows and embeddings dequantized from the GGUF file (:mod:`specdecode.models.llamacpp.gguf_tensors`)."""
    from specdecode.drafters.heads import read_drafter_config
    from specdecode.models.llamacpp.gguf_tensors import GGUFTargetParts

    default = config.drafter is None
    path = find_gguf_drafter_dir(kind, model) if default else Path(config.drafter)  # type: ignore[arg-type]
    check_drafter_dir(path, kind, default)
    _check_gguf_target(read_drafter_config(path), model, path)
    quantization = resolve_head_quantization(config.head_quantization, model)
    key = (kind, str(path.resolve()), quantization)
    version = ((path / WEIGHTS_FILE).stat().st_mtime_ns, (path / CONFIG_FILE).stat().st_mtime_ns)
    loaded = _LOADED.setdefault(model, {})
    if key not in loaded or loaded[key][0] != version:
        parts = _GGUF_PARTS.get(model)
        if parts is None:
            parts = _GGUF_PARTS[model] = GGUFTargetParts(model.path)
        drafter = load_drafter(path, None, kind)
        drafter.attach_parts(parts.head.take(drafter.head_ids.numpy()), parts.embedding_module())
        loaded[key] = (version, drafter.quantize_head() if quantization == "int8" else drafter)  # type: ignore[misc]
    return loaded[key][1]


class FeatureLog:
    """The target features a proposer has received since ``reset``: how many (``count``: positions
    ``0 .. count - 1``), and the rows of the positions from ``start`` on (older rows are dropped)."""

    def __init__(self) -> None:
        self.count = 0
        self.rows: torch.Tensor | None = None  # (count - start, H)

    @property
    def start(self) -> int:
        return self.count - (0 if self.rows is None else int(self.rows.shape[0]))

    def add(self, hidden: torch.Tensor) -> None:
        """Append the features of the next ``m`` positions: ``[m, H]``."""
        if hidden.dim() != 2:
            raise ValueError(f"features must be [m, H], got {list(hidden.shape)}")
        self.rows = hidden if self.rows is None else torch.cat([self.rows, hidden])
        self.count += int(hidden.shape[0])

    def get(self, begin: int, end: int) -> torch.Tensor:
        """Features of positions ``[begin, end)``: ``[end - begin, H]``."""
        if self.rows is None or not self.start <= begin <= end <= self.count:
            raise ValueError(f"features of positions [{begin}, {end}) are not kept ({self.start}..{self.count})")
        return self.rows[begin - self.start : end - self.start]

    def drop_before(self, position: int) -> None:
        """Forget the rows of positions before ``position``."""
        if self.rows is not None and position > self.start:
            self.rows = self.rows[position - self.start :]


def check_features(name: str, known: int, T: int) -> None:
    """Raise RuntimeError unless the features of positions ``0 .. T - 2`` (and no more) are known."""
    if known != T - 1:
        raise RuntimeError(
            f"{name} proposer: it knows the target's features of {known} positions but the context has {T} "
            f"tokens (it needs {T - 1}); it must run inside SpeculativeGenerator, which passes them "
            "(needs_target_features)"
        )


def pick_token(
    logits: torch.Tensor,
    head_ids: torch.Tensor,
    vocab_size: int,
    sampling: SamplingParams,
    generator: torch.Generator | None,
    confidence: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """One draft token from the drafter's scores over its token map.

    Args:
        logits: float ``[N]``, column j scores token ``head_ids[j]``.
        head_ids: int64 ``[N]``.
        vocab_size: V.
        sampling, generator: the request's.
        confidence: also compute the top probability (for ``draft_confidence``).

    Returns:
        ``(token, q, top)``: int64 ``[1]`` full-vocabulary id on the drafter's device (a caller
        drafting k tokens copies them to the host once, docs/design.md §2b); float32 ``[V]`` the
        distribution it was sampled from (zero outside the map), or None when greedy; the top
        probability over the map (0.0 unless ``confidence``: reading it is a host copy).
    """
    if sampling.greedy:
        j = argmax_on_device(logits).view(1)  # (1,) on the drafter's device
        top = float(torch.softmax(logits.float(), -1)[j]) if confidence else 0.0
        return head_ids[j], None, top
    q = logits_to_probs(logits, sampling)  # (N,)
    j = sample(q, generator).view(1)  # (1,)
    full = q.new_zeros(vocab_size).index_copy_(0, head_ids, q)  # (V,)
    return head_ids[j], full, float(q.max()) if confidence else 0.0


def rank_scores(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Log-probabilities that rank tree candidates: float32 ``[..., N] -> [..., N]``, after the
    request's temperature / top-k / top-p (plain log-softmax when greedy)."""
    if sampling.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return logits_to_probs(logits, sampling).log()
