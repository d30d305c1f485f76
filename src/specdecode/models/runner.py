"""A causal language model with a KV cache that rolls back by truncation (batch 1)."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


class ModelRunner:
    """Runs a Hugging Face causal LM one sequence at a time, keeping its KV cache between calls.

    The cache always holds the first :attr:`length` tokens of the sequence. :meth:`forward`
    appends tokens; :meth:`truncate` drops the newest ones (rollback after a rejected draft),
    never re-running a prefill.

    Args:
        model: a ``transformers`` causal LM (``Qwen2ForCausalLM``, ``LlamaForCausalLM``, ...).
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        self.cache = DynamicCache(config=model.config)
        self.length = 0

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def vocab_size(self) -> int:
        """Rows of the output head, i.e. the size of the logits' last dimension."""
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
            ``input_ids[T - num_logits + i]``.
        """
        T = input_ids.shape[0]
        if not 1 <= num_logits <= T:
            raise ValueError(f"num_logits must be in [1, {T}], got {num_logits}")
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
