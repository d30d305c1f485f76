"""Trained drafters for one target: Medusa heads and an EAGLE-style feature-level head.

Both read the target's **features**: the final hidden states (after the final norm) that its LM head
turns into logits, ``f_p`` for the token at position ``p`` (``lm_head(f_p)`` scores token ``p + 1``).
Both score tokens with the target's own LM head, restricted to a token map (``head_ids``, the N most
frequent tokens, FR-Spec, Zhao et al. 2025, arXiv 2502.14856; EAGLE-3 does the same with its 32k
draft vocabulary): the drafter stores none of the target's weights, only ``head_ids``.

- :class:`MedusaHeads` (Cai et al. 2024, arXiv 2401.10774, Medusa-1: frozen target): K heads, head
  ``i`` (1-based) a residual block ``h + SiLU(W_i h + b_i)`` on ``f_p``, scoring token ``p + 1 + i``.
  ``W_i`` starts at zero, so an untrained head predicts what the LM head predicts (token ``p + 1``).
  One difference from the paper: the heads share the target's LM head instead of each copying it.
- :class:`EagleHead` (Li et al. 2024, arXiv 2401.15077, EAGLE-1): at position ``p`` it takes the pair
  (embedding of token ``p + 1``, feature ``f_p``), maps it with ``fc: 2H -> H`` and one decoder layer
  (a ``transformers`` Qwen2 layer with its own KV cache, RoPE positions as the target's) plus a final
  RMS norm to a predicted feature ``f^_{p+1}``, whose LM-head scores give token ``p + 2``. Drafting
  feeds its own predicted features back autoregressively.

A drafter is saved as ``model.safetensors`` (its weights and ``head_ids``) plus ``drafter.json``
(:class:`DrafterConfig`, the target's identity, the training report). Loading it next to another
target is a :class:`~specdecode.errors.IncompatibleModelsError`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specdecode.errors import IncompatibleModelsError
from specdecode.models.torch.compat import cache_kwargs
from specdecode.models.torch.quant import int8_linear

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

KINDS = ("medusa", "eagle")
CONFIG_FILE = "drafter.json"
WEIGHTS_FILE = "model.safetensors"
# config keys that say which network the target is (dtype, paths and versions left out)
_IDENTITY_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "rms_norm_eps",
    "tie_word_embeddings",
)


def target_identity(target: PreTrainedModel) -> dict[str, Any]:
    """Who a drafter was trained for: ``{"name", "hidden_size", "vocab_size", "config_hash",
    "weights_hash"}``.

    ``config_hash``: SHA-256 (16 hex digits) of the config keys that define the network.
    ``weights_hash``: SHA-256 (16 hex digits) of the first 4 rows of the input embeddings and of the
    LM head, and of the final norm, rounded to bfloat16 (so float32 and bfloat16 loads of the same
    weights agree; two random models with one config do not).
    """
    config = target.config.to_dict()
    picked = {key: config.get(key) for key in _IDENTITY_KEYS}
    digest = hashlib.sha256()
    with torch.no_grad():
        parts = [target.get_input_embeddings().weight[:4], target.get_output_embeddings().weight[:4]]
        norm = getattr(target.get_decoder(), "norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None:
            parts.append(norm.weight)
        for part in parts:
            digest.update(part.detach().to("cpu", torch.bfloat16).float().numpy().tobytes())
    return {
        "name": str(getattr(target.config, "_name_or_path", "") or getattr(target, "name_or_path", "") or ""),
        "hidden_size": int(target.config.hidden_size),
        "vocab_size": int(target.get_output_embeddings().weight.shape[0]),
        "config_hash": hashlib.sha256(json.dumps(picked, sort_keys=True, default=str).encode()).hexdigest()[:16],
        "weights_hash": digest.hexdigest()[:16],
    }


@dataclass
class DrafterConfig:
    """Shape and provenance of a trained drafter (saved as ``drafter.json``).

    Attributes:
        kind: ``"medusa"`` or ``"eagle"``.
        hidden_size: H, the target's hidden size (the features' width).
        vocab_size: V, the target's vocabulary (rows of its LM head).
        draft_vocab_size: N = len(head_ids), the tokens the drafter can propose.
        num_heads: Medusa: K heads, drafting up to K tokens per step. EAGLE: unused (drafts any k).
        intermediate_size: EAGLE: the decoder layer's MLP width.
        num_attention_heads, num_key_value_heads, head_dim, rope_theta, rms_norm_eps,
        max_position_embeddings: EAGLE: the decoder layer's attention (taken from the target).
        target: :func:`target_identity` of the target it was trained for.
        training: what training reported (data, steps, time, validation agreement per position).
    """

    kind: str
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    num_heads: int = 4
    intermediate_size: int = 0
    num_attention_heads: int = 1
    num_key_value_heads: int = 1
    head_dim: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    target: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)}, got {self.kind!r}")
        for name in ("hidden_size", "vocab_size", "draft_vocab_size", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size ({self.vocab_size})")

    @classmethod
    def for_target(
        cls,
        kind: str,
        target: PreTrainedModel,
        draft_vocab_size: int,
        num_heads: int = 4,
        intermediate_size: int | None = None,
    ) -> DrafterConfig:
        """A config shaped for ``target`` (attention from its config; EAGLE MLP width default
        ``target.intermediate_size // 2``, rounded to a multiple of 64)."""
        c = target.config
        H = int(c.hidden_size)
        heads = int(c.num_attention_heads)
        if intermediate_size is None:
            intermediate_size = max(64, int(getattr(c, "intermediate_size", 4 * H)) // 2 // 64 * 64)
        return cls(
            kind=kind,
            hidden_size=H,
            vocab_size=int(target.get_output_embeddings().weight.shape[0]),
            draft_vocab_size=int(draft_vocab_size),
            num_heads=num_heads,
            intermediate_size=int(intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(c, "head_dim", None) or H // heads),
            rope_theta=float(
                getattr(c, "rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
            ),
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            max_position_embeddings=int(getattr(c, "max_position_embeddings", 32768)),
            target=target_identity(target),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _TargetParts:
    """The target's tensors a drafter uses, borrowed (never saved, never converted with the
    drafter): the LM head rows of ``head_ids`` (a copy, ``[N, H]``) and the input embeddings."""

    def __init__(self) -> None:
        self.head_weight: torch.Tensor | None = None  # (N, H), frozen copy
        self.head_bias: torch.Tensor | None = None  # (N,) or None
        self.head_int8: nn.Module | None = None  # the rows as a dynamic int8 linear, instead (quantize_head)
        self.embed: nn.Module | None = None


class Drafter(nn.Module):
    """Common part of the two drafters: config, ``head_ids`` and the borrowed target head."""

    def __init__(self, config: DrafterConfig, head_ids: torch.Tensor) -> None:
        super().__init__()
        ids = torch.as_tensor(head_ids, dtype=torch.int64)
        if ids.dim() != 1 or ids.numel() != config.draft_vocab_size:
            raise ValueError(f"head_ids must be int64 [{config.draft_vocab_size}], got {list(ids.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"head_ids must be distinct ids in [0, {config.vocab_size})")
        self.config = config
        self.register_buffer("head_ids", ids, persistent=True)
        self._target = _TargetParts()

    @property
    def attached(self) -> bool:
        return self._target.head_weight is not None or self._target.head_int8 is not None

    @property
    def target_model(self) -> PreTrainedModel | None:
        """The ``transformers`` target :meth:`attach` attached the drafter to, while it lives; None
        otherwise (not attached, or attached to a GGUF target's parts, :meth:`attach_parts`)."""
        return None if self._target.model is None else self._target.model()

    @property
    def head_quantized(self) -> bool:
        """The copied LM-head rows are a dynamic int8 linear (:meth:`quantize_head`)."""
        return self._target.head_int8 is not None

    def quantize_head(self) -> Drafter:
        """Replace the copied LM-head rows (``[N, H]`` in the target's dtype) with a dynamic int8
        linear of them (:func:`specdecode.models.torch.quant.int8_linear`: int8 weights, one scale per
        row, activations quantized per call; float32 in, float32 out) and free the float rows.

        On the shipped EAGLE head for the default target (16,384 rows of 1,536): 50.3 MB -> 25 MB,
        the head's matrix-vector product 2.3 ms -> 0.3 ms per call on the reference CPU, held-out
        top-1 agreement per draft position unchanged to 0.001 (lab/notebook/2026-11-25-int8-head.md).
        Inference only: the int8 linear has no gradient, and
        :meth:`attach` (re)copies float rows. Drafts stay exact under verification either way.

        Returns:
            ``self``.

        Raises:
            RuntimeError: not attached.
            ValueError: the rows are not on the CPU (torch's dynamic int8 linear has no GPU kernel).
        """
        weight = self._target.head_weight
        if weight is None:
            if self._target.head_int8 is not None:
                return self
            raise RuntimeError("drafter is not attached to a target (call attach(target))")
        if weight.device.type != "cpu":
            raise ValueError(f"head_quantization='int8' needs the drafter on the CPU, it is on {weight.device}")
        bias = self._target.head_bias
        rows = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")  # no allocation
        rows.weight = nn.Parameter(weight, requires_grad=False)  # int8_linear copies it to float32
        if bias is not None:
            rows.bias = nn.Parameter(bias, requires_grad=False)
        self._target.head_int8 = int8_linear(rows)
        self._target.head_weight = self._target.head_bias = None
        return self

    def attach(self, target: PreTrainedModel, check: bool = True, dtype: torch.dtype | None = None) -> Drafter:
        """Borrow the target's LM head rows (copied) and input embeddings; move the drafter to the
        target's device and to ``dtype`` (default: the target's dtype; training uses float32).

        Raises:
            IncompatibleModelsError: ``check`` and the drafter was trained for another target.
        """
        if check:
            check_target(self.config, target)
        head = target.get_output_embeddings()
        ids = self.head_ids.to(head.weight.device)
        dtype = dtype or head.weight.dtype
        self._target.head_weight = head.weight.detach()[ids].to(dtype).contiguous()
        self._target.head_int8 = None
        self._target.head_bias = None if head.bias is None else head.bias.detach()[ids].to(dtype).contiguous()
        self._target.embed = target.get_input_embeddings()
        self._target.model = weakref.ref(target)
        return self._place(head.weight.device, dtype)

    def attach_parts(self, head_rows: torch.Tensor, embed: nn.Module, dtype: torch.dtype = torch.float32) -> Drafter:
        """Attach to a target that is not a ``transformers`` model (a GGUF file on llama.cpp,
        :mod:`specdecode.models.llamacpp.gguf_tensors`): its LM-head rows of :attr:`head_ids` and a module
        embedding token ids, given by the caller, who has checked they belong to the drafter's target.

        Args:
            head_rows: ``[N, H]``, row j the head's row of token ``head_ids[j]`` (copied, in ``dtype``).
            embed: int64 ids ``[...] -> [..., H]``.
            dtype: the drafter's dtype (float32: llama.cpp's features are float32).

        Raises:
            ValueError: ``head_rows`` is not ``[N, H]``.
        """
        N, H = self.config.draft_vocab_size, self.config.hidden_size
        if tuple(head_rows.shape) != (N, H):
            raise ValueError(f"head_rows must be [{N}, {H}], got {list(head_rows.shape)}")
        self._target.head_weight = head_rows.detach().to(dtype).contiguous()
        self._target.head_int8 = None
        self._target.head_bias = None
        self._target.embed = embed
        self._target.model = None
        return self._place(head_rows.device, dtype)

    def _place(self, device: torch.device, dtype: torch.dtype) -> Drafter:
        """Move the drafter to ``device`` and ``dtype``, its token ids int64 and RoPE frequencies float32."""
        self.to(device=device, dtype=dtype)
        self.head_ids = self.head_ids.to(torch.int64)  # .to(dtype) leaves integer buffers alone; be sure
        for module in self.modules():  # RoPE frequencies stay float32, as in a target loaded in 16 bits
            original = getattr(module, "original_inv_freq", None)
            if isinstance(original, torch.Tensor) and isinstance(getattr(module, "inv_freq", None), torch.Tensor):
                module.inv_freq = original.to(device=device, dtype=torch.float32)
        return self

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores over the token map: ``[..., H] -> float32 [..., N]`` (column j is ``head_ids[j]``)."""
        if self._target.head_int8 is not None:  # takes [M, H] (activations quantized per call)
            flat = hidden.reshape(-1, hidden.shape[-1]).float()
            return self._target.head_int8(flat).view(*hidden.shape[:-1], -1)
        if self._target.head_weight is None:
            raise RuntimeError("drafter is not attached to a target (call attach(target))")
        weight = self._target.head_weight
        out = nn.functional.linear(hidden.to(weight.dtype), weight, self._target.head_bias)
        return out.float()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's input embeddings of ``ids``: int64 ``[...] -> [..., H]``."""
        if self._target.embed is None:
            raise RuntimeError("drafter is not attached to a target (call attach(target))")
        return self._target.embed(ids).detach()


class MedusaHeads(Drafter):
    """K Medusa heads (one residual block each) over the target's features.

    ``forward(features [..., H]) -> [..., K, H]``: head i's hidden state; ``logits`` of it score
    token ``p + 1 + i`` (i = 1..K) for the feature of position ``p``.
    """

    def __init__(self, config: DrafterConfig, head_ids: torch.Tensor) -> None:
        super().__init__(config, head_ids)
        H = config.hidden_size
        self.blocks = nn.ModuleList(nn.Linear(H, H) for _ in range(config.num_heads))
        for block in self.blocks:  # Medusa's initialisation: each head starts as the identity
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        features = features.to(self.blocks[0].weight.dtype)
        outs = [features + nn.functional.silu(block(features)) for block in self.blocks]
        return torch.stack(outs, dim=-2)  # (..., K, H)


class EagleHead(Drafter):
    """The EAGLE-style head: ``fc(embed(x_{p+1}) ++ f_p)`` -> one decoder layer -> RMS norm -> ``f^_{p+1}``."""

    def __init__(self, config: DrafterConfig, head_ids: torch.Tensor) -> None:
        from transformers import Qwen2Config, Qwen2Model  # here: importing the package loads no transformers model

        super().__init__(config, head_ids)
        H = config.hidden_size
        self.fc = nn.Linear(2 * H, H)
        layer_config = Qwen2Config(
            vocab_size=1,  # inputs_embeds only: the token embeddings are the target's
            hidden_size=H,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim or H // config.num_attention_heads,
            rope_theta=config.rope_theta,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            pad_token_id=None,
            use_sliding_window=False,
        )
        layer_config._attn_implementation = "sdpa"
        self.layer_config = layer_config
        self.decoder = Qwen2Model(layer_config)

    def new_cache(self) -> DynamicCache:
        """An empty KV cache for :meth:`forward`."""
        from transformers import DynamicCache

        return DynamicCache(config=self.layer_config)

    def forward(
        self,
        features: torch.Tensor,
        token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache | None = None,
        attention_mask: torch.Tensor | dict | None = None,
    ) -> torch.Tensor:
        """Predicted next features.

        Args:
            features: ``[B, M, H]``, ``f_p`` (true or predicted) for M positions p.
            token_ids: int64 ``[B, M]``, the token at ``p + 1`` for each.
            position_ids: int64 ``[B, M]``, ``p + 1`` (the position of the token fed).
            cache: the head's KV cache (extended in place), or None (no cache, causal over the M); or a
                :class:`~specdecode.models.torch.static_cache.StaticKVCache` the caller prepared, with
                a ready mask (:mod:`specdecode.drafters.graphs`).
            attention_mask: None (causal), or a ready 4D additive mask as ``{"full_attention": [B, 1, M, L]}``
                for token trees.

        Returns:
            ``[B, M, H]`` predicted ``f^_{p+1}`` (score them with :meth:`logits` for token ``p + 2``).
        """
        x = torch.cat([self.embed(token_ids).to(self.fc.weight.dtype), features.to(self.fc.weight.dtype)], dim=-1)
        out = self.decoder(
            inputs_embeds=self.fc(x),
            position_ids=position_ids,
            **cache_kwargs(self.decoder, cache),
            use_cache=cache is not None,
            attention_mask=attention_mask,
        )
        return out.last_hidden_state


def build_drafter(config: DrafterConfig, head_ids: torch.Tensor) -> MedusaHeads | EagleHead:
    """A fresh (randomly initialised, Medusa: identity-initialised) drafter of ``config.kind``."""
    torch_cls = MedusaHeads if config.kind == "medusa" else EagleHead
    return torch_cls(config, head_ids)


def check_target(config: DrafterConfig, target: PreTrainedModel) -> None:
    """Raise unless ``config`` was trained for ``target``.

    Raises:
        IncompatibleModelsError: hidden size, vocabulary, config hash or weights hash differ (the
            message names what and both values).
    """
    mine = target_identity(target)
    theirs = config.target
    for key in ("hidden_size", "vocab_size", "config_hash", "weights_hash"):
        if key in theirs and theirs[key] != mine[key]:
            raise IncompatibleModelsError(
                f"drafter was trained for target {theirs.get('name') or '?'!r} ({key} {theirs[key]}); this target "
                f"{mine['name'] or '?'!r} has {key} {mine[key]}. Train one for it: specdecode train-drafter"
            )


def read_drafter_config(folder: str | Path) -> DrafterConfig:
    """The :class:`DrafterConfig` saved in ``folder / drafter.json`` (no weights are read).

    Raises:
        FileNotFoundError: no ``drafter.json`` there.
        ValueError: a malformed ``drafter.json``.
    """
    path = Path(folder) / CONFIG_FILE
    try:
        return DrafterConfig(**json.loads(path.read_text()))
    except (TypeError, ValueError) as error:
        raise ValueError(f"drafter: malformed {path}: {error}") from error


def save_drafter(drafter: MedusaHeads | EagleHead, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``model.safetensors`` and ``drafter.json`` into ``out_dir`` (created); returns it.

    Args:
        drafter: the drafter (attached or not; the target's tensors are never saved).
        out_dir: the folder.
        dtype: store the floating-point weights in this dtype (e.g. ``torch.bfloat16``: half the
            file of float32; :meth:`Drafter.attach` casts to the target's dtype on load anyway);
            None keeps the drafter's own. ``head_ids`` stays int64.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().to("cpu", dtype if dtype is not None and v.is_floating_point() else v.dtype).contiguous()
        for k, v in drafter.state_dict().items()
        if not k.startswith("_target")
    }
    save_file(state, str(out / WEIGHTS_FILE), metadata={"kind": drafter.config.kind})
    (out / CONFIG_FILE).write_text(json.dumps(drafter.config.to_dict(), indent=2) + "\n")
    return out


def load_drafter(
    path: str | Path, target: PreTrainedModel | None = None, kind: str | None = None
) -> MedusaHeads | EagleHead:
    """Load a drafter saved by :func:`save_drafter` (and attach it to ``target``, checked).

    Args:
        path: the drafter's folder.
        target: the target model; None leaves the drafter unattached.
        kind: the kind expected (``"medusa"`` / ``"eagle"``), or None for any.

    Raises:
        FileNotFoundError: ``path`` has no ``drafter.json`` / ``model.safetensors``.
        ValueError: a malformed config, or a drafter of another kind than ``kind``.
        IncompatibleModelsError: trained for another target.
    """
    folder = Path(path)
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(
            f"drafter: {folder} has no {CONFIG_FILE} and {WEIGHTS_FILE} (train one with specdecode train-drafter)"
        )
    config = read_drafter_config(folder)
    if kind is not None and config.kind != kind:
        raise ValueError(f"drafter: {folder} holds a {config.kind!r} drafter, not {kind!r}")
    state = load_file(str(folder / WEIGHTS_FILE))
    drafter = build_drafter(config, state["head_ids"])
    drafter.load_state_dict(state, strict=True)
    drafter.eval()
    if target is not None:
        drafter.attach(target)
    return drafter
