"""A cheaper draft on the CPU: dynamic int8 linear layers (torch's fbgemm / x86 quantized engine).

A draft model need not be exact: verification by the target keeps the output lossless for any
proposal (greedy: the target's argmax decides; sampling: rejection sampling uses the very ``q``
the int8 draft sampled from). So the draft can trade a little agreement for speed, the way
llama.cpp users pair a target with a more heavily quantized draft.

:func:`quantize_int8` keeps every weight matrix as int8 with one scale per output channel and
quantizes the activations of each call on the fly (``torch.ao``'s dynamic quantized ``Linear``
with ``per_channel_dynamic_qconfig``, layer by layer: the int8 GEMM of fbgemm, blocked for few
rows, a quarter of float32's bytes). The MLP's ``down_proj`` stays out of int8 by default: its inputs (the gated MLP
activations) carry the large outlier channels that per-tensor activation scales cannot hold
(Dettmers et al. 2022, LLM.int8(), arXiv 2208.07339; Xiao et al. 2023, SmoothQuant, arXiv
2211.10438). Measured on the default draft (Qwen2.5-Coder-0.5B) over 1,024 tokens of Python
source: the int8 copy's argmax agrees with the float32 draft's on 76% of positions when every
linear is int8 and on 87% with ``down_proj`` kept float32 (79% of the weights int8).

Memory: the layers left out of int8 keep their bfloat16 weights where the CPU multiplies bfloat16
natively (:func:`int8_float_dtype`; float32 layers would also get oneDNN's prepacked copy), and the
embedding table stays bfloat16 (looked up into float32: exact). The default draft's copy holds
871 MB on an AMD EPYC with AVX512-BF16 against 1,499 MB with those layers in float32 (1,771 MB
before the table stayed bfloat16), at the same speed within noise and 0.927 / 0.930 argmax
agreement with the float32 draft (lab/notebook/2026-11-25-lean-int8-draft.md).

Speed on the project's 2-core AVX2 machine (``python lab/scripts/bench_cpu_paths.py --role draft
--paths float32+onednn,int8 --rounds 3``, lab/notebook/2026-11-23-int8-draft.md): one pass of the
default draft over 1 / 5 / 9 / 17 tokens costs 101 / 228 / 244 / 346 ms in float32 (oneDNN) and
79 / 115 / 132 / 170 ms in int8 (prefill of 300 tokens: 2.5 s and 1.4 s). In the bench the draft cost ratio c fell
from 0.239 to 0.147 with the same mean acceptance length (3.40 and 3.42), and ``draft_model`` went
from 0.87x to 1.05x of the target alone over the seven dev categories.

CPU only: torch's dynamic quantized linear has no CUDA kernel.
"""

from __future__ import annotations

import copy
import threading
import warnings
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from specdecode.models.torch.cpu import native_bf16_matmul, use_onednn_linears

_SHARED: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()
_SHARED_HEADS: weakref.WeakKeyDictionary[torch.nn.Module, dict[bytes, torch.nn.Module]] = weakref.WeakKeyDictionary()

DRAFT_QUANTIZATIONS = ("auto", "none", "int8")
INT8_AUTO_MIN_PARAMETERS = 50_000_000  # "auto" leaves smaller drafts alone: the int8 GEMM pays for memory-bound layers
AUTO_INT8_DTYPES = (torch.float32, torch.bfloat16)  # drafts "auto" quantizes (both measured faster in int8)
INT8_KEEP_FLOAT = ("down_proj",)  # linear layers (by name suffix) left out of int8


def check_draft_quantization(value: str | None) -> str | None:
    """``value`` if it is None (same as ``"none"``) or one of :data:`DRAFT_QUANTIZATIONS`.

    Raises:
        ValueError: anything else (the message names ``draft_quantization``).
    """
    if value is None or value in DRAFT_QUANTIZATIONS:
        return value
    raise ValueError(f"draft_quantization must be one of {list(DRAFT_QUANTIZATIONS)} or None, got {value!r}")


