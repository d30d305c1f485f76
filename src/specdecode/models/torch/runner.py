"""A causal language model with a KV cache that rolls back by truncation (batch 1)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import replace

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from specdecode.models.contract import RunnerCapabilities
from specdecode.models.first_pass import FirstPass
from specdecode.models.torch.compat import cache_kwargs
from specdecode.models.torch.cpu import use_onednn_linears
from specdecode.models.torch.exact import MASKED_ATTENTIONS, exact_passes

# Config attributes of models whose logits are not plain ``lm_head(hidden states)`` (soft-capping in
# Gemma 2/3, ``logit_scale`` in Cohere, ``logits_scaling`` in Granite), with their neutral values:
# a reduced head (``head_ids``) does not reproduce them and refuses such a model.
LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}

# Models checked to honour custom 4D attention masks and position ids (see ModelRunner.check_masking).
_MASKING_OK: weakref.WeakKeyDictionary[PreTrainedModel, bool] = weakref.WeakKeyDictionary()
# Models checked to compute their logits as lm_head(get_decoder() hidden states) (head_ids, return_hidden).
_PLAIN_OK: weakref.WeakKeyDictionary[PreTrainedModel, bool] = weakref.WeakKeyDictionary()


def _check_plain_head(model: PreTrainedModel, what: str = "head_ids") -> None:
    """Raise ValueError (naming ``what``, the option that needs it) unless ``model``'s logits are
    ``lm_head(final hidden states)``."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name, neutral in LOGIT_TRANSFORMS.items():
        value = getattr(config, name, neutral)
        if value is not None and value != neutral:
            raise ValueError(
                f"{what}: {type(model).__name__} transforms its logits ({name}={value!r}); "
                "plain lm_head(hidden states) does not reproduce that"
            )
    if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        raise ValueError(f"{what}: the output head of {type(model).__name__} is not a Linear layer")


def check_decoder_logits(model: PreTrainedModel, what: str) -> None:
    """Check once per model that its logits are ``lm_head(get_decoder() last_hidden_state)``:
    the config check of :func:`_check_plain_head`, then a one-token probe comparing the two (a
    model whose forward is not decoder + head would otherwise go unnoticed). Needed by a reduced
    head (``head_ids``) and by ``return_hidden``; ``what`` names the option in the message.

    Raises:
        ValueError: they are not (logit soft-capping or scaling, a forward that is not decoder + head).
    """
    if _PLAIN_OK.get(model):
        return
    _check_plain_head(model, what)
    with torch.inference_mode():
        probe = torch.zeros(1, 1, dtype=torch.int64, device=model.device)
        full = model(input_ids=probe, use_cache=False).logits[0, -1].float()  # (V,)
        hidden = model.get_decoder()(input_ids=probe, use_cache=False).last_hidden_state  # (1, 1, H)
        head = model.get_output_embeddings()  # its weights, not its forward: hooks may rescale the output
        mine = F.linear(hidden.to(head.weight.dtype), head.weight, head.bias)[0, -1].float()  # (V,)
    if not torch.allclose(mine, full, rtol=0.0, atol=1e-2 * (1.0 + float(full.abs().max()))):
        raise ValueError(
            f"{what}: the logits of {type(model).__name__} are not lm_head(get_decoder() hidden states) "
            "(logit scaling or soft-capping?); plain lm_head(hidden states) cannot reproduce them"
        )
    _PLAIN_OK[model] = True


def share_plain_check(model: PreTrainedModel, copy: PreTrainedModel, what: str) -> None:
    """:func:`check_decoder_logits` on ``model``, counted as passed for ``copy`` too: a copy with
    the same forward whose linear layers were quantized (:func:`specdecode.models.torch.quant.quantize_int8`),
    whose int8 head has no float ``weight`` to run the check with. Same errors."""
    check_decoder_logits(model, what)
    _PLAIN_OK[copy] = True


