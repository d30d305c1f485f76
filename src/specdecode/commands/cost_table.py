"""``specdecode cost-table``: measure a pass-cost table on this machine
(:mod:`specdecode.cost.measure`), to price recorded passes with ``specdecode bench --report
RESULTS --cost-table FILE``.

Example::

    specdecode cost-table --out my-gpu.json
    specdecode bench --report lab/results/issue42-h100/prediction-heads/results.json --cost-table my-gpu.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from specdecode.commands.common import add_backend_args, add_command_parser, add_model_args


def _widths(text: str) -> tuple[int, ...]:
    """``"1,2,9"`` -> ``(1, 2, 9)``; argparse turns the ValueError into a usage error."""
    try:
        widths = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,2,9, got {text!r}") from None
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"expected widths >= 1 such as 1,2,9, got {text!r}")
    return widths


def add_cost_table_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``cost-table`` subcommand to ``subparsers`` (from ``add_subparsers``)."""
    from specdecode.cost.measure import DEFAULT_DRAFT_WIDTHS, DEFAULT_WIDTHS, CostSettings

    defaults = CostSettings()
    c = add_command_parser(
        subparsers,
        "cost-table",
        "measure what a pass of the target (and the draft) costs here, by tokens fed, and the host's work per "
        "decoding step: a cost table for 'specdecode bench --cost-table', which prices the passes a bench run "
        "recorded (on any machine, with exact decoding the same passes) to predict every method's speedup here",
    )
    add_model_args(c)
    add_backend_args(c)
    c.add_argument("--no-draft", action="store_true", help="measure the target only (no 'draft' curve)")
    c.add_argument(
        "--random-weights",
        action="store_true",
        help="torch: models of the same architecture with random weights (a folder's config.json, or the default "
        "pair's, shipped): the same pass costs, without the weights on this machine",
    )
    c.add_argument("--out", required=True, metavar="FILE", help="where to write the table (JSON)")
    c.add_argument(
        "--widths",
        type=_widths,
        default=DEFAULT_WIDTHS,
        metavar="LIST",
        help=f"target pass widths (default {','.join(map(str, DEFAULT_WIDTHS))})",
    )
    c.add_argument(
        "--draft-widths",
        type=_widths,
        default=DEFAULT_DRAFT_WIDTHS,
        metavar="LIST",
        help=f"draft pass widths (default {','.join(map(str, DEFAULT_DRAFT_WIDTHS))})",
    )
    c.add_argument(
        "--depth", type=int, default=defaults.depth, metavar="N", help=f"tokens cached first (default {defaults.depth})"
    )
    c.add_argument(
        "--prefill",
        type=int,
        default=defaults.prefill,
        metavar="N",
        help=f"prompt tokens of the prefill and the step fit (default {defaults.prefill})",
    )
    c.add_argument(
        "--reps", type=int, default=defaults.reps, metavar="N", help=f"timed passes per width (default {defaults.reps})"
    )
    c.add_argument(
        "--step-tokens",
        type=int,
        default=defaults.step_tokens,
        metavar="N",
        help=f"new tokens of the target-alone runs that fit step_ms; 0: no step_ms (default {defaults.step_tokens})",
    )
    c.set_defaults(func=cmd_cost_table)
    return c


def cmd_cost_table(args: argparse.Namespace) -> int:
    """Load the models through the one load path, measure, write ``--out``, print the curves."""
    from specdecode.commands.common import backend_options
    from specdecode.cost.measure import CostSettings, measure_cost_table
    from specdecode.cost.table import parse_cost_table
    from specdecode.load import load_models, load_random_models, plan_bench_models

    settings = CostSettings(widths=args.widths, draft_widths=args.draft_widths, depth=args.depth,
                            prefill=args.prefill, reps=args.reps, step_tokens=args.step_tokens)  # fmt: skip
    out = Path(args.out)
    if out.is_dir():
        raise ValueError(f"--out {out} is a folder; give a file such as {out / 'cost-table.json'}")
    options = backend_options(args)
    if args.random_weights:
        target, draft = load_random_models(args.target, args.draft, options["backend"], args.dtype,
                                           need_draft=not args.no_draft, device=args.device,
                                           cuda_graphs=args.cuda_graphs, exact=options["exact"])  # fmt: skip
        backend = "torch"
    else:
        plan = plan_bench_models(
            args.target, args.draft, options["backend"], args.dtype, options["threads"], options["exact"],
            need_draft=not args.no_draft, device=args.device, cuda_graphs=args.cuda_graphs,
        )  # fmt: skip
        loaded = load_models(plan)
        target, draft, backend = loaded.target, loaded.draft, plan.backend
    command = "specdecode " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["cost-table"] else ""
    print(f"cost-table: measuring {backend} passes (this takes a minute or more)", file=sys.stderr)
    note = "random weights of the models' architectures" if args.random_weights else ""
    table = measure_cost_table(target, draft, settings, command=command, note=note)
    parse_cost_table(table)  # what bench --cost-table will read back
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    print(f"## Pass costs on {table['device']}")
    for role in ("target", "draft"):
        if role in table:
            cells = ", ".join(f"{w}: {ms:.2f}" for w, ms in table[role].items())
            print(f"- {role}, ms by tokens fed: {cells}")
    print(f"- prefill: {table['prefill_ms_per_token']:.3f} ms per token")
    if "step_ms" in table:
        print(f"- the host's work per decoding step: {table['step_ms']:.3f} ms")
    print(f"\nWrote {out}. Price a bench run's recorded passes with it:\n"
          f"  specdecode bench --report RESULTS.json --cost-table {out}")  # fmt: skip
    return 0

