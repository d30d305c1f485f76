"""Benchmark metrics: pure aggregation of per-turn records (no models, no clocks).

A record is one turn of one prompt decoded by one method (``results.json``, ``records``): keys
``question_id``, ``group``, ``turn``, ``repeat``, ``position`` (the method's place in its round of
methods), ``method``, ``settings``, ``new_tokens``, ``wall_time_s``, ``time_to_first_token_s`` (None
where not known), ``token_ids`` and ``stats`` (a :meth:`SpecStats.to_dict`, None for a peer).
Every metric is computed per method and per category group, and over all groups (``"all"``);
sums run over the records of that method and group. Terms as in docs/design.md §4.

Repeats of a greedy run (``bench --repeats N``) decode the same tokens N times: every metric but
``exact`` counts each turn of each method once, by its repeat of median wall time
(:func:`median_repeats`; the lower median for an even N, so that every field comes from one real
run): a timing spike in one repeat moves a median little and a sum a lot. ``exact`` still compares
every repeat. Repeats of a sampled run draw different tokens (seed + repeat) and are all summed.

- ``speedup``: Σ wall time of ``target`` / Σ wall time of the method, over the turns both ran. A
  turn whose new-token count differs from the baseline's (a peer's output that is not ours, e.g.
  llama-cpp-python against exact mode, or a sampled run) counts at the baseline's length: the
  method's seconds times the baseline's tokens / its own, so the ratio stays one of time per token
  (before, such a turn compared answers of different lengths: a held-out qa turn read 0.89x by
  time at 0.987x by tokens/s). Turns of equal length (identical outputs) are as measured.
- ``speedup_mean``: the mean over prompts of that ratio per prompt (its turns and repeats summed).
- ``speedup_ci95``: ``[low, high]``, a 95% paired bootstrap interval of ``speedup`` over prompts:
  prompts are drawn with replacement (each with its baseline's and the method's seconds, so the
  pair stays together) and ``speedup`` recomputed, 10,000 times with a fixed seed; the 2.5th and
  97.5th percentiles (``scipy.stats.bootstrap``, percentile method; Efron & Tibshirani 1993). It
  measures the spread between prompts, the noise that decides whether two methods differ on these
  prompts; it does not cover a slower or faster machine. None with fewer than 3 prompts.
- ``decode_speedup``: Σ (wall time - time to first token) of ``target`` / the same Σ of the method,
  over the turns both ran with a recorded time to first token (a turn of another length counted at
  the baseline's, per token after the first, as for ``speedup``): the speedup of the time per output
  token after the first (TPOT), i.e. of the decoding phase alone. The prefill (and its first token)
  is the same work for every method, and where answers are short next to their prompts it bounds
  ``speedup`` (Amdahl): with a share p of the target's time in the prefill, ``speedup`` is at most
  ``1 / p``. None for peers that do not stream (transformers' ``generate``); llama-cpp-python's
  first token is timed as it arrives (``time_to_first_token_s``).
- ``tokens_per_s``: Σ new tokens / Σ wall time (tokens per second).
- ``mean_acceptance_length``: 1 + Σ accepted tokens / Σ drafts (tokens gained per target pass
  that verified a draft, bonus or recovered token included).
- ``acceptance_rate`` (α): Σ accepted tokens / Σ draft tokens.
- ``acceptance_per_position``: at draft position i, Σ steps whose i-th token was accepted /
  Σ steps that drafted an i-th token.
- ``target_passes_per_token``: Σ target forward passes (prefill included) / Σ new tokens.
- ``cost_per_token_ms``: (Σ draft time + Σ verification time) / Σ tokens gained after the
  prefill (new tokens - 1 per turn), in milliseconds; for ``target`` the time per decoded token.
- ``draft_cost_ratio`` (c): (Σ draft time / Σ draft tokens) / (Σ verification time / Σ
  verification passes), the aggregate of :attr:`SpecStats.draft_cost_ratio`.
- ``predicted_speedup``: Leviathan et al. (2023, eq. for walltime improvement) from the measured α,
  k and c: ``(1 - α^(k+1)) / ((1 - α)(k c + 1))`` (``(k + 1) / (k c + 1)`` at α = 1).
- ``efficiency``: ``speedup / predicted_speedup`` (below 1: overheads the model does not count).
- ``proposer_mb``: the weights our engine's proposer holds beyond the target, in MB (10^6 bytes;
  the largest over the records: :func:`specdecode.proposers.proposer_weight_bytes`); None for
  peers and results saved before it was recorded.
- ``exact``: greedy only, the share of prompts whose token ids equal ``target``'s at every turn and
  repeat. Sampled runs leave it None: their exactness is distributional, covered by the tests.

Metrics a method cannot have are None: peers have no statistics (only wall time, tokens/s and
exactness); ``target`` drafts nothing (no acceptance, c or prediction).

The baseline is ``target`` unless :func:`summarize` is given another method (``specdecode bench
--baseline METHOD``): then ``speedup``, ``speedup_mean``, ``speedup_ci95``, ``decode_speedup`` and
``exact`` compare each method with that one, an A/B comparison paired per prompt.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

Record = dict[str, Any]
BASELINE = "target"
ALL = "all"


def _turn_key(record: Record) -> tuple[str, int, int]:
    return str(record["question_id"]), int(record["turn"]), int(record.get("repeat", 0))


def median_repeats(records: Sequence[Record]) -> list[Record]:
    """One record per (question, turn, method): a copy of the repeat of median wall time (the lower
    median: a record as it was measured) with ``repeat`` 0, so that methods pair by turn whichever
    repeat each picked, and ``repeats``, how many there were; in the order the first repeats came."""
    runs: dict[tuple[str, int, str], list[Record]] = {}
    for r in records:
        runs.setdefault((str(r["question_id"]), int(r["turn"]), str(r["method"])), []).append(r)
    picked = []
    for same in runs.values():
        by_time = sorted(same, key=lambda r: float(r["wall_time_s"]))
        picked.append({**by_time[(len(by_time) - 1) // 2], "repeat": 0, "repeats": len(same)})
    return picked


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def predicted_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al.'s expected walltime improvement ``(1 - α^(k+1)) / ((1 - α)(k c + 1))``.

    Args:
        alpha: per-token acceptance rate in [0, 1].
        k: tokens drafted per step.
        c: draft cost ratio (draft time per token / target time per pass), >= 0.
    """
    expected_tokens = k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return expected_tokens / (k * c + 1.0)


