"""A runner's first pass of a sequence, kept so that a next sequence with the same prompt skips it.

Prompt reuse, for a whole prompt: what llama.cpp's server does with ``cache_prompt`` and vLLM with
automatic prefix caching, limited here to a prompt equal to the previous sequence's, so that it is
exact bit for bit. A runner keeps the rows a sequence's first pass made by ``restart`` returned
(a plain ``forward`` keeps nothing); while its cache
still holds that pass's entries (every later pass appends after them, a rollback never went below
them), :meth:`Runner.restart <specdecode.models.contract.Runner.restart>` with the same tokens,
``num_logits`` and ``return_hidden`` drops what came after and answers with those rows, without a
pass: the entries are the ones a fresh first pass would write (the same tokens, positions and
pass), and the rows are that pass's own. Sampling several completions of one prompt (OpenAI's
``n``, pass@k) then costs one prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_KEPT_ROWS = 4
"""A first pass that scored more rows than this is not kept (a prefill scores one; a rescoring of a
whole prompt would keep ``[T, V]`` floats)."""


@dataclass(frozen=True)
class FirstPass:
    """The first pass of a runner's sequence: its tokens, what it was asked and what it returned.

    Attributes:
        ids: the tokens fed (the prompt), from position 0.
        num_logits: rows scored (``1 <= num_logits <= MAX_KEPT_ROWS``).
        logits: float32 ``[num_logits, V]`` as the pass returned them (a copy), on the runner's device.
        hidden: ``[T, H]`` features when the pass returned them (``return_hidden``), else None.
    """

    ids: tuple[int, ...]
    num_logits: int
    logits: torch.Tensor
    hidden: torch.Tensor | None

    @classmethod
    def keep(
        cls, ids: list[int], num_logits: int, out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    ) -> FirstPass | None:
        """A copy of a first pass's result ``out`` (what ``forward`` returned for ``ids``), or None
        when it scored more than :data:`MAX_KEPT_ROWS` rows or stopped short of them."""
        logits, hidden = out if isinstance(out, tuple) else (out, None)
        if num_logits > MAX_KEPT_ROWS or logits.shape[0] != num_logits:
            return None
        return cls(tuple(ids), num_logits, logits.clone(), None if hidden is None else hidden.clone())

    @property
    def length(self) -> int:
        """Tokens the pass cached."""
        return len(self.ids)

    def answer(
        self, ids: list[int], num_logits: int, return_hidden: bool
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """The kept result (copies, as ``forward`` would return them) if ``ids``, ``num_logits`` and
        ``return_hidden`` are those of this pass, else None (the features change how some backends
        compute the logits: llama.cpp then scores every row)."""
        if num_logits != self.num_logits or return_hidden != (self.hidden is not None) or tuple(ids) != self.ids:
            return None
        if self.hidden is None:
            return self.logits.clone()
        return self.logits.clone(), self.hidden.clone()
