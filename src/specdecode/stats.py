"""Decoding statistics with the field's definitions (docs/design.md §4).

- acceptance rate = accepted tokens / draft tokens
- mean acceptance length = 1 + accepted tokens / drafts (tokens gained per target pass that
  verified a draft, the recovered or bonus token included)
- per-position acceptance at position i = steps whose i-th draft token was accepted / steps that
  drafted a token at position i (vLLM's ``accepted per position`` counts, normalised)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecStats:
    """Counters of one generation; derived rates are properties.

    Attributes:
        num_speculative_tokens: k, the most tokens proposed per step (0: no speculation).
        proposer: the proposer's name, or ``"none"`` for target-only decoding.
        dtype: the target's dtype, e.g. ``"bfloat16"``.
        draft_quantization: ``"int8"`` when the draft model drafted with int8 linear layers
            (:mod:`specdecode.models.torch.quant`), ``"int8-head"`` when a Medusa / EAGLE drafter scored
            with int8 LM-head rows (``head_quantization``), else ``"none"``.
        schedule: how k was chosen per step (``"constant"``, ``"heuristic"``, ``"adaptive"``;
            ``"none"`` without speculation); with a varying k, ``num_speculative_tokens`` is its ceiling.
        tree: the token tree's name (``"none"`` for chains); with a tree, ``num_speculative_tokens``
            is its depth, positions are depths, and ``draft_tokens`` counts tree nodes.
        plain_steps: steps the schedule decoded without a draft (adaptive fallback and its measurements).
        fallbacks: times the adaptive schedule switched speculation off.
        drafts: steps that proposed at least one token.
        draft_tokens: tokens proposed in all.
        accepted_tokens: proposed tokens the verifier kept.
        accepted_per_position: length k; entry i counts steps whose draft token i was accepted.
        drafted_per_position: length k; entry i counts steps that proposed a token at position i.
        target_forward_passes: target forward calls, the prefill included (a reused one too).
        new_tokens: tokens returned to the caller.
        prompt_tokens: tokens of the prompt after templating.
        wall_time_s: seconds from the start of ``generate`` to its last token.
        time_to_first_token_s: seconds until the first new token was known.
        prefill_time_s: seconds in the target's prefill pass.
        prefill_reused: the prompt was the previous generation's and the target's runner answered
            its prefill from the one it kept, with no pass (``SpeculativeGenerator.reuse_prompt``).
        cached_tokens: prompt tokens whose KV the target's cache held already (the longest common
            prefix with the previous sequence, or a server's cached prefix), not prefilled again.
        draft_time_s: seconds in ``proposer.propose`` (all steps).
        target_time_s: seconds in the target's verification passes (prefill excluded).
        forced_draft_tokens: under a constraint, tokens the grammar forced that were drafted for
            free (grammar-aware drafting, :mod:`specdecode.constraints`); counted in ``draft_tokens``.
        forced_accepted_tokens: of those, the ones the verifier kept.
        cut_draft_tokens: under a constraint, proposed tokens never sent to the target because the
            grammar forbids them (the forbidden token and the drafts after it; tree nodes).
        target_pass_widths: tokens fed to each target forward pass, in order: the prefill's (the
            prompt's length), then 1 + the tokens drafted (tree nodes) per verification step. The
            input of ``specdecode bench --cost-table`` (:mod:`specdecode.cost.table`); not in
            :meth:`to_dict`.
        draft_pass_widths: tokens fed to each forward pass of the proposer's own model (a draft
            model; an EAGLE head; Medusa heads, 1 per evaluation), in order (empty for proposers
            without a model of their own, e.g. prompt lookup and suffix, and for those that
            do not record them); not in :meth:`to_dict`.
        draft_pass_kind: which cost-table curve prices ``draft_pass_widths``: ``"draft"`` (a draft
            model's forwards), ``"eagle"`` / ``"medusa"`` (a trained drafter's head forwards); the
            ``pass_kind`` of the proposer's ``describe()``. Not in :meth:`to_dict`.
        accepted_per_step: draft tokens accepted at each verification step, in order; not in
            :meth:`to_dict`.
        gated_draft_tokens: drafted tokens the draft gate kept from the target (copied drafts it
            expected not to pay: :mod:`specdecode.draft_gate`).
        prediction: with a prediction (OpenAI's Predicted Outputs), its
            :class:`~specdecode.proposers.prediction.PredictionRecord` (tokens of the prediction,
            accepted and rejected ones); None without one. In :meth:`to_dict` as its fields.
    """

    num_speculative_tokens: int = 0
    proposer: str = "none"
    dtype: str = "float32"
    draft_quantization: str = "none"
    schedule: str = "none"
    tree: str = "none"
    plain_steps: int = 0
    fallbacks: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    target_forward_passes: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0
    wall_time_s: float = 0.0
    time_to_first_token_s: float = 0.0
    prefill_time_s: float = 0.0
    prefill_reused: bool = False
    cached_tokens: int = 0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    forced_draft_tokens: int = 0
    forced_accepted_tokens: int = 0
    cut_draft_tokens: int = 0
    target_pass_widths: list[int] = field(default_factory=list)
    draft_pass_widths: list[int] = field(default_factory=list)
    draft_pass_kind: str = "draft"
    accepted_per_step: list[int] = field(default_factory=list)
    gated_draft_tokens: int = 0
    prediction: Any = None  # PredictionRecord | None (specdecode.proposers.prediction)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        self.accepted_per_position = self.accepted_per_position or [0] * k
        self.drafted_per_position = self.drafted_per_position or [0] * k

    def observe(self, num_drafted: int, num_accepted: int, depth: int | None = None) -> None:
        """Record one verification step that drafted ``num_drafted`` and accepted ``num_accepted``.

        For a token tree, ``num_drafted`` is its node count and ``depth`` its depth (the positions
        it drafted); for a chain ``depth`` is ``num_drafted``.

        Raises:
            ValueError: ``num_accepted`` outside [0, depth], ``depth`` > k or ``depth`` > ``num_drafted``.
        """
        depth = num_drafted if depth is None else depth
        if not 0 <= num_accepted <= depth <= min(num_drafted, self.num_speculative_tokens):
            raise ValueError(
                f"need 0 <= num_accepted ({num_accepted}) <= depth ({depth}) <= num_drafted ({num_drafted}) "
                f"and depth <= k ({self.num_speculative_tokens})"
            )
        if num_drafted == 0:
            return
        self.drafts += 1
        self.draft_tokens += num_drafted
        self.accepted_tokens += num_accepted
        for i in range(depth):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < num_accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def draft_cost_ratio(self) -> float:
        """c = (draft time per drafted token) / (target time per verification pass); 0 without drafts."""
        passes = self.target_forward_passes - 1  # the prefill is not a verification pass
        if not self.draft_tokens or passes <= 0 or self.target_time_s <= 0:
            return 0.0
        return (self.draft_time_s / self.draft_tokens) / (self.target_time_s / passes)

    def to_dict(self) -> dict[str, Any]:
        """All counters and derived rates, JSON-ready."""
        return {
            "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "acceptance_rate_per_position": self.acceptance_rate_per_position,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "target_forward_passes": self.target_forward_passes,
            "wall_time_s": self.wall_time_s,
            "time_to_first_token_s": self.time_to_first_token_s,
            "prefill_time_s": self.prefill_time_s,
            "prefill_reused": self.prefill_reused,
            "cached_tokens": self.cached_tokens,
            "draft_time_s": self.draft_time_s,
            "target_time_s": self.target_time_s,
            "draft_cost_ratio": self.draft_cost_ratio,
            "tokens_per_second": self.tokens_per_second,
            "num_speculative_tokens": self.num_speculative_tokens,
            "proposer": self.proposer,
            "dtype": self.dtype,
            "draft_quantization": self.draft_quantization,
            "schedule": self.schedule,
            "tree": self.tree,
            "plain_steps": self.plain_steps,
            "fallbacks": self.fallbacks,
            "forced_draft_tokens": self.forced_draft_tokens,
            "forced_accepted_tokens": self.forced_accepted_tokens,
            "cut_draft_tokens": self.cut_draft_tokens,
            "gated_draft_tokens": self.gated_draft_tokens,
            **(self.prediction.to_dict() if self.prediction is not None else {}),
        }