def _at_baseline_length(seconds: float, tokens: int | None, baseline_tokens: int | None, first: int = 0) -> float:
    """``seconds`` a record took for ``tokens`` new tokens (``first`` of them left out: 1 for the
    time after the first token), scaled to the baseline's count (its time per token times the
    baseline's tokens) where the two differ; unchanged where they are equal (identical outputs) or
    either count is not recorded."""
    if tokens is None or baseline_tokens is None:
        return seconds
    mine, theirs = tokens - first, baseline_tokens - first
    if mine == theirs or mine <= 0 or theirs <= 0:
        return seconds
    return seconds * theirs / mine


def _paired_seconds(records: Sequence[Record], baseline: Sequence[Record]) -> dict[str, list[float]]:
    """``{question_id: [baseline seconds, method seconds]}``, summed over the turns and repeats both
    ran; a turn whose new-token count differs from the baseline's is counted at the baseline's
    length (:func:`_at_baseline_length`)."""
    base = {_turn_key(r): (float(r["wall_time_s"]), r.get("new_tokens")) for r in baseline}
    per_prompt: dict[str, list[float]] = {}
    for r in records:
        if _turn_key(r) in base:
            seconds, tokens = base[_turn_key(r)]
            sums = per_prompt.setdefault(_turn_key(r)[0], [0.0, 0.0])
            sums[0] += seconds
            sums[1] += _at_baseline_length(float(r["wall_time_s"]), r.get("new_tokens"), tokens)
    return per_prompt


def speedups(records: Sequence[Record], baseline: Sequence[Record]) -> tuple[float | None, float | None]:
    """``(speedup, speedup_mean)`` of ``records`` over ``baseline`` (ratios of seconds; see module doc).

    Only turns present in both count. None when nothing matches.
    """
    per_prompt = _paired_seconds(records, baseline)
    if not per_prompt:
        return None, None
    total = _ratio(sum(s[0] for s in per_prompt.values()), sum(s[1] for s in per_prompt.values()))
    ratios = [s[0] / s[1] for s in per_prompt.values() if s[1] > 0]
    return total, (sum(ratios) / len(ratios) if ratios else None)


MIN_PROMPTS_FOR_INTERVAL = 3


def _ratio_of_sums(base: Any, mine: Any, axis: int = -1) -> Any:
    return base.sum(axis=axis) / mine.sum(axis=axis)