def resolve_draft_quantization(value: str | None, model: torch.nn.Module) -> str:
    """What ``draft_quantization`` means for this draft: ``"int8"`` or ``"none"``.

    ``"auto"`` is ``"int8"`` for a float32 or bfloat16 draft on the CPU with at least
    :data:`INT8_AUTO_MIN_PARAMETERS` parameters, else ``"none"`` (a GPU draft, or a tiny one).
    Measured side by side against the draft as loaded (lab/notebook/2026-11-23-int8-draft.md and
    2026-11-25-amx.md): float32 on an AVX2 CPU (``--dtype auto`` there), 1.05x against 0.87x of the
    target alone, and bfloat16 on an Intel CPU with AMX, 1.52x against 1.26x, at the same mean
    acceptance length both times.

    Raises:
        ValueError: ``value`` is not a known setting.
    """
    value = check_draft_quantization(value)
    if value is None or value == "none":
        return "none"
    if value == "int8":
        return "int8"
    params = list(model.parameters())
    on_cpu = bool(params) and all(p.device.type == "cpu" and p.dtype in AUTO_INT8_DTYPES for p in params)
    big = sum(p.numel() for p in params) >= INT8_AUTO_MIN_PARAMETERS
    return "int8" if on_cpu and big else "none"


class _UpcastEmbedding(torch.nn.Module):
    """An input embedding kept in bfloat16 (or float16) inside an otherwise float32 int8 copy: looks
    rows up in the 16-bit table and returns them as float32, which is exact (every 16-bit float is a
    float32). The table is a buffer, not a parameter, so the copy's ``dtype`` stays float32.

    Takes int64 ids ``[...]``, returns float32 ``[..., embedding_dim]``.
    """

    def __init__(self, weight: torch.Tensor, padding_idx: int | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = (int(n) for n in weight.shape)
        self.padding_idx = padding_idx
        self.register_buffer("weight", weight.detach())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight, self.padding_idx).float()


