"""Self-speculation: the target's first layers draft (early exit).

The first ``L`` decoder layers of the target, followed by its own final norm and LM head, form a
shallow model that drafts tokens; the full model verifies them, so the output stays exact. As in
Draft & Verify (Zhang et al. 2023, arXiv 2309.08168) and LayerSkip (Elhoushi et al. 2024, arXiv
2404.16710), with two differences: the target is used as trained (no layer-dropout / early-exit
loss, so shallow exits agree less often than in LayerSkip), and the shallow view keeps its own KV
cache instead of sharing the first ``L`` layers' cache with the verification pass.

No second model lives in memory: :func:`early_exit_view` builds a module tree whose submodules
*are* the target's (same parameter tensors); only a config copy and a KV cache are new.

The exit layer can be calibrated per target (``specdecode calibrate-early-exit``); the choice is
saved in ``<cache dir>/calibration/early_exit.json``, keyed by :func:`target_identity`, and
:class:`EarlyExitConfig` with ``exit_layer=None`` uses it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from specdecode.models.default import cache_dir
from specdecode.proposers.draft_model import DraftModelConfig, DraftModelProposer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

# Submodules of the decoder (``target.model``) the shallow view shares; any other is an unknown layout.
SHARED_DECODER_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")
CALIBRATION_FILE = Path("calibration") / "early_exit.json"
_VOLATILE_CONFIG_KEYS = ("transformers_version", "dtype", "torch_dtype", "use_cache")


def default_exit_layer(num_layers: int) -> int:
    """The exit layer used when none is given or calibrated: a quarter of the depth (at least 1)."""
    return max(1, num_layers // 4)


@dataclass(frozen=True)
class EarlyExitConfig(DraftModelConfig):
    """Options of :class:`EarlyExitProposer`: every :class:`DraftModelConfig` option, plus the exit layer.
    ``draft_quantization`` defaults to ``"none"`` here: ``"int8"`` drafts with a quantized copy of
    the first layers and the head, no longer sharing the target's weights.

    Attributes:
        exit_layer: how many of the target's decoder layers draft, in [1, num_hidden_layers - 1]
            (checked against the target when the proposer is built). None: the value saved by
            ``specdecode calibrate-early-exit`` for this target, else ``num_hidden_layers // 4``
            (with a logged warning). A string of an integer (from the command line) is accepted.

    Raises:
        ValueError: ``exit_layer`` is not None or an integer >= 1 (or a parent option is bad).
    """

    draft_quantization: str | None = field(
        default="none",
        metadata={"help": "none (default: share the target's layers) or int8 (an int8 copy of the first layers)"},
    )
    exit_layer: int | None = field(
        default=None,
        metadata={"help": "decoder layers that draft, in [1, layers - 1] (default: calibrated, else layers // 4)"},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        value = self.exit_layer
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            value = int(value)
            object.__setattr__(self, "exit_layer", value)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"exit_layer must be None or an integer >= 1, got {self.exit_layer!r}")


def num_decoder_layers(target: PreTrainedModel) -> int:
    """``config.num_hidden_layers`` of ``target``."""
    return int(target.config.num_hidden_layers)


def check_exit_layer(exit_layer: int, target: PreTrainedModel) -> int:
    """Return ``exit_layer`` if it is a valid exit layer of ``target``.

    Raises:
        ValueError: outside [1, num_hidden_layers - 1] (the message names ``exit_layer`` and the range).
    """
    n = num_decoder_layers(target)
    if n < 2:
        raise ValueError(f"exit_layer: the target has {n} decoder layer(s); early exit needs at least 2")
    if not isinstance(exit_layer, int) or isinstance(exit_layer, bool) or not 1 <= exit_layer <= n - 1:
        raise ValueError(f"exit_layer must be an integer in [1, {n - 1}] for this {n}-layer target, got {exit_layer!r}")
    return exit_layer


def _decoder(target: PreTrainedModel) -> nn.Module:
    """The decoder stack (``target.model``), checked to have a layout the shallow view supports.

    Raises:
        ValueError: another layout (the message names the architecture and what is missing or extra).
    """
    arch = type(target).__name__
    decoder = getattr(target, "model", None)
    head = getattr(target, "lm_head", None)
    layers = getattr(decoder, "layers", None)
    problem = None
    if not isinstance(decoder, nn.Module) or not isinstance(head, nn.Module):
        problem = "it has no `model` decoder and `lm_head` (expected the Llama / Qwen2 layout)"
    elif set(dict(target.named_children())) != {"model", "lm_head"}:
        problem = f"its top-level modules are {sorted(dict(target.named_children()))}, not ['lm_head', 'model']"
    elif not isinstance(layers, nn.ModuleList):
        problem = "`model.layers` is not a ModuleList of decoder layers"
    elif extra := sorted(set(dict(decoder.named_children())) - set(SHARED_DECODER_PARTS)):
        problem = f"its decoder has modules {extra} besides {list(SHARED_DECODER_PARTS)}"
    elif missing := [p for p in ("embed_tokens", "norm") if not isinstance(getattr(decoder, p, None), nn.Module)]:
        problem = f"its decoder has no {missing}"
    elif getattr(target.config, "is_heterogeneous", False):
        problem = "its config has per-layer settings (heterogeneous layers)"
    elif len(layers) != (n := num_decoder_layers(target)):
        problem = f"`model.layers` has {len(layers)} layers but config.num_hidden_layers is {n}"
    if problem:
        raise ValueError(f"early_exit does not support {arch}: {problem}")
    return decoder


def _shallow_config(config: Any, exit_layer: int) -> Any:
    """A copy of ``config`` with only the first ``exit_layer`` layers (``num_hidden_layers``, ``layer_types``)."""
    shallow = copy.deepcopy(config)
    shallow.num_hidden_layers = exit_layer
    if getattr(config, "layer_types", None) is not None:
        shallow.layer_types = list(config.layer_types[:exit_layer])
    return shallow


def early_exit_view(target: PreTrainedModel, exit_layer: int) -> PreTrainedModel:
    """A causal LM made of the target's embeddings, first ``exit_layer`` decoder layers, final norm
    and LM head: the same module objects (no weight is copied), under a config copy whose
    ``num_hidden_layers`` is ``exit_layer``.

    Its forward is the target class's own, so it takes the target's KV cache (a ``DynamicCache`` built
    from its config has ``exit_layer`` layers) and ``logits_to_keep`` like the target, and
    :class:`~specdecode.models.torch.runner.ModelRunner` runs it. Logits: float ``[B, T, V]`` in the
    target's dtype, ``V`` the target's vocabulary.

    Supported: decoder-only models with the Llama / Qwen2 layout (``model.embed_tokens``,
    ``model.layers``, ``model.norm``, optional ``model.rotary_emb``, ``lm_head``): Llama, Qwen2,
    Mistral, Qwen3 and their kin.

    Raises:
        ValueError: ``exit_layer`` outside [1, num_hidden_layers - 1], or a layout not supported.
    """
    check_exit_layer(exit_layer, target)
    decoder = _decoder(target)
    with torch.device("meta"):  # the skeleton's own weights are never allocated: all are replaced below
        view = type(target)(_shallow_config(target.config, exit_layer))
    for part in ("embed_tokens", "norm", "rotary_emb"):
        if hasattr(decoder, part):
            setattr(view.model, part, getattr(decoder, part))
    view.model.layers = nn.ModuleList(list(decoder.layers[:exit_layer]))
    view.lm_head = target.lm_head
    leftover = [n for n, t in (*view.named_parameters(), *view.named_buffers()) if t.is_meta]
    if leftover:
        raise ValueError(f"early_exit does not support {type(target).__name__}: unshared tensors {leftover[:3]}")
    view.generation_config = target.generation_config
    return view.eval()


# ---------------------------------------------------------------- calibrated exit layers
def target_identity(target: PreTrainedModel) -> str:
    """A key for ``target``: SHA-256 (16 hex digits) of its config (dtype and version left out) and
    its ``name_or_path`` (resolved when it is a local folder). Two in-memory models with the same
    config and no path share a key."""
    config = {k: v for k, v in target.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    name = str(getattr(target, "name_or_path", "") or "")
    if name and Path(name).exists():
        name = str(Path(name).resolve())
    text = json.dumps(config, sort_keys=True, default=str) + "\n" + name
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def calibration_path() -> Path:
    """The JSON file of calibrated exit layers: ``<cache dir>/calibration/early_exit.json``."""
    return cache_dir() / CALIBRATION_FILE


def _read_calibrations(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        logger.warning("early_exit: ignoring unreadable calibration file %s (%s)", path, error)
        return {}
    return data if isinstance(data, dict) else {}


def saved_exit_layer(target: PreTrainedModel) -> int | None:
    """The exit layer saved for ``target`` by ``specdecode calibrate-early-exit``, or None."""
    record = _read_calibrations(calibration_path()).get(target_identity(target))
    layer = record.get("exit_layer") if isinstance(record, dict) else None
    if isinstance(layer, int) and 1 <= layer < num_decoder_layers(target):
        return layer
    return None


def save_exit_layer(target: PreTrainedModel, record: dict[str, Any]) -> Path:
    """Save ``record`` (it must hold ``"exit_layer"``) as ``target``'s calibration; returns the file.

    Other targets' records in the file are kept; the write is atomic (temporary file + rename).
    """
    check_exit_layer(record["exit_layer"], target)
    path = calibration_path()
    data = _read_calibrations(path)
    data[target_identity(target)] = record
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


_WARNED: set[str] = set()


def resolve_exit_layer(target: PreTrainedModel, exit_layer: int | None) -> int:
    """``exit_layer`` if given, else the calibrated one, else :func:`default_exit_layer` (warning logged).

    Raises:
        ValueError: ``exit_layer`` outside [1, num_hidden_layers - 1].
    """
    if exit_layer is not None:
        return check_exit_layer(exit_layer, target)
    saved = saved_exit_layer(target)
    if saved is not None:
        return saved
    n = num_decoder_layers(target)
    layer = check_exit_layer(default_exit_layer(n), target)
    identity = target_identity(target)
    if identity in _WARNED:  # once per target and process (a server builds one proposer per request)
        return layer
    _WARNED.add(identity)
    logger.warning(
        "early_exit: no calibrated exit layer for this target (%s); using exit_layer=%d (num_hidden_layers // 4 "
        "of %d). Run `specdecode calibrate-early-exit` to measure and save the fastest one.",
        getattr(target, "name_or_path", "") or type(target).__name__,
        layer,
        n,
    )
    return layer


class EarlyExitProposer(DraftModelProposer):
    """Drafts with the target's first ``exit_layer`` layers (a :func:`early_exit_view`).

    Everything else is :class:`DraftModelProposer`'s: its own KV cache synced by truncation, greedy
    argmax or sampled drafts (``q`` returned for rejection sampling) and the ``draft_confidence``
    cut-off. Lossless under verification by the full target.

    Args:
        target: the target causal LM (Llama / Qwen2 layout); its parameters are shared, not copied.
        config: :class:`EarlyExitConfig` (default: calibrated exit layer, all k tokens drafted).

    Attributes:
        exit_layer: the resolved exit layer.

    Raises:
        ValueError: bad ``exit_layer`` for this target, or an unsupported layout.
    """

    name = "early_exit"

    def __init__(self, target: PreTrainedModel, config: EarlyExitConfig | None = None) -> None:
        config = config or EarlyExitConfig()
        self.exit_layer = resolve_exit_layer(target, config.exit_layer)
        super().__init__(early_exit_view(target, self.exit_layer), config)