class ModelRunner:
    """Runs a Hugging Face causal LM one sequence at a time, keeping its KV cache between calls.

    The cache always holds the first :attr:`length` tokens of the sequence. :meth:`forward`
    appends tokens; :meth:`truncate` drops the newest ones (rollback after a rejected draft),
    never re-running a prefill.

    Devices (the runner contract's device policy, docs/design.md §2b): :attr:`device` is where
    the logits (and hidden states) come back, the model's device. Every input (ids, positions,
    masks, ``keep``) may be given on the CPU: the runner moves it to :attr:`device` itself; the
    logits are not copied back.

    With ``head_ids`` the runner scores only those rows of the output head (a reduced LM head,
    FR-Spec, Zhao et al. 2025, arXiv 2502.14856): it runs the decoder (``model.get_decoder()``,
    hidden states after the final norm) and multiplies by ``lm_head.weight[head_ids]``, a slice
    copied once here in the head's dtype into :attr:`head_module` (an ``nn.Linear`` ``H -> N``,
    which a caller may replace by an equivalent module, e.g. an int8 copy for a quantized draft:
    :func:`specdecode.models.torch.quant.int8_linear`); the model itself is not modified.

    Args:
        model: a ``transformers`` causal LM (``Qwen2ForCausalLM``, ``LlamaForCausalLM``, ...).
        head_ids: int64 ``[N]`` distinct token ids in ``[0, vocab_size)``, or None (the full head).
        head_module: the reduced head itself (``H -> N``, the rows ``head_ids`` of the model's
            head), made by the caller, e.g. rows of an int8 head
            (:func:`specdecode.models.torch.quant.int8_rows`); None copies the rows here.

    Raises:
        ValueError: bad ``head_ids``, ``head_module`` without ``head_ids``, or a model whose
            logits are not plain ``lm_head(hidden states)`` (logit soft-capping or scaling, or a
            forward that does not use ``get_decoder()``), which a reduced head would not reproduce.
    """

    capabilities = RunnerCapabilities(
        backend="torch", returns_hidden=True, trees=True, reduced_head=True, model_insides=True, prompt_reuse=True
    )
    """The runner contract's capabilities (:class:`~specdecode.models.contract.RunnerCapabilities`):
    features, trees, a reduced head, the model's insides, prompt reuse (:meth:`restart`); one pass
    scores every row (no greedy
    hints). Batch-invariant bit for bit only for a model marked for exact passes
    (:func:`~specdecode.models.torch.exact.use_exact_passes`): then an instance declares it."""

    def __init__(
        self, model: PreTrainedModel, head_ids: torch.Tensor | None = None, head_module: torch.nn.Module | None = None
    ) -> None:
        self.model = model.eval()
        if exact_passes(model):  # every row of a pass is what a one-token pass computes
            self.capabilities = replace(type(self).capabilities, batch_invariant=True)
        self.cache = DynamicCache(config=model.config)
        self.length = 0
        self._first: FirstPass | None = None  # the sequence's first pass (by restart) while the cache holds it
        self.reused_prompt = False  # the last restart answered from the kept first pass
        self.cached_tokens = 0  # prompt tokens the last restart did not feed (its whole prompt, or 0)
        self.head_ids: torch.Tensor | None = None  # int64 [N] on the model's device, or None
        if head_module is not None and head_ids is None:
            raise ValueError("head_module needs head_ids (the token ids of its rows)")
        if head_ids is not None:
            self._init_head(head_ids, head_module)

    def _init_head(self, head_ids: torch.Tensor, head_module: torch.nn.Module | None) -> None:
        V = self.vocab_size
        ids = torch.as_tensor(head_ids)
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise ValueError(f"head_ids must be a non-empty 1-D integer tensor, got {ids.dtype} {list(ids.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= V or ids.unique().numel() != ids.numel():
            raise ValueError(
                f"head_ids must be distinct ids in [0, {V}), got min {int(ids.min())}, max {int(ids.max())}"
            )
        check_decoder_logits(self.model, "head_ids")
        self.head_ids = ids.to(device=self.device, dtype=torch.int64)  # (N,)
        if head_module is not None:
            self.head_module = head_module.eval()
            return
        head = self.model.get_output_embeddings()
        weight = head.weight.detach()[self.head_ids].contiguous()  # (N, H): a copy
        reduced = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=head.bias is not None, device="meta")
        reduced.weight = torch.nn.Parameter(weight, requires_grad=False)
        if head.bias is not None:
            reduced.bias = torch.nn.Parameter(head.bias.detach()[self.head_ids].contiguous(), requires_grad=False)
        use_onednn_linears(reduced)  # float32 CPU: the few-row path the model's own layers take
        self.head_module: torch.nn.Module = reduced.eval()

    @property
    def device(self) -> torch.device:
        """Where the logits and hidden states live: the model's device (the contract's device)."""
        return self.model.device

    @property
    def dtype(self) -> str:
        """The model's dtype without the ``torch.`` prefix (``"bfloat16"``), for records."""
        return str(self.model.dtype).removeprefix("torch.")

    @property
    def vocab_size(self) -> int:
        """Rows of the full output head (the vocabulary), the size of the logits' last dimension
        unless :attr:`head_ids` is set (then it is ``len(head_ids)``)."""
        head = self.model.get_output_embeddings()
        rows = getattr(head, "out_features", None)  # also set on a quantized head, whose weight is a method
        return int(rows) if rows is not None else int(head.weight.shape[0])

    @property
    def max_length(self) -> int:
        """Longest sequence the model takes (``max_position_embeddings``)."""
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    def reset(self) -> None:
        """Forget the whole sequence (its first pass included: :meth:`restart` runs it again)."""
        self.cache = DynamicCache(config=self.model.config)
        self.length = 0
        self._first = None

    def restart(
        self, input_ids: torch.Tensor, num_logits: int = 1, return_hidden: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """A new sequence's first pass over ``input_ids``: :meth:`reset` then :meth:`forward`, or,
        when the current sequence began with a restart of these arguments and the cache still holds
        its entries, the cache cut back to them and that pass's rows returned again, with
        no pass run (:mod:`specdecode.models.first_pass`: exact bit for bit). :attr:`reused_prompt`
        says which.

        Args and returns: those of :meth:`forward`.
        """
        ids = [int(i) for i in input_ids.reshape(-1).tolist()]
        kept = self._first.answer(ids, num_logits, return_hidden) if self._first is not None else None
        self.reused_prompt = kept is not None
        self.cached_tokens = len(ids) if kept is not None else 0
        if kept is None:
            self.reset()
            out = self.forward(input_ids, num_logits, return_hidden)
            self._first = FirstPass.keep(ids, num_logits, out)
            return out
        self.truncate(len(ids))
        return kept

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        num_logits: int = 1,
        return_hidden: bool = False,
        greedy_draft: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append ``input_ids`` to the sequence and return the logits of its last positions.

        Args:
            input_ids: int64 ``[T]``, T >= 1, the tokens after the :attr:`length` cached ones (any
                device, usually the CPU: moved to :attr:`device` here).
            num_logits: how many of the last positions to score (1 <= num_logits <= T).
            return_hidden: also return the target's *features*: the decoder's final hidden states
                (``model.get_decoder()`` ``last_hidden_state``, after the final norm, what the LM
                head reads) of all T tokens. The logits are then ``lm_head`` of their last
                ``num_logits`` rows, what the model's own forward computes.
            greedy_draft: the runner contract's hint for a greedy verification pass (the drafted
                tokens, ``input_ids[1:]``): a runner that splits the pass may stop after the first
                part whose argmax disagrees with them and return fewer rows
                (:meth:`specdecode.models.llamacpp.LlamaCppRunner.forward`). Unused here: one pass
                scores every row.

        Returns:
            float32 ``[num_logits, V]`` logits on :attr:`device`; row i scores the token that follows
            ``input_ids[T - num_logits + i]``. With :attr:`head_ids`, ``[num_logits, N]``: column j
            scores token ``head_ids[j]``. With ``return_hidden``: ``(logits, hidden)``, hidden
            ``[T, H]`` in the model's dtype, row i the feature of ``input_ids[i]``.

        Raises:
            ValueError: ``num_logits`` out of range; with ``return_hidden``, a model whose logits
                are not plain ``lm_head(hidden states)`` (soft-capping, scaling; checked once).
        """
        T = input_ids.shape[0]
        if not 1 <= num_logits <= T:
            raise ValueError(f"num_logits must be in [1, {T}], got {num_logits}")
        ids = input_ids.view(1, T).to(self.device)  # (1, T)
        if self.head_ids is not None or return_hidden:
            if return_hidden:
                check_decoder_logits(self.model, "return_hidden")
            decoder = self.model.get_decoder()
            hidden = decoder(
                input_ids=ids, **cache_kwargs(decoder, self.cache), use_cache=True
            ).last_hidden_state  # (1, T, H)
            self.length += T
            logits = self._head(hidden[:, -num_logits:])[0]  # (num_logits, V) or (num_logits, N)
            return (logits, hidden[0]) if return_hidden else logits
        out = self.model(
            input_ids=ids, **cache_kwargs(self.model, self.cache), use_cache=True, logits_to_keep=num_logits
        )
        self.length += T
        return out.logits[0, -num_logits:].float()  # (num_logits, V)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of features ``[..., H]``: the reduced head over :attr:`head_ids` (``[..., N]``),
        else the model's own output head, called as its forward calls it (``[..., V]``)."""
        if self.head_ids is not None:
            return self.head_module(hidden).float()
        return self.model.get_output_embeddings()(hidden).float()

    def prepare_widths(self, widths: Iterable[int]) -> None:
        """Nothing to prepare: eager passes (the runner contract's hook for runners that capture
        CUDA graphs, :class:`~specdecode.models.torch.static_runner.StaticCacheRunner`)."""

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` cached tokens (rollback).

        Raises:
            ValueError: ``length`` is negative or longer than the cached sequence.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate length must be in [0, {self.length}], got {length}")
        if length < self.length:
            # crop(-n) removes n tokens in every transformers version (>= 4.36 and 5.x)
            self.cache.crop(length - self.length)
            self.length = length
            if self._first is not None and length < self._first.length:
                self._first = None  # its entries are gone

    # ------------------------------------------------------------------ token trees
    @torch.inference_mode()
    def forward_masked(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attend: torch.Tensor,
        num_logits: int | None = None,
        return_hidden: bool = False,
        greedy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append ``input_ids`` with explicit positions and attention (token trees).

        The new tokens are written to the cache after the :attr:`length` cached ones, as
        :meth:`forward` does, but token i gets rotary position ``position_ids[i]`` and attends
        exactly to the cache entries where ``attend[i]`` is true (a 4D additive mask given to the
        model ready-made, so that ``transformers`` builds no causal mask of its own).

        Args:
            input_ids: int64 ``[M]``, M >= 1 (any device; moved to :attr:`device`, as the two below).
            position_ids: int64 ``[M]``, each token's position in its sequence.
            attend: bool ``[M, length + M]``: which cache entries (old and new) token i sees; it
                must see itself.
            num_logits: score the last this many tokens (default all M).
            return_hidden: also return the features of all M tokens (see :meth:`forward`).
            greedy: the runner contract's hint for greedy tree verification: a runner that walks the
                tree may decode only the nodes the greedy walk reaches and leave the other rows NaN
                (:meth:`specdecode.models.llamacpp.LlamaCppRunner.forward_masked`). Unused here:
                one pass scores every node.

        Returns:
            float32 ``[num_logits, V]`` on :attr:`device` (``[num_logits, N]`` with :attr:`head_ids`); with
            ``return_hidden``, ``(logits, hidden [M, H])``.

        Raises:
            ValueError: bad shapes, or a model with sliding-window layers or an attention other
                than sdpa / eager (custom masks are not supported there); with ``return_hidden``,
                a model whose logits are not plain ``lm_head(hidden states)``.
            NotImplementedError: the model ignores custom masks or position ids
                (:meth:`check_masking`).
        """
        M = int(input_ids.shape[0])
        L = self.length + M
        num_logits = M if num_logits is None else num_logits
        if (
            position_ids.shape != (M,)
            or attend.shape != (M, L)
            or attend.dtype != torch.bool
            or not 1 <= num_logits <= M
        ):
            raise ValueError(
                f"forward_masked: need input_ids [M], position_ids [M], bool attend [M, {self.length} + M] and "
                f"1 <= num_logits <= M; got {list(input_ids.shape)}, {list(position_ids.shape)}, "
                f"{attend.dtype} {list(attend.shape)}, {num_logits}"
            )
        self.check_masking()
        if return_hidden:
            check_decoder_logits(self.model, "return_hidden")
        kwargs = self._masked_inputs(input_ids, position_ids, attend, self.cache)
        self.length += M
        if self.head_ids is not None or return_hidden:
            hidden = self.model.get_decoder()(**kwargs).last_hidden_state  # (1, M, H)
            logits = self._head(hidden[:, -num_logits:])[0]  # (num_logits, V) or (num_logits, N)
            return (logits, hidden[0]) if return_hidden else logits
        return self.model(**kwargs, logits_to_keep=num_logits).logits[0, -num_logits:].float()  # (num_logits, V)

    def _masked_inputs(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attend: torch.Tensor, cache: DynamicCache
    ) -> dict:
        """Model keyword arguments for :meth:`forward_masked`: ids, positions, a ready-made 4D additive
        mask, all on the model's device (``attend`` moves as bool; the float mask is built there)."""
        M = int(input_ids.shape[0])
        dtype, device = self.model.dtype, self.device
        allowed = attend.to(device)  # (M, L) bool
        mask = torch.zeros(attend.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
        return dict(
            input_ids=input_ids.view(1, M).to(device),  # (1, M)
            position_ids=position_ids.view(1, M).to(device),  # (1, M)
            attention_mask={"full_attention": mask.view(1, 1, *attend.shape)},  # (1, 1, M, L)
            **cache_kwargs(self.model, cache),
            use_cache=True,
        )

    def check_masking(self) -> None:
        """Check once per model that it honours a custom 4D mask and position ids.

        Runs a 3-token prefix and a 4-node tree (two branches) with :meth:`forward_masked` on a
        scratch cache and compares each node's logits with a plain causal pass over its own root
        path; a model that ignores the mask (a sibling would leak in) or the positions fails.

        Raises:
            ValueError: sliding-window layers or an attention implementation other than sdpa / eager.
            NotImplementedError: the logits differ beyond rounding (tolerance ``1e-3`` of the logit
                scale in float32, ``5e-2`` in 16-bit types).
        """
        if _MASKING_OK.get(self.model):
            return
        config = self.model.config
        name = type(self.model).__name__
        types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if types != {"full_attention"} or getattr(config, "use_sliding_window", False):
            raise ValueError(
                f"token trees: {name} has sliding-window or non-standard layers {sorted(types)}; not supported"
            )
        attention = getattr(config, "_attn_implementation", None) or "eager"
        if attention not in MASKED_ATTENTIONS:
            raise ValueError(f"token trees need sdpa or eager attention; {name} uses {attention!r}")
        V = self.vocab_size
        a, b, c, d, e, f = (torch.tensor([(7 + 13 * i) % V]) for i in range(6))
        with torch.inference_mode():
            scratch = DynamicCache(config=config)
            prefix = torch.cat([a, b]).view(1, 2).to(self.device)
            self.model(input_ids=prefix, **cache_kwargs(self.model, scratch), use_cache=True)
            # root c; nodes d (child of c), e (child of c), f (child of e); positions 2, 3, 3, 4
            attend = torch.tensor(
                [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0], [1, 1, 1, 0, 1, 1]], dtype=torch.bool
            )
            inputs = self._masked_inputs(torch.cat([c, d, e, f]), torch.tensor([2, 3, 3, 4]), attend, scratch)
            tree = self.model(**inputs).logits[0].float()  # (4, V): the full head, whatever head_ids is
            full = self.model(input_ids=torch.cat([a, b, c, e, f]).view(1, 5).to(self.device)).logits[0].float()
            left = self.model(input_ids=torch.cat([a, b, c, d]).view(1, 4).to(self.device)).logits[0, -1].float()
        reference = torch.stack([full[2], left, full[3], full[4]])  # (4, V)
        scale = 1.0 + float(reference.abs().max())
        tolerance = (1e-3 if self.model.dtype == torch.float32 else 5e-2) * scale
        error = float((tree - reference).abs().max())
        if error > tolerance:
            raise NotImplementedError(
                f"token trees: {name} does not honour a custom 4D attention mask and position_ids "
                f"(logits differ by {error:.3g} > {tolerance:.3g}); use a chain instead of --tree"
            )
        _MASKING_OK[self.model] = True

    def share_masking_check(self, copy: PreTrainedModel) -> None:
        """Run :meth:`check_masking` on this runner's model and, if it passes, count it as passed
        for ``copy`` too: a copy with the same attention code whose linear layers were quantized
        (:func:`specdecode.models.torch.quant.quantize_int8`). Its own check could not be read within
        rounding: dynamic int8 scales each call's activations as a whole, so the rows of a tree pass
        shift each other's numbers a little. Fails silently; the copy is then checked on first use.
        """
        try:
            self.check_masking()
        except (ValueError, NotImplementedError):
            return
        _MASKING_OK[copy] = True

    @torch.inference_mode()
    def compact(self, keep: torch.Tensor) -> None:
        """Keep the cached entries ``keep`` (ascending positions) and nothing after the first of them.

        After a tree pass, the accepted root path's entries are scattered among the tree's; this
        moves them, in order, to follow the prefix ``[0, keep[0])`` and truncates the rest.

        Args:
            keep: int64 ``[n]``, strictly increasing cache positions in ``[0, length)``, on the CPU.

        Raises:
            ValueError: ``keep`` is empty, not increasing, or out of range.
        """
        keep = torch.as_tensor(keep, dtype=torch.int64).cpu()  # its checks read it on the host
        n = int(keep.shape[0])
        if n == 0 or int(keep[0]) < 0 or int(keep[-1]) >= self.length or bool((keep[1:] <= keep[:-1]).any()):
            raise ValueError(f"keep must be increasing positions in [0, {self.length}), got {keep.tolist()}")
        start = int(keep[0])
        if self._first is not None and start < self._first.length:
            self._first = None  # entries of the first pass are overwritten
        if int(keep[-1]) - start + 1 != n:  # not already contiguous
            index = keep.to(self.device)
            for layer in self.cache.layers:
                layer.keys[..., start : start + n, :] = layer.keys[..., index, :]  # (B, H, n, D), gathered first
                layer.values[..., start : start + n, :] = layer.values[..., index, :]
        self.truncate(start + n)
