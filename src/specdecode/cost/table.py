"""Predicted speedups from recorded passes and a pass-cost table measured elsewhere.

Exact decoding makes the tokens, and so the passes each method makes, the same on every machine;
only what a pass costs changes. ``specdecode bench`` records each generation's passes (a record's
``passes``: ``target``, the tokens fed to each target forward, the prefill first; ``draft``, the
tokens fed to each draft-model forward; ``accepted``, draft tokens accepted per step), and this
module prices them with a table of milliseconds per pass measured on another machine.

The table is JSON::

    {
      "device": "NVIDIA H100 80GB HBM3, torch eager bf16",      # free text, shown in the report
      "source": "where and how it was measured",                # optional, free text
      "target": {"1": 15.5, "2": 18.1, "33": 18.8},             # ms per target pass, by tokens fed
      "draft": {"1": 13.4, "2": 15.8, "5": 16.0},               # ms per draft-model pass (optional)
      "eagle": {"1": 0.9, "4": 1.0, "16": 1.1},                 # ms per EAGLE head forward (optional)
      "medusa": {"1": 0.3},                                     # ms per Medusa evaluation (optional)
      "prefill_ms_per_token": 0.05,                             # optional, see below
      "step_ms": 0.43,                                          # optional, see below
      "measurement": {...}                                      # optional, free-form, not read
    }

Widths are positive integers (as JSON keys, strings), costs non-negative milliseconds. A width
between two measured ones costs the linear interpolation; below the smallest, the smallest's cost;
beyond the largest, the line through the last two measured widths (the largest's cost when only one
is given).

Draft passes are priced by the curve named by the record's ``draft_kind`` (the proposer's ``describe()``
``.pass_kind``; records saved before it existed are ``"draft"``): ``draft``, a draft model's forward
over W tokens; ``eagle``, one EAGLE head forward over W tokens through its cache followed by the
drafter's logits of those W rows (a chain of k drafts makes k forwards of width 1 after one of the
newly accepted tokens, a tree one per depth, W its nodes there); ``medusa``, one evaluation of every
Medusa head on one feature (width 1). A table without that curve prices those passes at nothing,
and the prediction names them (:func:`unpriced_drafts`): an upper bound.
The prefill (a record's first target pass) costs ``prefill_ms_per_token`` x its tokens when the
table gives it, else the ``target`` curve at its width (usually far beyond the measured widths,
so an extrapolation; the prefill is the same for every method on the same prompts, so it dilutes
the speedup without changing the order of methods).

``step_ms`` is the host's work per decoding step, outside the passes: sampling, verification, the
proposer's own search, Python, host-device copies. Every target pass after the prefill is one step
and costs ``step_ms`` on top of its pass. It is measured, not modelled: the target alone's
end-to-end time on the table's machine minus its passes' price, over its steps
(``lab/gpu/gpu_check.py`` fits it so). One constant for every method: a proposer whose own search
costs more per step than the target alone's loop (prompt lookup's n-gram match) is still priced a
little under what it costs. Without ``step_ms`` that work is free.

Not priced: the drafts of proposers that record no passes (early exit, the cross-tokenizer draft),
and, without ``step_ms``, the host's work per step. A predicted speedup is then an upper bound for
methods with much per-step overhead.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdecode.bench.metrics import ALL, BASELINE, Record, median_repeats, speedups

DRAFT_KINDS = ("draft", "eagle", "medusa")
"""The draft-pass curves a table may give (``ProposerInfo.pass_kind``: a proposer's ``describe()``)."""

PACKAGED = Path(__file__).resolve().parent.parent / "data" / "cost_tables"
"""The cost tables shipped with the package (``--cost-table NAME`` finds ``NAME.json`` here)."""


@dataclass(frozen=True)
class CostCurve:
    """Milliseconds per pass by tokens fed, piecewise linear through measured points.

    Attributes:
        widths: measured widths (tokens per pass), ascending, >= 1.
        ms: the cost of each, milliseconds (>= 0).
    """

    widths: tuple[int, ...]
    ms: tuple[float, ...]

    def __call__(self, width: int) -> float:
        """The cost of one pass over ``width`` tokens, in milliseconds (0 for ``width`` <= 0)."""
        if width <= 0:
            return 0.0
        w, m = self.widths, self.ms
        if width <= w[0]:
            return m[0]
        if len(w) == 1:
            return m[0]
        for i in range(1, len(w)):
            if width <= w[i]:
                return m[i - 1] + (m[i] - m[i - 1]) * (width - w[i - 1]) / (w[i] - w[i - 1])
        slope = (m[-1] - m[-2]) / (w[-1] - w[-2])  # beyond the largest: the last segment's line
        return max(0.0, m[-1] + slope * (width - w[-1]))


@dataclass(frozen=True)
class CostTable:
    """A loaded pass-cost table (see the module docstring for the JSON format).

    Attributes:
        device: where it was measured (free text).
        target: the target's cost per pass (ms).
        draft: the draft model's cost per pass (ms), or None (draft passes cost nothing).
        eagle: an EAGLE head's cost per forward with its logits (ms), or None (free).
        medusa: the cost of one evaluation of every Medusa head (ms), or None (free).
        prefill_ms_per_token: the prefill's cost per prompt token (ms), or None (the target curve).
        source: how it was measured (free text, may be empty).
        step_ms: the host's work per decoding step outside the passes (ms), or None (free).
    """

    device: str
    target: CostCurve
    draft: CostCurve | None = None
    prefill_ms_per_token: float | None = None
    source: str = ""
    eagle: CostCurve | None = None
    medusa: CostCurve | None = None
    step_ms: float | None = None

    def drafts(self, kind: str) -> CostCurve | None:
        """The curve that prices draft passes of ``kind`` (``draft``, ``eagle``, ``medusa``), or None
        (those passes cost nothing: the table does not have it, or the kind is unknown)."""
        return {"draft": self.draft, "eagle": self.eagle, "medusa": self.medusa}.get(kind)


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"cost table: {where} must be a non-negative number of milliseconds, got {value!r}")
    return float(value)


