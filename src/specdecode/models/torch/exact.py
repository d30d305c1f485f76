"""Exact passes on torch's CPU path: every row of a W-token pass equals a one-token pass, bit for bit.

Speculative decoding scores ``k + 1`` tokens in one pass; plain decoding scores one. Greedy output
is the target's own token for token only when every row of the wide pass is what the one-token
pass computes, bit for bit (docs/design.md §6 rule 8). In bfloat16 on a CPU two kernels break that
(measured with the default target on an AMD EPYC with AVX512-BF16, ``lab/exact_bf16.py``):

- **linear layers**: PyTorch multiplies one row by a matrix-vector kernel and 2+ rows by oneDNN's
  matrix product, which sums in another order. Every row of a product of 2 to 65 rows equals the
  same row multiplied alone *as two rows* (each layer shape of the default target, 1 and 2
  threads). So a one-row call is computed as two equal rows and the first kept
  (:mod:`specdecode.models.torch.one_row_linear`'s padding, here on for good);
- **attention**: ``scaled_dot_product_attention`` over W query rows rounds a row differently from
  the same row over its own keys alone (the CPU kernel blocks its work by the query count and the
  key count). So :func:`row_attention` runs it once per query row, over exactly the keys that row
  attends (a prefix of the cache for a chain, the cached prefix and the branch for a tree node), as
  the one-token pass does.

Every other step of a decoder layer (embedding, RMSNorm per row, rotary embedding, SiLU, residual
adds) computes each row alone already. With both changes the default target's rows are equal to
one-token passes at every width 1..33 (561 of 561 rows, bf16), where stock passes match in none
beyond width 1. Elementwise kernels process a tensor's last partial vector with scalar code, so a
model whose per-row sizes (hidden, intermediate, head dimension) are not multiples of 32 values may
still round a few rows differently; every model of the default pair's family has such sizes.

:func:`use_exact_passes` marks a model (``exact=True`` at load, the default on the CPU in bf16 and
fp16, :func:`wants_exact_passes`): its attention implementation becomes :data:`ROW_ATTENTION`
(registered with ``transformers``) and its one-row linear calls are padded, for every runner made
of it, one-token passes included, so both sides of the identity run the same code. CUDA devices
take another design: a fixed pass width (:mod:`specdecode.models.torch.static_runner`).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specdecode.models.torch.one_row_linear import pad_linear_rows

ROW_ATTENTION = "specdecode_rows"
"""The name :func:`row_attention` is registered under in ``transformers``' attention interfaces."""

MASKED_ATTENTIONS = ("sdpa", "eager", ROW_ATTENTION)
"""Attention implementations that honour a ready-made 4D mask (trees, static and batched caches)."""