class _CastLinear(torch.nn.Linear):
    """A linear layer left out of int8 that keeps its bfloat16 weight inside the float32 copy: casts
    each call's input to bfloat16 and the result back to float32 (one bfloat16 GEMM, where the CPU
    multiplies bfloat16 natively: :func:`~specdecode.models.torch.cpu.native_bf16_matmul`). Weight and
    bias are buffers, as in :class:`_UpcastEmbedding`, so the copy's ``dtype`` stays float32; it is
    an ``nn.Linear`` for code that reads a head's ``weight`` (a head left out of int8 by ``keep_float``).

    Takes float32 ``[..., in_features]``, returns float32 ``[..., out_features]``.
    """

    def __init__(self, layer: torch.nn.Linear) -> None:
        torch.nn.Module.__init__(self)  # not nn.Linear's: it would allocate a weight parameter
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.register_buffer("weight", layer.weight.detach())  # shared with ``layer``: a tied table stays tied
        self.register_buffer("bias", layer.bias.detach() if layer.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


def int8_float_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype :func:`quantize_int8` keeps the layers it leaves out of int8 in (``down_proj``, a
    kept head) when not told: bfloat16 for a bfloat16 ``model`` on a CPU that multiplies bfloat16
    natively (half float32's bytes, no prepacked float32 copy, the weights as loaded), else float32
    (through oneDNN's few-row path).

    Measured on the default draft, AMD EPYC with AVX512-BF16 (``lab/scripts/bench_cpu_paths.py --role
    draft --paths int8,int8+float32``, interleaved; lab/notebook/2026-11-25-lean-int8-draft.md):
    passes over 1 / 5 / 9 / 17 tokens within noise of each other (43 / 51 / 65 / 88 ms against
    42 / 47 / 64 / 93 ms), 871 MB against 1,499 MB.
    """
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return torch.bfloat16 if dtypes == {torch.bfloat16} and native_bf16_matmul() else torch.float32


def _replace(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, module)


def _exact_in_bfloat16(weight: torch.Tensor) -> bool:
    """Whether a float32 ``weight`` holds only bfloat16 values (e.g. loaded from bfloat16 files)."""
    return bool(torch.equal(weight, weight.to(torch.bfloat16).float()))


def quantize_int8(
    model: torch.nn.Module,
    keep_float: Sequence[str] = INT8_KEEP_FLOAT,
    float_dtype: torch.dtype | None = None,
) -> torch.nn.Module:
    """A copy of ``model`` whose ``nn.Linear`` layers compute in dynamic int8 (see the module docstring).

    The copy computes in float32 and takes and returns float32 activations; ``model`` is not
    modified. Layers are quantized one at a time from the source (no whole float32 copy of the
    model is made). What stays out of int8:

    - the layers named by ``keep_float``, in ``float_dtype``:
      float32 layers keep (or get) the oneDNN few-row path of
      :func:`~specdecode.models.torch.cpu.use_onednn_linears`; bfloat16 layers cast their input to
      bfloat16 and their output back to float32;
    - the input embedding: a bfloat16 / float16 table stays in its dtype and is looked up into
      float32 (exact), and so does a float32 table whose values are all bfloat16 values (a draft
      loaded in float32 from bfloat16 files); a table tied to a head kept in float32 stays float32;
    - norms and the other small tensors, in float32.

    Args:
        model: a causal LM (or any module) on the CPU.
        keep_float: name suffixes of linear layers to leave out of int8 (default ``("down_proj",)``;
            add ``"lm_head"`` to keep a head whose float weight a caller reads; an int8 draft's
            reduced head over a token map needs none: it takes rows of the int8 head, :func:`int8_rows`).
        float_dtype: ``torch.float32`` or ``torch.bfloat16`` for the layers left out of int8; None
            picks :func:`int8_float_dtype` (bfloat16 only for a bfloat16 model where the CPU
            multiplies bfloat16 natively).

    Returns:
        The quantized copy, in eval mode.

    Raises:
        ValueError: ``model`` has parameters off the CPU (no CUDA kernel), no linear layer to
            quantize, or ``float_dtype`` is neither float32 nor bfloat16.
    """
    devices = {p.device.type for p in model.parameters()}
    if devices - {"cpu"}:
        raise ValueError(f"draft_quantization='int8' runs on the CPU only; the draft is on {sorted(devices)}")
    if float_dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"float_dtype must be torch.float32, torch.bfloat16 or None, got {float_dtype!r}")
    kept_dtype = float_dtype or int8_float_dtype(model)
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not any(name == s or name.endswith("." + s) for s in keep_float)
    ]
    if not names:
        raise ValueError("draft_quantization='int8': the draft has no linear layer left to quantize")
    from transformers import PreTrainedModel  # here, not at import: the llama.cpp path never loads transformers' models

    work = copy.deepcopy(model)  # in the source's dtype
    with torch.no_grad():
        for name in names:
            _replace(work, name, int8_linear(work.get_submodule(name)))
        for name, module in list(work.named_modules()):
            if type(module) is torch.nn.Linear and module.weight.dtype == kept_dtype == torch.bfloat16:
                _replace(work, name, _CastLinear(module))
        float_weights = {m.weight.untyped_storage().data_ptr() for m in work.modules() if type(m) is torch.nn.Linear}
        embedding = work.get_input_embeddings() if isinstance(work, PreTrainedModel) else None
        if (
            type(embedding) is torch.nn.Embedding
            and embedding.weight.untyped_storage().data_ptr() not in float_weights
            and (embedding.weight.dtype != torch.float32 or _exact_in_bfloat16(embedding.weight))
        ):
            table = embedding.weight if embedding.weight.dtype != torch.float32 else embedding.weight.bfloat16()
            work.set_input_embeddings(_UpcastEmbedding(table, embedding.padding_idx))
        for module in work.modules():  # the rest in float32
            if isinstance(module, _UpcastEmbedding | _CastLinear):
                continue
            for param in module._parameters.values():
                if param is not None and param.is_floating_point() and param.dtype != torch.float32:
                    param.data = param.data.float()
            for key, buffer in module._buffers.items():
                if buffer is not None and buffer.is_floating_point() and buffer.dtype != torch.float32:
                    module._buffers[key] = buffer.float()
    use_onednn_linears(work)
    return work.eval()


def int8_linear(layer: torch.nn.Linear) -> torch.nn.Module:
    """A dynamic int8 copy of one float ``nn.Linear`` (the quantization of :func:`quantize_int8`:
    int8 weights with one scale per output row, activations quantized per call), the layer by
    layer step of :func:`quantize_int8`. Takes and returns float32 ``[..., in_features]`` ->
    ``[..., out_features]``; ``layer`` is not modified.

    Raises:
        ValueError: ``layer`` is not an ``nn.Linear`` on the CPU.
    """
    if not isinstance(layer, torch.nn.Linear) or layer.weight.device.type != "cpu":
        raise ValueError(f"int8_linear needs an nn.Linear on the CPU, got {type(layer).__name__}")
    work = copy.deepcopy(layer).float()
    work.qconfig = torch.ao.quantization.per_channel_dynamic_qconfig  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.nn.quantized.dynamic.Linear.from_float(work).eval()


def int8_rows(layer: torch.nn.Module, rows: torch.Tensor) -> torch.nn.Module:
    """A dynamic int8 linear made of the output rows ``rows`` of the dynamic int8 linear ``layer``
    (the reduced LM head of an int8 draft over a token map: FR-Spec's head, then int8, both
    savings). With one scale and zero point per output row, these rows are exactly what
    :func:`int8_linear` makes of the same rows of the float layer. Takes and returns float32
    ``[..., in_features]`` -> ``[..., len(rows)]``; ``layer`` is not modified.

    Raises:
        ValueError: ``layer`` is not a per-channel dynamic int8 linear, or ``rows`` is not a
            non-empty 1-D tensor of ids in ``[0, out_features)``.
    """
    dynamic = torch.ao.nn.quantized.dynamic.Linear
    weight = layer.weight() if isinstance(layer, dynamic) else None
    if weight is None or weight.qscheme() not in (torch.per_channel_affine, torch.per_channel_symmetric):
        raise ValueError(f"int8_rows needs a per-channel dynamic int8 linear, got {type(layer).__name__}")
    ids = torch.as_tensor(rows).to("cpu", torch.int64)
    if ids.dim() != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= layer.out_features:
        raise ValueError(f"int8_rows: rows must be a 1-D tensor of ids in [0, {layer.out_features})")
    if weight.q_per_channel_axis() != 0:
        raise ValueError("int8_rows needs weight scales per output row (axis 0)")
    picked = torch._make_per_channel_quantized_tensor(
        weight.int_repr()[ids].contiguous(),
        weight.q_per_channel_scales()[ids].contiguous(),
        weight.q_per_channel_zero_points()[ids].contiguous(),
        0,
    )  # (N, in): the same int8 values and scales
    bias = layer.bias()
    out = dynamic(layer.in_features, ids.numel(), bias_=bias is not None, dtype=torch.qint8)
    out.set_weight_bias(picked, bias[ids].contiguous() if bias is not None else None)
    return out.eval()


def shared_int8_copy(model: torch.nn.Module) -> torch.nn.Module:
    """:func:`quantize_int8` of ``model`` with the default settings, made once per model and then
    shared (while ``model`` lives): a server builds a proposer per request, and each would
    otherwise copy and quantize the draft. The copy holds weights only; every proposer keeps its
    own cache. For token trees the copy inherits the float model's attention-mask check
    (:meth:`~specdecode.models.torch.runner.ModelRunner.share_masking_check`), run here once.
    Same errors as :func:`quantize_int8`."""
    from transformers import PreTrainedModel

    from specdecode.models.torch.runner import ModelRunner

    with _SHARED_LOCK:
        if model not in _SHARED:
            _SHARED[model] = quantize_int8(model)
            if isinstance(model, PreTrainedModel):
                ModelRunner(model).share_masking_check(_SHARED[model])
        return _SHARED[model]


def shared_int8_head(model: torch.nn.Module, head_ids: torch.Tensor) -> torch.nn.Module:
    """:func:`int8_rows` of the int8 LM head of ``model``'s shared int8 copy
    (:func:`shared_int8_copy`) at ``head_ids``, made once per ``model`` and ``head_ids`` and then
    shared while ``model`` lives. Same errors as :func:`int8_rows`."""
    key = torch.as_tensor(head_ids).to("cpu", torch.int64).numpy().tobytes()
    copy = shared_int8_copy(model)
    with _SHARED_LOCK:
        heads = _SHARED_HEADS.setdefault(model, {})
        if key not in heads:
            heads[key] = int8_rows(copy.get_output_embeddings(), torch.as_tensor(head_ids))
        return heads[key]


def count_int8_linears(model: torch.nn.Module) -> int:
    """How many dynamic int8 linear layers ``model`` has (0 for a float model)."""
    dynamic = torch.ao.nn.quantized.dynamic.Linear
    return sum(isinstance(m, dynamic) for m in model.modules())