def _curve(value: Any, field: str) -> CostCurve:
    if not isinstance(value, Mapping) or not value:
        raise ValueError(f"cost table: {field!r} must be a non-empty object of width -> ms, got {value!r}")
    points: dict[int, float] = {}
    for key, ms in value.items():
        try:
            width = int(key)
        except (TypeError, ValueError):
            width = 0
        if width < 1 or str(width) != str(key).strip():
            raise ValueError(f'cost table: {field!r} has width {key!r}; widths are positive integers such as "1"')
        points[width] = _number(ms, f"{field}[{key!r}]")
    ordered = sorted(points)
    return CostCurve(tuple(ordered), tuple(points[w] for w in ordered))


def parse_cost_table(data: Any) -> CostTable:
    """A :class:`CostTable` from the decoded JSON.

    Raises:
        ValueError: not an object, ``device`` missing or not text, ``target`` missing or empty, a
            width that is not a positive integer, a cost that is not a non-negative number, or
            ``prefill_ms_per_token`` or ``step_ms`` not a non-negative number (the message names the
            field).
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"cost table: expected a JSON object, got {type(data).__name__}")
    device = data.get("device")
    if not isinstance(device, str) or not device.strip():
        raise ValueError(f"cost table: 'device' must be a non-empty string, got {device!r}")
    if "target" not in data:
        raise ValueError("cost table: 'target' is missing (ms per target pass by tokens fed, e.g. {\"1\": 15.5})")
    known = {"device", "source", "target", *DRAFT_KINDS, "prefill_ms_per_token", "step_ms", "measurement"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"cost table: unknown field(s) {unknown}; known: {sorted(known)}")
    prefill = data.get("prefill_ms_per_token")
    step = data.get("step_ms")
    source = data.get("source", "")
    if not isinstance(source, str):
        raise ValueError(f"cost table: 'source' must be a string, got {source!r}")
    return CostTable(
        device=device,
        target=_curve(data["target"], "target"),
        draft=_curve(data["draft"], "draft") if data.get("draft") is not None else None,
        eagle=_curve(data["eagle"], "eagle") if data.get("eagle") is not None else None,
        medusa=_curve(data["medusa"], "medusa") if data.get("medusa") is not None else None,
        prefill_ms_per_token=_number(prefill, "'prefill_ms_per_token'") if prefill is not None else None,
        source=source,
        step_ms=_number(step, "'step_ms'") if step is not None else None,
    )


def load_cost_table(path: str | Path) -> CostTable:
    """Read a cost table: a JSON file, or the name of a packaged one (``h100-torch-eager-bf16``).

    Raises:
        FileNotFoundError: neither a file nor a packaged table.
        ValueError: not JSON, or an invalid table (:func:`parse_cost_table`).
    """
    file = Path(path)
    if not file.is_file() and (PACKAGED / f"{path}.json").is_file():
        file = PACKAGED / f"{path}.json"
    if not file.is_file():
        names = ", ".join(sorted(p.stem for p in PACKAGED.glob("*.json")))
        raise FileNotFoundError(f"--cost-table: no file {path} (packaged tables: {names or 'none'})")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"cost table {file}: not JSON ({error})") from error
    try:
        return parse_cost_table(data)
    except ValueError as error:
        raise ValueError(f"{file}: {error}") from error


def price(record: Record, table: CostTable) -> float | None:
    """The predicted seconds of one record's passes on ``table``'s machine, or None when the record
    has no ``passes`` (a peer whose passes are not known, or results saved before they were recorded).

    Seconds = (prefill + Σ target passes after it + Σ draft passes + steps x ``step_ms``) / 1000,
    each pass's ms from the table by its width: draft passes on the curve of the record's
    ``draft_kind`` (none: free), one step per target pass after the prefill (the module docstring
    says how the prefill is priced).
    """
    passes = record.get("passes")
    if not passes or not passes.get("target"):
        return None
    target: Sequence[int] = passes["target"]
    prefill = target[0]
    ms = prefill * table.prefill_ms_per_token if table.prefill_ms_per_token is not None else table.target(prefill)
    ms += sum(table.target(w) for w in target[1:])
    if table.step_ms is not None:
        ms += table.step_ms * (len(target) - 1)
    curve = table.drafts(passes.get("draft_kind") or "draft")
    if curve is not None:
        ms += sum(curve(w) for w in passes.get("draft") or ())
    return ms / 1000.0


def unpriced_drafts(records: Sequence[Record], table: CostTable) -> dict[str, list[str]]:
    """Per method, the kinds of draft passes its records made that ``table`` has no curve for (so
    they were priced at nothing and its prediction is an upper bound); methods without any left out."""
    out: dict[str, set[str]] = {}
    for r in records:
        passes = r.get("passes") or {}
        kind = passes.get("draft_kind") or "draft"
        if passes.get("draft") and table.drafts(kind) is None:
            out.setdefault(r["method"], set()).add(kind)
    return {method: sorted(kinds) for method, kinds in out.items()}


def _pick(records: Sequence[Record], method: str, group: str) -> list[Record]:
    return [r for r in records if r["method"] == method and group in (ALL, r["group"])]


def predict(
    records: Sequence[Record],
    methods: Sequence[str],
    table: CostTable,
    baseline: str = BASELINE,
    greedy: bool = True,
) -> dict[str, dict[str, dict[str, float | None]]]:
    """Predicted beside measured speedups over ``baseline``, per method and category group.

    Returns ``{method: {group: {"predicted": x, "measured": y}}}`` with groups in record order and
    ``"all"`` last: predicted = Σ priced seconds of ``baseline`` / Σ priced seconds of the method,
    measured = the same ratio of wall times, both over the turns both ran (and, for the prediction,
    both priced). None where a method has no priced records. A greedy run's repeats count once per
    turn, by the repeat of median wall time (:func:`~specdecode.bench.metrics.median_repeats`), as in
    the measured metrics.
    """
    if greedy:
        records = median_repeats(records)
    groups = [*dict.fromkeys(r["group"] for r in records), ALL]
    priced = []
    for r in records:
        seconds = price(r, table)
        if seconds is not None:
            priced.append({**r, "wall_time_s": seconds})
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for method in methods:
        out[method] = {}
        for group in groups:
            mine, base = _pick(records, method, group), _pick(records, baseline, group)
            if not mine:
                continue
            out[method][group] = {
                "predicted": speedups(_pick(priced, method, group), _pick(priced, baseline, group))[0],
                "measured": speedups(mine, base)[0],
            }
    return out


def prediction_table(prediction: Mapping[str, Mapping[str, Mapping[str, float | None]]], table: CostTable,
                     baseline: str = BASELINE, unpriced: Mapping[str, Sequence[str]] | None = None) -> str:  # fmt: skip
    """Markdown: one row per method, one column per group, ``predicted (measured)`` speedups; a
    method in ``unpriced`` (:func:`unpriced_drafts`) is marked, with a note naming the curves missing."""
    unpriced = unpriced or {}
    groups = list(dict.fromkeys(g for by_group in prediction.values() for g in by_group))
    if ALL in groups:
        groups = [g for g in groups if g != ALL] + [ALL]

    def cell(m: Mapping[str, float | None] | None) -> str:
        if not m:
            return "-"
        predicted = f"{m['predicted']:.2f}x" if m.get("predicted") is not None else "-"
        measured = f"{m['measured']:.2f}x" if m.get("measured") is not None else "-"
        return f"{predicted} ({measured})"

    lines = [
        f"## Predicted speedup over `{baseline}` on {table.device} (measured here)",
        "| method | " + " | ".join(groups) + " |",
        "| " + " | ".join(["---"] * (len(groups) + 1)) + " |",
    ]
    for method, by_group in prediction.items():
        mark = " *" if unpriced.get(method) else ""
        lines.append(f"| {method}{mark} | " + " | ".join(cell(by_group.get(g)) for g in groups) + " |")
    lines.append("")
    lines.append("Priced from each generation's recorded passes (specdecode.cost.table); '-': passes not known.")
    if table.step_ms is None:
        lines.append("The host's work per step is not priced (the table has no 'step_ms'): upper bounds.")
    else:
        lines.append(f"Each step after the prefill adds the host's {table.step_ms:g} ms (the table's 'step_ms').")
    for method, kinds in unpriced.items():
        if method in prediction:
            missing = ", ".join(f"'{k}'" for k in kinds)
            note = f"the table has no {missing} curve"
            lines.append(f"* {method}: its draft passes are not priced ({note}): an upper bound.")
    return "\n".join(lines) + "\n"


def prediction_results(results: Mapping[str, Any], table: CostTable, source: str,
                       baseline: str = BASELINE) -> dict[str, Any]:  # fmt: skip
    """What ``results.json`` keeps under ``predicted``: the table's device and file, the baseline,
    :func:`predict`'s speedups, :func:`unpriced_drafts` and the table's ``step_ms`` (None: not priced)."""
    return {
        "cost_table": str(source),
        "device": table.device,
        "step_ms": table.step_ms,
        "baseline": baseline,
        "speedup": predict(results["records"], results["methods"], table, baseline, results.get("greedy", True)),
        "unpriced_drafts": unpriced_drafts(results["records"], table),
    }