EXACT_DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes exact mode changes passes for; float32 runs as it is (docs/usage.md#exactness)."""

_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa in scaled_dot_product_attention


def row_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention computed one query row at a time, each over exactly the keys it attends
    (``transformers``' attention-interface signature; no dropout: inference only).

    Row i of batch b attends the keys ``attention_mask[b, 0, i]`` allows (bool: True; additive:
    0), or with no mask the causal prefix ``key[:, :, : L - W + i + 1]``. A row whose keys are a
    prefix reads a view of the cache; another (a tree node) reads a gathered copy of its keys, the
    same values in the same order as the cache holds them when its branch is decoded token by token.

    A pass with no cached keys before it (``L == W``: a prompt's prefill, which plain and speculative
    decoding share) runs as ``transformers``' sdpa attention, in one call: row by row, a long
    prompt's prefill would make ``L`` calls per layer. The rows run on one thread: each is little
    work, and on a CPU shared with other processes a thread team per call waits for its descheduled
    members (a 9-token pass of the default target took 6.8 s with two threads per row, 4.0 s with
    one, on the project's busy 2-core machine).

    Args:
        module: the attention layer (unused; part of the interface).
        query: ``[B, H, W, D]``.
        key, value: ``[B, H_kv, L, D]`` (``H`` a multiple of ``H_kv``).
        attention_mask: bool or additive ``[B or 1, 1, W, L]``, or None (causal, aligned to the end).
        scaling: the softmax scale (None: ``D ** -0.5``).

    Returns:
        ``([B, W, H, D], None)``: the output in the query's dtype, no attention weights.

    Source: ``transformers.integrations.sdpa_attention.sdpa_attention_forward``, one row per call.
    """
    B, H, W, _ = query.shape
    L = key.shape[2]
    if L == W:  # a sequence's first pass (its prompt): no one-token pass to equal, both sides share it
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    group = H // key.shape[1]
    if group > 1 and not _GQA:
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)  # (B, H, L, D)
    gqa = {"enable_gqa": True} if group > 1 and _GQA else {}
    spans = _key_spans(attention_mask, B, W, L)
    out = query.new_empty(B, W, H, value.shape[-1])  # (B, W, H, D)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one row is little work: no thread team per call (on a busy CPU, a wait each)
    try:
        for b in range(B):
            for i in range(W):
                span = spans[b][i] if spans is not None else L - W + i + 1
                if isinstance(span, int):  # a prefix: a view
                    k, v = key[b : b + 1, :, :span], value[b : b + 1, :, :span]  # (1, H_kv, n, D)
                else:  # gathered keys of a tree node
                    k, v = key[b : b + 1, :, span], value[b : b + 1, :, span]
                row = F.scaled_dot_product_attention(query[b : b + 1, :, i : i + 1], k, v, scale=scaling, **gqa)
                out[b, i] = row[0, :, 0]  # (H, D)
    finally:
        torch.set_num_threads(threads)
    return out, None


def _key_spans(mask: torch.Tensor | None, B: int, W: int, L: int) -> list[list[int | torch.Tensor]] | None:
    """Per batch and query row, what it attends: an int n (the prefix ``[0, n)``) or int64 indices
    on the keys' device; None without a mask (causal prefixes)."""
    if mask is None:
        return None
    allowed = mask if mask.dtype == torch.bool else mask == 0
    allowed = allowed[:, 0].expand(B, W, L).cpu()  # (B, W, L): one host copy per layer call
    counts = allowed.sum(-1)  # (B, W)
    prefix = allowed.int().cummin(-1).values.sum(-1) == counts  # (B, W): no allowed key after the first masked one
    spans: list[list[int | torch.Tensor]] = []
    for b in range(B):
        row: list[int | torch.Tensor] = []
        for i, (n, is_prefix) in enumerate(zip(counts[b].tolist(), prefix[b].tolist(), strict=True)):
            row.append(n if is_prefix else allowed[b, i].nonzero().flatten().to(mask.device))
        spans.append(row)
    return spans


def _register() -> None:
    """Register :func:`row_attention` (with sdpa's mask function) in ``transformers``; idempotent."""
    ALL_ATTENTION_FUNCTIONS.register(ROW_ATTENTION, row_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ROW_ATTENTION, sdpa_mask)


_MARKED: weakref.WeakKeyDictionary[PreTrainedModel, tuple[str | None, list]] = weakref.WeakKeyDictionary()


def wants_exact_passes(model: PreTrainedModel) -> bool:
    """Whether exact mode changes ``model``'s passes: on the CPU, in bfloat16 or float16."""
    return model.device.type == "cpu" and model.dtype in EXACT_DTYPES


def use_exact_passes(model: PreTrainedModel) -> PreTrainedModel:
    """Mark ``model`` for exact passes (module docstring): :data:`ROW_ATTENTION` attention, one-row
    linear calls padded to two rows. Idempotent; returns ``model``.

    Raises:
        ValueError: an attention implementation other than sdpa / eager (flash attention reads no
            custom masks), or sliding-window layers.
    """
    if model in _MARKED:
        return model
    config = model.config
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"exact passes need sdpa or eager attention; {type(model).__name__} uses {attention!r}")
    if getattr(config, "use_sliding_window", False):
        raise ValueError(f"exact passes: {type(model).__name__} has sliding-window layers; not supported")
    _register()
    handles = pad_linear_rows(model)
    config._attn_implementation = ROW_ATTENTION
    _MARKED[model] = (attention, handles)
    return model


def forget_exact_passes(model: PreTrainedModel) -> None:
    """Undo :func:`use_exact_passes` (the attention implementation back, the padding hooks removed)."""
    marked = _MARKED.pop(model, None)
    if marked is None:
        return
    attention, handles = marked
    for handle in handles:
        handle.remove()
    model.config._attn_implementation = attention


def exact_passes(model: object) -> bool:
    """Whether :func:`use_exact_passes` marked ``model``."""
    try:
        return model in _MARKED
    except TypeError:  # not weak-referenceable: never marked
        return False
