"""The ``prediction`` proposer: drafts from a text the caller expects the answer to be.

OpenAI's Predicted Outputs (Chat Completions ``prediction: {"type": "content", "content": ...}``):
the client sends what it expects most of the answer to be (the file before an edit, a config with
one value to change, a document with one paragraph to rewrite) and the server drafts from it. Here
the prediction is tokenized once per request and every step drafts the prediction's tokens that
follow the answer so far:

- **aligned**: while the answer copies the prediction, the next tokens of the prediction are the
  draft (up to k; a long copy drafts far, as prompt lookup's match-length rule, Saxena 2023 and
  SuffixDecoding's ``max_spec_factor``, Oliaro et al. 2024, arXiv 2411.04975);
- **re-synchronized**: after a divergence (an edit inserts, deletes or replaces a span) the
  answer's last n tokens (n from ``max_ngram`` down to ``min_ngram``) are looked up in the
  prediction, the occurrence nearest *after* the last aligned position first (an edit moves
  forward through the file), as n-gram lookup does over the context;
- **fallback**: where the prediction has nothing (no match, or its end was reached) the request's
  other proposer drafts (the generator's: prompt lookup by default on llama.cpp), at most
  ``fallback_k`` tokens;
- **misses**: after ``max_misses`` (2) prediction drafts in a row rejected at their first token
  (a prediction unrelated to the answer) the fallback drafts, until the prediction's next token
  after a strong match is the one the target decodes (checked every step, free);
- **gated**: a prediction draft carries evidence ``("prediction", n)`` (n the match length), so a
  greedy request's draft gate (:mod:`specdecode.draft_gate`) sends it whole or withholds it; and a
  draft that goes on from a step that copied the prediction whole is sent in one pass, without the
  runner's early stop.

Lossless as every proposer: the choice of draft depends on the context only and a prediction draft
is deterministic (``probs=None``, one-hot q for the verifier), so greedy output is the target's own
and sampled output follows its distribution exactly (modified rejection sampling is exact for any q
chosen from the past); a fallback draft carries its own q. Unlike OpenAI's, it works with
log-probabilities, structured output and sampling.

Usage accounting as OpenAI's ``usage.completion_tokens_details``: ``accepted_prediction_tokens`` are
the prediction's tokens the verifier accepted (each position of the prediction counted once);
``rejected_prediction_tokens`` the rest of the prediction (tokens of it that did not appear in the
answer): :class:`PredictionRecord`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdecode.pass_observers import NO_DRAFT_PASSES, NO_PROPOSER, DraftPasses, ProposerInfo
from specdecode.proposers.base import PREDICTION, DraftTokens, Proposer, ProposerBase, default_num_speculative_tokens
from specdecode.sampling import SamplingParams
from specdecode.verify import VerifyResult

PREDICTION_DEFAULT_K = 16
"""k of a request with a prediction when the caller gives none: an edit's answer copies its
prediction for long runs (issue 51: mean acceptance length >= 12 at k 16 on the code edits)."""

MAX_PREDICTION_TOKENS = 32768
"""The longest prediction taken, in tokens (longer ones are refused naming the parameter)."""


@dataclass(frozen=True)
class PredictionConfig:
    """Options of :class:`PredictionProposer`.

    Attributes:
        max_ngram: the longest tail of the answer looked up in the prediction after a divergence
            (tokens); a longer match is stronger evidence and drafts further.
        min_ngram: the shortest tail looked up (tokens), 1 <= min_ngram <= max_ngram.
        near_ngram: tails shorter than this (1, 2 tokens: "(", "\\n    ") are trusted only within
            ``window`` tokens after the last aligned position; longer ones anywhere.
        window: see ``near_ngram`` (tokens).
        max_spec_factor: after a match of n tokens draft at most ``ceil(max_spec_factor * n)``
            tokens (k bounds it too). The answer's start counts as a match of ``start_ngram``
            tokens. 16 (with k 16: every draft as long as k) by replay on the patched llama.cpp
            build's costs (lab/scripts/gate_replay_split.py, 6 code edits, k 16: 2.10x priced over
            plain decoding, mean acceptance length 12.9, against 2.05x and 11.3 with 4): its early
            stop after 2 rows makes a wrong first token cheap whatever the draft's length, and the
            draft gate withholds the drafts of a prediction unrelated to the answer.
        start_ngram: see ``max_spec_factor``.
        fallback_k: the most tokens the fallback proposer drafts in a step the prediction has
            nothing for; None: its own default k.
        max_misses: after this many prediction drafts in a row whose first token was rejected, the
            fallback drafts instead, until the prediction's next token after a match of at least
            ``near_ngram`` tokens (checked every step, free: the step's first decoded token) is the
            target's; None: never. A prediction unrelated to the answer otherwise kept the
            fallback's drafts out wherever it had a weak match (measured on 14 held-out turns:
            0.981x of no prediction without the rule, 0.998x with it checking after any match;
            after strong matches only, replayed: HumanEval 1.995x -> 2.072x of plain decoding,
            prompt lookup alone 2.132x).
        whole_after_copy: a draft that goes on from a step whose prediction draft was accepted
            whole is sent as one pass without the early stop (``DraftTokens.early_stop`` False:
            where the runner's early stop costs a call of its own, a long copy saves that call).

    Raises:
        ValueError: bounds outside the above (the message names the option).
    """

    max_ngram: int = 16
    min_ngram: int = 1
    near_ngram: int = 3
    window: int = 64
    max_spec_factor: float = 16.0
    start_ngram: int = 4
    fallback_k: int | None = None
    max_misses: int | None = 2
    whole_after_copy: bool = True

    def __post_init__(self) -> None:
        for name in ("max_ngram", "min_ngram", "near_ngram", "window", "start_ngram"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"prediction option {name} must be an integer >= 1, got {value!r}")
        if self.max_ngram < self.min_ngram:
            raise ValueError(
                f"prediction option max_ngram must be >= min_ngram ({self.min_ngram}), got {self.max_ngram}"
            )
        factor = self.max_spec_factor
        if not isinstance(factor, int | float) or isinstance(factor, bool) or not 0 < factor <= 64:
            raise ValueError(f"prediction option max_spec_factor must be a number in (0, 64], got {factor!r}")
        if self.max_misses is not None and (not isinstance(self.max_misses, int) or self.max_misses < 1):
            raise ValueError(f"prediction option max_misses must be None or an integer >= 1, got {self.max_misses!r}")
        if self.fallback_k is not None and (not isinstance(self.fallback_k, int) or self.fallback_k < 1):
            raise ValueError(f"prediction option fallback_k must be None or an integer >= 1, got {self.fallback_k!r}")


@dataclass
class PredictionRecord:
    """How a request's prediction was used (OpenAI's ``usage.completion_tokens_details``).

    Attributes:
        prediction_tokens: tokens of the prediction (the target's tokenizer).
        accepted_prediction_tokens: positions of the prediction whose drafted token the verifier
            accepted (each counted once).
        prediction_steps: verification steps that drafted from the prediction.
        fallback_steps: steps the fallback proposer drafted (the prediction had nothing).
    """

    prediction_tokens: int = 0
    accepted_prediction_tokens: int = 0
    prediction_steps: int = 0
    fallback_steps: int = 0

    @property
    def rejected_prediction_tokens(self) -> int:
        """Tokens of the prediction that did not appear in the answer (OpenAI's definition)."""
        return self.prediction_tokens - self.accepted_prediction_tokens

    def completion_tokens_details(self) -> dict[str, int]:
        """OpenAI's ``usage.completion_tokens_details`` fields of a prediction."""
        return {
            "accepted_prediction_tokens": self.accepted_prediction_tokens,
            "rejected_prediction_tokens": self.rejected_prediction_tokens,
        }

    def to_dict(self) -> dict[str, int]:
        return {
            "prediction_tokens": self.prediction_tokens,
            **self.completion_tokens_details(),
            "prediction_steps": self.prediction_steps,
            "fallback_steps": self.fallback_steps,
        }


def encode_prediction(
    prediction: str | Sequence[int], tokenizer: Any, vocab_size: int, name: str = "prediction"
) -> torch.Tensor:
    """A prediction as token ids: int64 ``[L]`` on the CPU.

    Args:
        prediction: the expected answer, a string (tokenized without special tokens, as the answer
            is) or token ids.
        tokenizer: the target's tokenizer (``encode(text, add_special_tokens=False)``); needed for a
            string.
        vocab_size: the target's vocabulary size (ids must be in ``[0, vocab_size)``).
        name: how messages name the parameter.

    Raises:
        ValueError: not a string or a list of ints, ids outside the vocabulary, a string without a
            tokenizer, or more than :data:`MAX_PREDICTION_TOKENS` tokens (the message names ``name``).
    """
    if isinstance(prediction, str):
        if tokenizer is None:
            raise ValueError(f"{name} is a string but the generator has no tokenizer; pass token ids")
        ids = list(tokenizer.encode(prediction, add_special_tokens=False)) if prediction else []
    elif isinstance(prediction, Sequence) and all(isinstance(i, int) and not isinstance(i, bool) for i in prediction):
        ids = [int(i) for i in prediction]
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            raise ValueError(f"{name} token ids must be in [0, {vocab_size}), got min {min(ids)}, max {max(ids)}")
    else:
        raise ValueError(f"{name} must be a string or a list of token ids, got {type(prediction).__name__}")
    if len(ids) > MAX_PREDICTION_TOKENS:
        raise ValueError(f"{name} has {len(ids)} tokens; at most {MAX_PREDICTION_TOKENS} are taken")
    return torch.tensor(ids, dtype=torch.int64)


def locate(
    prediction: torch.Tensor, answer: torch.Tensor, last: int, config: PredictionConfig, start: bool = True
) -> tuple[int, int] | None:
    """Where the prediction continues the answer: ``(position, match length)`` or None.

    The answer's last n tokens (n from ``min(max_ngram, len(answer))`` down to ``min_ngram``) are
    looked up in the prediction; the first n with an acceptable occurrence wins. Among its
    occurrences, the nearest one ending at or after ``last`` (the last aligned position: edits move
    forward), else the nearest one before it. An n below ``near_ngram`` is trusted only within
    ``window`` tokens after ``last``. An empty answer continues at position 0 (a match of
    ``start_ngram`` tokens), and so does an answer that is the prediction's beginning so far (a
    match of ``start_ngram`` + its length), and, while nothing is aligned (``last`` 0), an answer
    whose tail matches only in fewer than ``near_ngram`` tokens and further into the prediction than
    the answer is long: an answer that opens with a line of its own (a code fence, "Here is the
    file:") starts the prediction after it, and a weak match further on is a worse guess than the
    start (a match no further than the answer's length is its copy with an edit, and stands). The
    proposer asks for this once per request (``start``). Vectorised: one comparison of all windows per n.

    Args:
        prediction: int64 ``[L]``.
        answer: int64 ``[a]``, the tokens generated so far.
        last: the position in the prediction after the last token known to be aligned (0 .. L).
        config: :class:`PredictionConfig`.
        start: whether a weak match may give way to the prediction's start (see above).

    Returns:
        ``(j, n)``: ``prediction[j - n : j] == answer[-n:]``, so ``prediction[j]`` is the predicted
        next token (``j`` may be ``L``: the prediction is used up); None when nothing matches.
    """
    L, a = int(prediction.shape[0]), int(answer.shape[0])
    if a == 0:
        return (0, config.start_ngram) if L else None
    if a <= min(L, config.max_ngram) and torch.equal(prediction[:a], answer):  # aligned from the start
        return a, config.start_ngram + a
    for n in range(min(config.max_ngram, a, L), config.min_ngram - 1, -1):
        windows = prediction.unfold(0, n, 1)  # (L - n + 1, n)
        ends = (windows == answer[a - n :]).all(dim=1).nonzero().view(-1) + n  # (h,) positions after each match
        if n < config.near_ngram:
            ends = ends[(ends >= last) & (ends <= last + config.window)]
        if not ends.numel():
            continue
        ahead = ends[ends >= last]
        found = int(ahead[0]) if ahead.numel() else int(ends[-1])
        if start and n < config.near_ngram and last == 0 and found > a:  # nothing aligned: the start beats a weak match
            return 0, config.start_ngram
        return found, n
    return None


class PredictionProposer(ProposerBase):
    """Drafts from one request's prediction; the ``fallback`` proposer where it has nothing.

    Built per request (:func:`with_prediction`), around the generator's or the server row's own
    proposer, which keeps its state in sync: it sees every step's features (Medusa, EAGLE), and its
    ``observe`` after the steps it drafted.

    Args:
        prediction: int64 ``[L]``, the predicted answer's token ids (:func:`encode_prediction`).
        fallback: the request's other proposer, or None (nothing drafted where the prediction has
            nothing).
        prompt_len: tokens of the prompt: the answer is ``context[prompt_len:]``.
        config: :class:`PredictionConfig`.

    Attributes:
        record: the request's :class:`PredictionRecord` (usage fields and step counts).
    """

    supports_tree = False
    default_num_speculative_tokens = PREDICTION_DEFAULT_K

    def __init__(
        self,
        prediction: torch.Tensor,
        fallback: Proposer | None = None,
        prompt_len: int = 0,
        config: PredictionConfig | None = None,
    ) -> None:
        self.prediction = prediction.to(dtype=torch.int64, device="cpu").view(-1)  # (L,)
        self.fallback = fallback
        self.prompt_len = int(prompt_len)
        self.config = config or PredictionConfig()
        self.fallback_k = self.config.fallback_k or (default_num_speculative_tokens(fallback) if fallback else 0)
        self.name = f"prediction+{fallback.name}" if fallback is not None else "prediction"
        self.copies = fallback is None or bool(getattr(fallback, "copies", False))  # its fallback's too
        self.needs_target_features = bool(fallback is not None and fallback.needs_target_features)
        self.record = PredictionRecord(prediction_tokens=int(self.prediction.shape[0]))
        self.reset()

    @property
    def vocab_size(self) -> int | None:  # type: ignore[override]
        """The fallback's (the engine checks it against the target's); None: any."""
        return getattr(self.fallback, "vocab_size", None)

    @property
    def drafter(self) -> torch.nn.Module | None:  # type: ignore[override]
        return getattr(self.fallback, "drafter", None)

    def describe(self) -> ProposerInfo:
        """The fallback's (the prediction costs no forwards); :data:`NO_PROPOSER` without one."""
        return self.fallback.describe() if self.fallback is not None else NO_PROPOSER

    @property
    def passes(self) -> DraftPasses:  # type: ignore[override]
        """The fallback's sink (the prediction makes no forwards): setting it sets the fallback's."""
        return self.fallback.passes if self.fallback is not None else NO_DRAFT_PASSES  # type: ignore[attr-defined]

    @passes.setter
    def passes(self, sink: DraftPasses) -> None:
        if self.fallback is not None:
            self.fallback.passes = sink  # type: ignore[attr-defined]

    def clear_cache(self) -> None:
        if self.fallback is not None:
            self.fallback.clear_cache()

    def reset(self) -> None:
        """A fresh request: the fallback's state, the alignment and the record's counts."""
        if self.fallback is not None:
            self.fallback.reset()
        self._last = 0  # position in the prediction after the last aligned token
        self._drafted_at: int | None = None  # where this step's prediction draft starts (None: fallback)
        self._drafted = 0  # its tokens
        self._start_tried = False  # the start drafted after an answer that did not begin with it
        self._copied = False  # the last step's prediction draft and the target's own token were all the prediction's
        self._misses = 0  # prediction drafts in a row whose first token was rejected
        self._pending: int | None = None  # while they are too many: the prediction's next token this step
        self._accepted = torch.zeros(int(self.prediction.shape[0]), dtype=torch.bool)
        record = self.record
        record.accepted_prediction_tokens = record.prediction_steps = record.fallback_steps = 0

    def propose(
        self,
        context: torch.Tensor,
        num_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftTokens:
        """The prediction's next tokens after the answer (``probs=None``), at most ``num_tokens`` and
        ``ceil(max_spec_factor * match length)``; else (nothing there, or ``max_misses`` missed in a
        row) the fallback's draft of at most ``min(num_tokens, fallback_k)`` tokens (see
        :meth:`~specdecode.proposers.base.Proposer.propose`).

        Args:
            context: int64 ``[T]``, ``T >= prompt_len``: the prompt and the answer so far.
        """
        answer = context[self.prompt_len :]  # (a,)
        found = locate(self.prediction, answer, self._last, self.config, not self._start_tried)
        L = int(self.prediction.shape[0])
        limit = self.config.max_misses
        self._pending = None
        if found is not None and found[0] < L and limit is not None and self._misses >= limit:
            if found[1] >= self.config.near_ngram:  # a strong match: its next token is checked, not drafted
                self._pending = int(self.prediction[found[0]])
        elif found is not None and found[0] < L:
            start, n = found
            self._start_tried |= start == 0 and len(answer) > 0  # the start after a weak match: once
            length = min(num_tokens, math.ceil(self.config.max_spec_factor * n - 1e-9), L - start)
            whole = self.config.whole_after_copy and self._copied and start == self._last + 1
            self._drafted_at, self._drafted = start, length
            self.record.prediction_steps += 1
            # evidence (PREDICTION, n): the draft gate sends it whole or withholds it, never shortens it (shortened,
            # the 6 code edits ran at 1.04-1.05x of llama-cpp-python exact against 1.14x sent whole:
            # lab/notebook/2026-11-27-heldout-gate.md); it withholds the drafts of an unrelated prediction
            return DraftTokens(self.prediction[start : start + length].clone(), None, (PREDICTION, n), not whole)
        self._drafted_at, self._copied = None, False
        if self.fallback is None:
            return DraftTokens.empty()
        self.record.fallback_steps += 1
        return self.fallback.propose(context, min(num_tokens, self.fallback_k), sampling, generator)

    def observe_features(self, hidden: torch.Tensor) -> None:
        """Passed on to the fallback at every step (it reads the target's features)."""
        if self.fallback is not None:
            self.fallback.observe_features(hidden)

    def observe(self, result: VerifyResult) -> None:
        """Mark the prediction's accepted positions and move the alignment past them; the fallback
        hears about the steps it drafted."""
        start = self._drafted_at
        if start is None:
            if self._pending is not None and int(result.tokens[0]) == self._pending:
                self._misses = 0  # the answer follows the prediction again
            self._pending = None
            if self.fallback is not None:
                self.fallback.observe(result)
            return
        n = result.num_accepted
        tokens = result.tokens.cpu()  # (n + 1,): one copy to the host, read three times below
        # a miss: the step's first token is not the draft's (so also for a draft the gate withheld)
        self._misses = 0 if int(tokens[0]) == int(self.prediction[start]) else self._misses + 1
        kept = self.prediction[start : start + n] == tokens[:n]  # (n,): a constraint may reshape drafts
        self._accepted[start : start + n] |= kept
        self.record.accepted_prediction_tokens = int(self._accepted.sum())
        self._last = start + n
        bonus = start + n < int(self.prediction.shape[0]) and int(tokens[n]) == int(self.prediction[start + n])
        self._copied = n == self._drafted and bool(kept.all()) and bonus  # the answer still copies the prediction


def with_prediction(
    proposer: Proposer | None,
    prediction: torch.Tensor | None,
    prompt_len: int,
    config: PredictionConfig | None = None,
) -> Proposer | None:
    """``proposer`` itself without a prediction, else a :class:`PredictionProposer` over it
    (``prediction``: int64 ``[L]``, :func:`encode_prediction`; ``prompt_len``: the prompt's tokens)."""
    if prediction is None:
        return proposer
    return PredictionProposer(prediction, proposer, prompt_len, config)


def prediction_record(proposer: Proposer | None, prediction: torch.Tensor | None) -> PredictionRecord | None:
    """The record a request's statistics carry: the :class:`PredictionProposer`'s own (filled as it
    decodes), a record of a prediction not drafted from (speculation off: every token rejected), or
    None without a prediction."""
    if isinstance(proposer, PredictionProposer):
        return proposer.record
    return PredictionRecord(prediction_tokens=int(prediction.shape[0])) if prediction is not None else None
