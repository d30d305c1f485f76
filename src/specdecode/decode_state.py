"""One sequence's decode state, shared by the single-sequence loop and the server's batch.

:class:`DecodeState` is what the speculative loop keeps per sequence (docs/design.md §2): the
context (prompt and new tokens, preallocated), the sampling parameters and the request's own
``torch.Generator``, the proposer, the statistics, the text stream with its stop strings, and the
stop and length limits. :class:`~specdecode.engine.SpeculativeGenerator` runs one, the server's
:class:`~specdecode.serve.scheduler.Scheduler` one per running request, through the same three
calls per target pass::

    draft  = state.propose(k)                          # 1. (k <= state.room())
    logits = runner.forward(state.step_input(draft))   # 2. its own runner / batch row
    state.target_pass(TargetPass((k + 1,), seconds))   # 2. reported to the state's observers
    result = verify(draft.ids, draft.probs, logits, state.sampling, state.generator)   # 3.
    runner.truncate(state.T + result.num_accepted)     # 4. roll back (the runner's business)
    state.after_verify(len(draft), result, features)   # 4. proposer feedback; 5. stats
    new_ids, new_text = state.append(result.tokens)    # 5. emit; state.finish_reason: stop?

(steps 2-4 are :mod:`specdecode.loop_steps`' functions, which both loops call),
so "the server decodes exactly as ``generate`` does" holds by construction: same invariant (the
runner caches every context token but the last), same verifier, same use of randomness, same stop
rules.

Devices (docs/design.md §2b, "Device policy"): the context and every id live on the CPU; the
logits on the runner's :attr:`device`. :meth:`propose` is the one place a draft is moved: its ids
to the CPU, its probabilities to the runner's device. The generator is a CPU generator.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from specdecode.logprobs import TokenLogprob, check_num_logprobs, token_logprobs
from specdecode.pass_observers import DraftPasses, PassObserver, StatsObserver, TargetPass, describe
from specdecode.proposers.base import DraftTokens, Proposer
from specdecode.sampling import SamplingParams
from specdecode.stats import SpecStats
from specdecode.stop_strings import StopStringStream
from specdecode.verify import VerifyResult, verify

if TYPE_CHECKING:
    from specdecode.constraints.state import ConstraintState


_NO_DRAFT = DraftTokens.empty()
"""The draft of a step that drafts nothing (shared: an empty tensor has nothing to change)."""


class DecodeState:
    """Per-sequence state of speculative decoding.

    Args:
        prompt_ids: the prompt, int64 ``[P]`` (or a list of ids), ``P >= 1``.
        sampling: the request's :class:`~specdecode.sampling.SamplingParams`; its ``seed`` (or a
            random one) seeds :attr:`generator`, used for drafting and verification alike.
        max_length: the target's context length in tokens (``P < max_length``).
        max_k: the most tokens drafted in one step (sizes the preallocated context).
        proposer: the sequence's proposer, or None (target alone).
        eos_token_ids: ids that end the sequence (unless ``ignore_eos``).
        tokenizer: decodes the text stream (``decode(ids, skip_special_tokens=True)``); None: no
            text, and no stop strings.
        stats: the :class:`~specdecode.stats.SpecStats` this state fills (a fresh one if None).
        ignore_eos: do not stop at ``eos_token_ids`` (fixed-length benchmark outputs).
        num_logprobs: report each emitted token's log-probability and this many alternatives
            (:mod:`specdecode.logprobs`, 0 .. 20; the target's raw distribution); None (default): off,
            and :meth:`append` needs no logits.
        constraint: the sequence's grammar state (:class:`~specdecode.constraints.state.ConstraintState`,
            structured output): :meth:`propose` shapes drafts to the grammar, :meth:`verify` masks
            the target's distribution, :meth:`append` advances the grammar; None: unconstrained.
        device: where the target runner's logits live (its ``device``); drafts' probabilities are
            moved there. Default: the CPU.

    Attributes:
        context: int64 ``[P + limit + max_k + 1]``; ``context[:T]`` is known.
        T: tokens of context known (prompt plus emitted tokens).
        limit: the most new tokens: ``max_new_tokens`` cut to the context left after the prompt.
        generated: the emitted token ids (an EOS that ended the sequence included).
        text: the :class:`~specdecode.stop_strings.StopStringStream`, or None without a tokenizer.
        finish_reason: None while running, then ``"stop"`` (EOS or stop string) or ``"length"``.
        logprobs: with ``num_logprobs``, one :class:`~specdecode.logprobs.TokenLogprob` per token
            of :attr:`generated`; else None.
        info: the proposer's :class:`~specdecode.pass_observers.ProposerInfo` (its ``describe()``,
            read once here).
        observers: who hears of this sequence's passes (:mod:`specdecode.pass_observers`): a
            :class:`~specdecode.pass_observers.StatsObserver` of :attr:`stats` first; the proposer's
            ``passes`` sink reports its own model's forwards to them.

    Raises:
        ValueError: an empty prompt, stop strings without a tokenizer, or a bad ``num_logprobs``.
    """

    def __init__(
        self,
        prompt_ids: torch.Tensor | list[int],
        sampling: SamplingParams,
        max_length: int,
        max_k: int,
        proposer: Proposer | None = None,
        eos_token_ids: Iterable[int] = (),
        tokenizer: Any = None,
        stats: SpecStats | None = None,
        ignore_eos: bool = False,
        num_logprobs: int | None = None,
        constraint: ConstraintState | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        prompt = torch.as_tensor(prompt_ids, dtype=torch.int64).cpu()
        P = int(prompt.shape[0])
        if P == 0:
            raise ValueError("prompt must contain at least one token")
        if sampling.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.sampling = sampling
        self.proposer = proposer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.ignore_eos = ignore_eos
        self.prompt_len = P
        self.limit = min(sampling.max_new_tokens, max_length - P)
        self.context = torch.empty(P + self.limit + max_k + 1, dtype=torch.int64)
        self.context[:P] = prompt
        self._context_np = self.context.numpy()  # the same memory: a cheap write per emitted token
        self.T = P
        self.seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator().manual_seed(self.seed)  # CPU, whatever the device (§2b)
        self.device = torch.device(device)
        self.stats = stats if stats is not None else SpecStats(prompt_tokens=P)
        self.info = describe(proposer)
        self.observers: list[PassObserver] = [StatsObserver(self.stats, self.info)]
        if proposer is not None:  # this request's sink for the forwards of the proposer's own model
            proposer.passes = DraftPasses(self.info.pass_kind, self.observers)  # type: ignore[attr-defined]
        self.text = StopStringStream(tokenizer, sampling.stop) if tokenizer is not None else None
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.constraint = constraint
        self.num_logprobs = check_num_logprobs(num_logprobs, "num_logprobs")
        self.logprobs: list[TokenLogprob] | None = [] if num_logprobs is not None else None

    @property
    def prompt_ids(self) -> torch.Tensor:
        """The prompt, int64 ``[P]`` (a view of :attr:`context`)."""
        return self.context[: self.prompt_len]

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose cells the runner holds already (a reused prefix; ``stats.cached_tokens``)."""
        return self.stats.cached_tokens

    @cached_tokens.setter
    def cached_tokens(self, n: int) -> None:
        self.stats.cached_tokens = n

    def prefill_ids(self) -> torch.Tensor:
        """The prefill's tokens: the prompt after its :attr:`cached_tokens` (which the runner's cells
        hold already: a reused prefix, :mod:`specdecode.models.prefix_cache`), int64 ``[P - cached]``."""
        return self.context[self.cached_tokens : self.prompt_len]

    def room(self) -> int:
        """The most tokens it may draft in the next step: what the length limit leaves after the
        token the target adds itself (the recovered or bonus token)."""
        return max(0, self.limit - len(self.generated) - 1)

    def propose(self, k: int) -> DraftTokens:
        """Up to ``k`` draft tokens from the proposer over ``context[:T]`` (none when ``k <= 0`` or
        there is no proposer): ids int64 ``[k']`` on the CPU, probs float ``[k', V]`` on
        :attr:`device` or None. Errors are the proposer's."""
        if k <= 0 or self.proposer is None:
            return _NO_DRAFT
        draft = self.proposer.propose(self.context[: self.T], k, self.sampling, self.generator)
        draft = draft.to(self.device)  # the one move of a draft: ids to the CPU, probs to the logits' device
        if self.constraint is not None:  # grammar-aware drafting: cut at a forbidden token, forced tokens
            draft = self.constraint.shape_draft(draft, k)
        return draft

    def verify(self, draft: DraftTokens, target_logits: torch.Tensor) -> VerifyResult:
        """Step 3: verify the pass's drafts (those the logits scored: a greedy split pass may stop
        early) with :func:`~specdecode.verify.verify`, or under the sequence's constraint
        (:meth:`~specdecode.constraints.state.ConstraintState.verify`: the target's distribution
        masked to the grammar at every position).

        Args:
            draft: the draft sent (from :meth:`propose`), ids int64 ``[k]`` (CPU), probs ``[k, V]``
                (on the logits' device) | None.
            target_logits: float ``[scored + 1, V]``, ``scored <= k``, on :attr:`device`.
        """
        if self.constraint is not None:
            return self.constraint.verify(draft, target_logits, self.sampling, self.generator)
        scored = target_logits.shape[0] - 1
        ids = draft.ids if scored == draft.ids.shape[0] else draft.ids[:scored]
        return verify(ids, draft.probs, target_logits, self.sampling, self.generator)

    def step_input(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """The tokens of the next target pass: the last context token and the draft, int64 ``[k + 1]``
        (without a draft a view of :attr:`context`, whose known tokens never change)."""
        last = self.context[self.T - 1 : self.T]
        return torch.cat([last, draft_ids.cpu()]) if draft_ids.shape[0] else last

    def target_pass(self, p: TargetPass) -> None:
        """Report one target pass of this sequence (its own row: ``p.widths`` has one) to :attr:`observers`."""
        for observer in self.observers:
            observer.target_pass(p)

    def after_prefill(self, features: torch.Tensor | None = None) -> None:
        """Give a feature-reading proposer the prompt's features ``[P, H]`` (the pass itself is
        reported through :meth:`target_pass`)."""
        if features is not None and self.proposer is not None:
            self.proposer.observe_features(features)  # type: ignore[attr-defined]

    def after_verify(
        self, num_drafted: int, result: VerifyResult, features: torch.Tensor | None = None, depth: int | None = None
    ) -> None:
        """Account one verified target pass (the runner rolled back to ``T + num_accepted`` already;
        the pass itself is reported through :meth:`target_pass`).

        Args:
            num_drafted: tokens drafted (a tree: its node count).
            result: the verifier's result.
            features: the target's features of the kept positions (the pass's root and accepted
                drafts), ``[num_accepted + 1, H]``, for a proposer that reads them; else None.
            depth: a tree's depth (None for a chain).
        """
        self.stats.accepted_per_step.append(result.num_accepted)
        if self.proposer is not None:
            if features is not None:
                self.proposer.observe_features(features)  # type: ignore[attr-defined]
            self.proposer.observe(result)
        self.stats.observe(num_drafted, result.num_accepted, depth=depth)
        if self.constraint is not None:  # grammar-aware drafting's counters
            c = self.constraint
            self.stats.forced_draft_tokens = c.forced_draft_tokens
            self.stats.forced_accepted_tokens = c.forced_accepted_tokens
            self.stats.cut_draft_tokens = c.cut_draft_tokens

    def append(self, tokens: torch.Tensor | list[int], logits: torch.Tensor | None = None) -> tuple[list[int], str]:
        """Emit the tokens of one pass, cut at the first stop.

        Stops at an EOS token (kept in :attr:`generated`), at a stop string (the text ends before
        it) or at :attr:`limit` tokens; :attr:`finish_reason` then says which.

        ``logits``: with ``num_logprobs``, the target's raw rows of the pass that scored ``tokens``,
        float ``[>= len(tokens), V]`` (row i for ``tokens[i]``: a chain's rows ``0 .. n``, a tree's
        root and kept path, the prefill's last row); the emitted tokens' log-probabilities go to
        :attr:`logprobs`. Unused (may be None) without ``num_logprobs``.

        Returns:
            ``(new token ids, new text safe to show)``; the ids after a stop are dropped.
        """
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        n = len(ids)
        self._context_np[self.T : self.T + n] = ids
        self.T += n
        new_ids: list[int] = []
        new_text = ""
        text = self.text
        for token in ids:
            new_ids.append(token)
            if text is not None:
                new_text += text.add(token)
            if (token in self.eos_token_ids and not self.ignore_eos) or (text is not None and text.stopped):
                self.finish_reason = "stop"
            elif len(self.generated) + len(new_ids) >= self.limit:
                self.finish_reason = "length"
            if self.finish_reason is not None:
                if text is not None:
                    new_text += text.finish()
                break
        self.generated.extend(new_ids)
        self.stats.new_tokens = len(self.generated)
        if self.constraint is not None:
            self.constraint.advance(new_ids)
        if self.logprobs is not None:
            if logits is None:
                raise ValueError("append: logits are needed when num_logprobs is set")
            self.logprobs.extend(token_logprobs(logits, new_ids, self.num_logprobs))  # type: ignore[arg-type]
        return new_ids, new_text
