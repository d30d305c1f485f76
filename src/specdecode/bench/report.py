"""Render a benchmark's results: Markdown tables and PNG plots (matplotlib, Agg backend).

Everything here reads only the saved results (``results.json``), so ``specdecode bench --report``
re-renders without models.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdecode.bench.metrics import ALL, BASELINE, summarize

PACKAGED_RESULTS = Path(__file__).resolve().parent.parent / "data" / "recorded"
"""Bench runs that ship with the package (``<name>.json.gz``), for ``--report NAME --cost-table FILE``."""
SPEEDUP_PNG = "speedup.png"
ACCEPTANCE_PNG = "acceptance_per_position.png"
SAMPLED_NOTE = (
    "Sampled decoding: exactness is distributional (the output follows the target's distribution), "
    "covered by the statistical tests, not by comparing tokens here."
)
COLUMNS = [  # (metric key, header, format)
    ("prompts", "prompts", "{:d}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("speedup_mean", "mean per-prompt speedup", "{:.2f}x"),
    ("speedup_ci95", "speedup 95% CI", "{:.2f}-{:.2f}x"),
    ("decode_speedup", "decode speedup (TPOT)", "{:.2f}x"),
    ("tokens_per_s", "tokens/s", "{:.1f}"),
    ("mean_acceptance_length", "mean acceptance length", "{:.2f}"),
    ("acceptance_rate", "acceptance rate", "{:.2f}"),
    ("acceptance_per_position", "per-position acceptance", None),
    ("target_passes_per_token", "target passes / token", "{:.2f}"),
    ("cost_per_token_ms", "cost / token (ms)", "{:.1f}"),
    ("draft_cost_ratio", "c", "{:.3f}"),
    ("predicted_speedup", "predicted speedup", "{:.2f}x"),
    ("efficiency", "efficiency", "{:.2f}"),
    ("proposer_mb", "proposer weights (MB)", "{:.0f}"),
    ("exact", "exact", "{:.0%}"),
]


def load_results(path: str | Path) -> dict[str, Any]:
    """Read ``results.json`` (gzipped where the name ends in ``.gz``), or a run that ships with the
    package by its name (:data:`PACKAGED_RESULTS`: ``default-pair-coding-humaneval``, the default
    pair's passes recorded for pricing with ``--cost-table``).

    Raises:
        FileNotFoundError: neither a file nor a packaged run (the message lists the packaged ones).
        ValueError: not a benchmark results file.
    """
    file = Path(path)
    if not file.is_file() and (PACKAGED_RESULTS / f"{path}.json.gz").is_file():
        file = PACKAGED_RESULTS / f"{path}.json.gz"
    if not file.is_file():
        names = ", ".join(sorted(p.name.removesuffix(".json.gz") for p in PACKAGED_RESULTS.glob("*.json.gz")))
        raise FileNotFoundError(f"--report: no file {path} (packaged runs: {names or 'none'})")
    raw = file.read_bytes()
    data = json.loads(gzip.decompress(raw) if file.name.endswith(".gz") else raw.decode("utf-8"))
    if not isinstance(data, dict) or "records" not in data or "methods" not in data:
        raise ValueError(f"{path} is not a specdecode bench results.json (no 'records' / 'methods')")
    return data


def _cell(value: Any, fmt: str | None) -> str:
    if value is None:
        return "-"
    if fmt is None:
        return " ".join(f"{v:.2f}" for v in value)
    return fmt.format(*value) if isinstance(value, list | tuple) else fmt.format(value)


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def speedup_table(summary: dict[str, dict[str, Any]], groups: Sequence[str]) -> str:
    """Spec-Bench's view: one row per method, one column per group, ``speedup (mean acceptance length)``."""
    lines = [_row(["method", *groups]), _row(["---"] * (len(groups) + 1))]
    for method, by_group in summary.items():
        cells = []
        for group in groups:
            m = by_group.get(group, {})
            cell = _cell(m.get("speedup"), "{:.2f}x")
            if m.get("mean_acceptance_length") is not None:
                cell += f" ({m['mean_acceptance_length']:.2f})"
            cells.append(cell)
        lines.append(_row([method, *cells]))
    return "\n".join(lines)


def detail_table(summary: dict[str, dict[str, Any]], groups: Sequence[str]) -> str:
    """Every metric, one row per group and method."""
    lines = [_row(["category", "method", *(c[1] for c in COLUMNS)]), _row(["---"] * (len(COLUMNS) + 2))]
    for group in groups:
        for method, by_group in summary.items():
            if group in by_group:
                lines.append(_row([group, method, *(_cell(by_group[group][key], fmt) for key, _, fmt in COLUMNS)]))
    return "\n".join(lines)


def markdown(results: dict[str, Any], summary: dict[str, dict[str, Any]], baseline: str = BASELINE) -> str:
    """The whole report: settings, skipped methods, the speedup table and the detail table; speedups,
    their intervals and ``exact`` are over ``baseline``."""
    groups = [*dict.fromkeys(r["group"] for r in results["records"]), ALL]
    settings = ", ".join(f"{k}={v}" for k, v in results.get("settings", {}).items())
    title = f"## Speedup over `{baseline}` (mean acceptance length)"
    parts = ["# specdecode bench", f"Settings: {settings}", "", title]
    parts += [speedup_table(summary, groups), "", "## All metrics", detail_table(summary, groups), ""]
    parts.append("Metric definitions: `specdecode.bench.metrics` (module docstring).")
    for method, reason in results.get("skipped", {}).items():
        parts.append(f"- skipped `{method}`: {reason}")
    if not results.get("greedy", True):
        parts.append(SAMPLED_NOTE)
    return "\n".join(parts) + "\n"


def plot_speedup(
    summary: dict[str, dict[str, Any]], groups: Sequence[str], path: Path, baseline: str = BASELINE
) -> None:
    """Grouped bars: speedup over ``baseline`` per group (x) and method (bars); 1x dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in summary if m != baseline]
    fig, ax = plt.subplots(figsize=(min(16.0, max(6.0, 2.0 + 0.3 * len(groups) * max(1, len(methods)))), 4.5))
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        values = [summary[method].get(g, {}).get("speedup") or 0.0 for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=method)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(groups))], list(groups), rotation=30)
    ax.set_ylabel(f"speedup over {baseline} (x)")
    ax.set_title("Speedup per category")
    if methods:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_acceptance(summary: dict[str, dict[str, Any]], path: Path) -> None:
    """Lines: per-position acceptance (all groups) against draft position, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, by_group in summary.items():
        rates = by_group.get(ALL, {}).get("acceptance_per_position")
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=method)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate at position")
    ax.set_ylim(0, 1.05)
    ax.set_title("Per-position acceptance (all categories)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render(results: dict[str, Any], out_dir: str | Path, baseline: str = BASELINE) -> str:
    """Compute the metrics, write ``report.md`` and both PNGs into ``out_dir``; return the Markdown.

    ``baseline``: the method speedups are measured against (default ``target``).

    Raises:
        ValueError: ``baseline`` is not a method of the results (see :func:`summarize`).
    """
    out = Path(out_dir)
    summary = summarize(results["records"], results["methods"], results.get("greedy", True), baseline)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(results, summary, baseline)
    (out / "report.md").write_text(text, encoding="utf-8")
    groups = [*dict.fromkeys(r["group"] for r in results["records"]), ALL]
    plot_speedup(summary, groups, out / SPEEDUP_PNG, baseline)
    plot_acceptance(summary, out / ACCEPTANCE_PNG)
    return text