def speedup_interval(
    records: Sequence[Record],
    baseline: Sequence[Record],
    confidence: float = 0.95,
    n_resamples: int = 10_000,
    seed: int = 0,
) -> list[float] | None:
    """``speedup_ci95`` (see module doc): a paired percentile bootstrap interval of ``speedup``.

    Args:
        records, baseline: one method's records and the baseline's.
        confidence: the interval's level, in (0, 1).
        n_resamples: bootstrap resamples; seed: their generator's seed (the same records always
            give the same interval).

    Returns:
        ``[low, high]`` (ratios, low <= speedup <= high up to resampling), or None when fewer than
        ``MIN_PROMPTS_FOR_INTERVAL`` prompts were run by both or a method took no time.

    Raises:
        ValueError: ``confidence`` outside (0, 1).
        ImportError: scipy missing (``pip install 'specdecode[bench]'``).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    pairs = list(_paired_seconds(records, baseline).values())
    if len(pairs) < MIN_PROMPTS_FOR_INTERVAL or any(mine <= 0 for _, mine in pairs):
        return None
    try:
        import numpy as np
        from scipy.stats import bootstrap
    except ImportError as error:  # pragma: no cover - scipy comes with the bench extra
        raise ImportError("speedup intervals need scipy: pip install 'specdecode[bench]'") from error
    base, mine = np.array(pairs, dtype=np.float64).T  # (P,), (P,)
    if np.allclose(base / mine, base[0] / mine[0]):  # every prompt the same ratio: no spread to resample
        point = float(base.sum() / mine.sum())
        return [point, point]
    result = bootstrap(
        (base, mine),
        _ratio_of_sums,
        paired=True,
        vectorized=True,
        n_resamples=n_resamples,
        confidence_level=confidence,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    return [float(result.confidence_interval.low), float(result.confidence_interval.high)]


def _decode_seconds(record: Record) -> float | None:
    """Wall time after the first token (seconds), or None without a recorded time to first token
    (the record's ``time_to_first_token_s``, else its statistics')."""
    ttft = record.get("time_to_first_token_s")
    ttft = ttft if ttft is not None else (record.get("stats") or {}).get("time_to_first_token_s")
    return None if ttft is None else float(record["wall_time_s"]) - float(ttft)


def decode_speedup(records: Sequence[Record], baseline: Sequence[Record]) -> float | None:
    """``decode_speedup`` of ``records`` over ``baseline`` (see module doc): a ratio of seconds after
    the first token, over the turns both ran with a time to first token. None when none matches."""
    base = {_turn_key(r): (_decode_seconds(r), r.get("new_tokens")) for r in baseline}
    theirs, mine = 0.0, 0.0
    for r in records:
        (before, tokens), after = base.get(_turn_key(r), (None, None)), _decode_seconds(r)
        if before is not None and after is not None:
            theirs += before
            mine += _at_baseline_length(after, r.get("new_tokens"), tokens, first=1)
    return _ratio(theirs, mine) if theirs > 0 else None


def exactness(records: Sequence[Record], baseline: Sequence[Record]) -> float | None:
    """Share of prompts whose token ids equal the baseline's at every turn and repeat both ran
    (None when no prompt matches)."""
    base = {_turn_key(r): list(r["token_ids"]) for r in baseline}
    exact: dict[str, bool] = {}
    for r in records:
        key = _turn_key(r)
        if key in base:
            exact[key[0]] = exact.get(key[0], True) and list(r["token_ids"]) == base[key]
    return sum(exact.values()) / len(exact) if exact else None


def _sum(stats: Iterable[dict[str, Any]], key: str) -> float:
    return sum(float(s[key]) for s in stats)


def _per_position(stats: Sequence[dict[str, Any]]) -> list[float] | None:
    width = max((len(s["drafted_per_position"]) for s in stats), default=0)
    accepted, drafted = [0] * width, [0] * width
    for s in stats:
        for i, (a, d) in enumerate(zip(s["accepted_per_position"], s["drafted_per_position"], strict=True)):
            accepted[i] += a
            drafted[i] += d
    rates = [a / d for a, d in zip(accepted, drafted, strict=True) if d > 0]
    return rates or None


def stats_metrics(stats: Sequence[dict[str, Any]], k: int | None) -> dict[str, Any]:
    """Metrics from our engine's statistics (``SpecStats.to_dict()`` of each turn; see module doc).

    Args:
        stats: one dict per turn; empty for a peer (every metric None).
        k: the method's ``num_speculative_tokens``, or None for ``target``.
    """
    out: dict[str, Any] = dict.fromkeys(
        ["mean_acceptance_length", "acceptance_rate", "acceptance_per_position", "target_passes_per_token",
         "cost_per_token_ms", "draft_cost_ratio", "predicted_speedup"]
    )  # fmt: skip
    if not stats:
        return out
    new_tokens, passes = _sum(stats, "new_tokens"), _sum(stats, "target_forward_passes")
    gained = sum(max(int(s["new_tokens"]) - 1, 0) for s in stats)
    busy = _sum(stats, "draft_time_s") + _sum(stats, "target_time_s")
    out["target_passes_per_token"] = _ratio(passes, new_tokens)
    out["cost_per_token_ms"] = None if gained == 0 else 1e3 * busy / gained
    draft_tokens, drafts = _sum(stats, "draft_tokens"), _sum(stats, "drafts")
    if draft_tokens == 0:
        return out
    alpha = _sum(stats, "accepted_tokens") / draft_tokens
    out["acceptance_rate"] = alpha
    out["mean_acceptance_length"] = 1.0 + _sum(stats, "accepted_tokens") / drafts
    out["acceptance_per_position"] = _per_position(stats)
    per_pass = _ratio(_sum(stats, "target_time_s"), passes - len(stats))  # prefills are not verification
    draft_per_token = _sum(stats, "draft_time_s") / draft_tokens
    c = draft_per_token / per_pass if per_pass else None
    out["draft_cost_ratio"] = c
    if c is not None and k is not None:
        out["predicted_speedup"] = predicted_speedup(alpha, k, c)
    return out


def method_metrics(records: Sequence[Record], baseline: Sequence[Record], greedy: bool) -> dict[str, Any]:
    """Every metric of one method in one group (see module doc); ``baseline``: the baseline method's
    records (``target``'s unless :func:`summarize` was given another)."""
    wall = sum(float(r["wall_time_s"]) for r in records)
    new_tokens = sum(int(r["new_tokens"]) for r in records)
    speedup, speedup_mean = speedups(records, baseline)
    has_stats = bool(records) and all(r.get("stats") is not None for r in records)
    k = records[0]["settings"].get("num_speculative_tokens") if records else None
    out: dict[str, Any] = {
        "prompts": len({str(r["question_id"]) for r in records}),
        "turns": len(records),
        "new_tokens": new_tokens,
        "wall_time_s": wall,
        "tokens_per_s": _ratio(new_tokens, wall),
        "speedup": speedup,
        "speedup_mean": speedup_mean,
        "speedup_ci95": speedup_interval(records, baseline),
        "decode_speedup": decode_speedup(records, baseline),
        **stats_metrics([r["stats"] for r in records] if has_stats else [], k),
        "exact": exactness(records, baseline) if greedy else None,
    }
    sizes = [r["proposer_weight_bytes"] for r in records if r.get("proposer_weight_bytes") is not None]
    out["proposer_mb"] = max(sizes) / 1e6 if sizes else None
    out["efficiency"] = _ratio(speedup, out["predicted_speedup"]) if speedup and out["predicted_speedup"] else None
    return out


def check_baseline(baseline: str, methods: Sequence[str], name: str = "baseline") -> None:
    """Check that ``baseline`` is one of ``methods`` (report labels); ``target`` always passes: without
    its records the speedups are None, as in a run of two methods.

    Raises:
        ValueError: naming the parameter (``name``, e.g. ``--baseline``) and the methods allowed.
    """
    if baseline != BASELINE and baseline not in methods:
        raise ValueError(f"{name} must be one of the methods {list(methods)}, got {baseline!r}")


def summarize(
    records: Sequence[Record], methods: Sequence[str], greedy: bool, baseline: str = BASELINE
) -> dict[str, dict[str, Any]]:
    """``{method: {group: metrics}}`` for every method and group with records, plus ``"all"``.

    Args:
        records: every record of the run; methods: the methods to summarize, in order.
        greedy: whether the run was greedy (``exact`` is computed only then, over every repeat; the
            other metrics over each turn's median repeat, :func:`median_repeats`).
        baseline: the method the speedups and ``exact`` compare with (default ``target``).

    Raises:
        ValueError: ``baseline`` other than ``target`` has no records (the message lists the methods
            that have; without ``target`` records the speedups are None, as in a run of two methods).
    """
    check_baseline(baseline, list(dict.fromkeys(r["method"] for r in records)))
    groups = list(dict.fromkeys(r["group"] for r in records))
    timed = median_repeats(records) if greedy else list(records)

    def pick(rows: Sequence[Record], method: str, group: str) -> list[Record]:
        return [r for r in rows if r["method"] == method and group in (ALL, r["group"])]

    summary: dict[str, dict[str, Any]] = {}
    for method in methods:
        if not pick(records, method, ALL):
            continue
        summary[method] = {}
        for group in [*groups, ALL]:
            if in_group := pick(timed, method, group):
                metrics = method_metrics(in_group, pick(timed, baseline, group), greedy)
                if greedy:  # every repeat must be identical, not only the median one
                    metrics["exact"] = exactness(pick(records, method, group), pick(records, baseline, group))
                summary[method][group] = metrics
    return summary
