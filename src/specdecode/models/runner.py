"""A causal language model with a KV cache that rolls back by truncation (batch 1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

# Config attributes of models whose logits are not plain ``lm_head(hidden states)`` (soft-capping in
# Gemma 2/3, ``logit_scale`` in Cohere, ``logits_scaling`` in Granite), with their neutral values:
# a reduced head (``head_ids``) does not reproduce them and refuses such a model.
LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


def _check_plain_head(model: PreTrainedModel) -> None:
    """Raise ValueError unless ``model``'s logits are ``lm_head(final hidden states)``."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name, neutral in LOGIT_TRANSFORMS.items():
        value = getattr(config, name, neutral)
        if value is not None and value != neutral:
            raise ValueError(
                f"head_ids: {type(model).__name__} transforms its logits ({name}={value!r}); a reduced "
                "LM head computes plain lm_head(hidden states) and does not reproduce that"
            )
    if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        raise ValueError(f"head_ids: the output head of {type(model).__name__} is not a Linear layer")


class ModelRunner:
    """Runs a Hugging Face causal LM one sequence at a time, keeping its KV cache between calls.

    The cache always holds the first :attr:`length` tokens of the sequence. :meth:`forward`
    appends tokens; :meth:`truncate` drops the newest ones (rollback after a rejected draft),
    never re-running a prefill.

    With ``head_ids`` the runner scores only those rows of the output head (a reduced LM head,
    FR-Spec, Zhao et al. 2025, arXiv 2502.14856): it runs the decoder (``model.get_decoder()``,
    hidden states after the final norm) and multiplies by ``lm_head.weight[head_ids]``, a slice
    copied once here in the head's dtype; the model itself is not modified.

    Args:
        model: a ``transformers`` causal LM (``Qwen2ForCausalLM``, ``LlamaForCausalLM``, ...).
        head_ids: int64 ``[N]`` distinct token ids in ``[0, vocab_size)``, or None (the full head).

    Raises:
        ValueError: bad ``head_ids``, or a model whose logits are not plain ``lm_head(hidden
            states)`` (logit soft-capping or scaling, or a forward that does not use
            ``get_decoder()``), which a reduced head would not reproduce.
    """

    def __init__(self, model: PreTrainedModel, head_ids: torch.Tensor | None = None) -> None:
        self.model = model.eval()
        self.cache = DynamicCache(config=model.config)
        self.length = 0
        self.head_ids: torch.Tensor | None = None  # int64 [N] on the model's device, or None
        if head_ids is not None:
            self._init_head(head_ids)

    def _init_head(self, head_ids: torch.Tensor) -> None:
        V = self.vocab_size
        ids = torch.as_tensor(head_ids)
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise ValueError(f"head_ids must be a non-empty 1-D integer tensor, got {ids.dtype} {list(ids.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= V or ids.unique().numel() != ids.numel():
            raise ValueError(
                f"head_ids must be distinct ids in [0, {V}), got min {int(ids.min())}, max {int(ids.max())}"
            )
        _check_plain_head(self.model)
        head = self.model.get_output_embeddings()
        self.head_ids = ids.to(device=self.device, dtype=torch.int64)  # (N,)
        self._decoder = self.model.get_decoder()
        self._head_weight = head.weight.detach()[self.head_ids].contiguous()  # (N, H): a copy
        self._head_bias = None if head.bias is None else head.bias.detach()[self.head_ids].contiguous()  # (N,)
        with torch.inference_mode():  # a model whose forward is not decoder + head would go unnoticed
            probe = torch.zeros(1, 1, dtype=torch.int64, device=self.device)
            full = self.model(input_ids=probe, use_cache=False).logits[0, -1, self.head_ids].float()  # (N,)
            hidden = self._decoder(input_ids=probe, use_cache=False).last_hidden_state[0, -1]  # (H,)
            mine = F.linear(hidden, self._head_weight, self._head_bias).float()  # (N,)
        if not torch.allclose(mine, full, rtol=0.0, atol=1e-2 * (1.0 + float(full.abs().max()))):
            raise ValueError(
                f"head_ids: the logits of {type(self.model).__name__} are not lm_head(get_decoder() hidden "
                "states) (logit scaling or soft-capping?); a reduced LM head cannot reproduce them"
            )

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def vocab_size(self) -> int:
        """Rows of the full output head (the vocabulary), the size of the logits' last dimension
        unless :attr:`head_ids` is set (then it is ``len(head_ids)``)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_length(self) -> int:
        """Longest sequence the model takes (``max_position_embeddings``)."""
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    def reset(self) -> None:
        """Forget the whole sequence."""
        self.cache = DynamicCache(config=self.model.config)
        self.length = 0

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, num_logits: int = 1) -> torch.Tensor:
        """Append ``input_ids`` to the sequence and return the logits of its last positions.

        Args:
            input_ids: int64 ``[T]``, T >= 1, the tokens after the :attr:`length` cached ones.
            num_logits: how many of the last positions to score (1 <= num_logits <= T).

        Returns:
            float32 ``[num_logits, V]`` logits; row i scores the token that follows
            ``input_ids[T - num_logits + i]``. With :attr:`head_ids`, ``[num_logits, N]``: column j
            scores token ``head_ids[j]``.
        """
        T = input_ids.shape[0]
        if not 1 <= num_logits <= T:
            raise ValueError(f"num_logits must be in [1, {T}], got {num_logits}")
        if self.head_ids is not None:
            out = self._decoder(
                input_ids=input_ids.view(1, T).to(self.device), past_key_values=self.cache, use_cache=True
            )
            hidden = out.last_hidden_state[0, -num_logits:]  # (num_logits, H)
            self.length += T
            return F.linear(hidden, self._head_weight, self._head_bias).float()  # (num_logits, N)
        out = self.model(
            input_ids=input_ids.view(1, T).to(self.device),  # (1, T)
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=num_logits,
        )
        self.length += T
        return out.logits[0, -num_logits:].float()  # (num_logits, V)

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
