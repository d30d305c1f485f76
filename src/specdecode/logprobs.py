"""Log-probabilities of the emitted tokens, exactly as decoding without speculation reports them.

**Distribution.** Always the target's *raw* distribution: ``log_softmax`` of the target's logits
at that position, in float32, before temperature, top-k and top-p (what OpenAI reports, and vLLM's
default ``raw_logprobs``); so a token's log-probability does not depend on the sampling settings,
on speculation, or on constraints that mask the logits before sampling. The same definition holds
on every path: the first token (the prefill pass's last row), accepted drafts, recovered and bonus
tokens (rows of the verification pass), token trees (the kept branch's rows) and the server's
batched pass.

**Where the rows come from.** Every emitted token has its target logits row already: the
verification pass over ``[last token, d_1 .. d_k]`` gives ``[k + 1, V]`` rows, row i scoring the
token after ``d_1 .. d_i``; after ``n`` accepted drafts the emitted tokens are ``d_1 .. d_n`` and
the recovered / bonus token, scored by rows ``0 .. n``. A runner that stops a greedy verification
pass early (llama.cpp's exact mode, :meth:`specdecode.models.llamacpp.LlamaCppRunner.forward`)
still returns those rows: it stops only after the chunk holding the first rejected row. So
log-probabilities cost one ``log_softmax`` over the emitted rows and no extra target pass; when
not requested, nothing.

**Exact.** The reported values equal a plain re-scoring of prompt + emitted tokens by the same
target, up to floating-point effects of scoring a position in a different pass (tests: float32
torch within ``1e-4``, the llama.cpp GGUF target within the tolerance stated in its test).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

MAX_TOP_LOGPROBS = 20  # the most alternatives per position (OpenAI's top_logprobs limit, vLLM's default)


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target's raw distribution.

    Attributes:
        token_id: the emitted token.
        logprob: its natural-log probability (nats, ``<= 0``), float32 computed, as a Python float.
        top: the ``N`` most likely tokens at that position as ``(token_id, logprob)``, most likely
            first (ties in ``torch.topk``'s order); empty when ``N == 0``.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_dict(self, tokenizer: Any = None) -> dict[str, Any]:
        """A JSON-ready dict: ``token_id``, ``logprob``, ``top_logprobs`` (list of ``token_id``,
        ``logprob``), and with a ``tokenizer`` each token's text (``token``)."""

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            out: dict[str, Any] = {"token_id": token_id}
            if tokenizer is not None:
                out["token"] = tokenizer.decode([token_id])
            out["logprob"] = logprob
            return out

        return {**entry(self.token_id, self.logprob), "top_logprobs": [entry(t, lp) for t, lp in self.top]}


def check_num_logprobs(num: Any, name: str = "logprobs") -> int | None:
    """Return ``num`` if it is a valid number of alternatives per position (None: log-probabilities off).

    Args:
        num: None, or an integer in ``[0, MAX_TOP_LOGPROBS]`` (0: the chosen token's only).
        name: the parameter's name in the message (``"logprobs"``, ``"top_logprobs"``, ``"--logprobs"``).

    Raises:
        ValueError: anything else (a bool, a float, a negative number, more than 20); names ``name``.
    """
    if num is None:
        return None
    if isinstance(num, bool) or not isinstance(num, int) or not 0 <= num <= MAX_TOP_LOGPROBS:
        raise ValueError(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {num!r}")
    return num


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int] | torch.Tensor, num_top: int) -> list[TokenLogprob]:
    """Log-probabilities of ``token_ids`` under the target's raw distribution at their positions.

    Args:
        logits: float ``[m, V]`` target logits (any float dtype; computed in float32); row i is the
            target's raw, unmasked row for the position where ``token_ids[i]`` was emitted (row i of
            a verification pass scores the token after the pass's i-th input token). Rows after
            ``len(token_ids)`` are ignored.
        token_ids: int ``[m']``, ``m' <= m``, the emitted tokens.
        num_top: ``N``, alternatives per position, in ``[0, MAX_TOP_LOGPROBS]``.

    Returns:
        ``m'`` :class:`TokenLogprob`, one per token, in order.

    Raises:
        ValueError: ``logits`` not 2-D, fewer rows than tokens, a token id outside ``[0, V)``, or a
            bad ``num_top``.
    """
    ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else [int(t) for t in token_ids]
    m = len(ids)
    check_num_logprobs(num_top, "num_top")
    if logits.dim() != 2 or logits.shape[0] < m:
        raise ValueError(f"logits must be [m, V] with m >= {m} rows (one per token), got {list(logits.shape)}")
    if m == 0:
        return []
    V = logits.shape[1]
    if min(ids) < 0 or max(ids) >= V:
        raise ValueError(f"token ids must be in [0, {V}), got {ids}")
    logp = torch.log_softmax(logits[:m].float(), dim=-1)  # (m', V) float32, on the logits' device
    chosen = logp.gather(1, torch.tensor(ids, device=logp.device).view(m, 1))  # (m', 1)
    N = min(num_top, V)
    top_lp, top_ids = torch.topk(logp, N, dim=-1)  # (m', N)
    # one host copy (docs/design.md §2b): float64 holds the float32 log-probabilities and the ids exactly
    rows = torch.cat([chosen.double(), top_lp.double(), top_ids.double()], dim=1).tolist()  # (m', 1 + 2N)
    tops = [tuple((int(t), lp) for t, lp in zip(row[1 + N :], row[1 : 1 + N], strict=True)) for row in rows]
    chosen_lp = [row[0] for row in rows]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(ids, chosen_lp, tops, strict=True)]
