"""``specdecode calibrate-early-exit``: measure candidate exit layers of a target; save the fastest
(:mod:`specdecode.calibrate`).

Example::

    specdecode calibrate-early-exit --layers 4,8,12,16,20 --num-prompts 4 --max-new-tokens 48 -k 4
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from specdecode.calibrate import (
    DEFAULT_K,
    DEFAULT_MAX_NEW_TOKENS,
    calibrate_early_exit,
    check_layers,
    load_prompts,
    parse_layers,
    render_table,
)
from specdecode.commands.common import add_command_parser, add_dtype_arg


def add_calibrate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``calibrate-early-exit`` subcommand to ``subparsers`` (from ``add_subparsers``)."""
    c = add_command_parser(
        subparsers,
        "calibrate-early-exit",
        "measure early-exit layers of the target on sample prompts; save the fastest",
    )
    c.add_argument("--target", help="target: HF model folder or .gguf file (default: Qwen2.5-Coder-1.5B-Instruct)")
    add_dtype_arg(c)
    c.add_argument(
        "--layers",
        metavar="LIST",
        help="comma list of exit layers, e.g. 4,8,12 (default: up to 3/4 of the depth, every layer up to 8 "
        "layers, every 2nd up to 16, else every 4th)",
    )
    c.add_argument(
        "--prompts",
        metavar="FILE",
        help="prompts file: .jsonl, a 'prompt' per line, or text, prompts separated by blank lines (default: a "
        "built-in mix of code and prose)",
    )
    c.add_argument(
        "--num-prompts", type=int, default=None, metavar="N", help="use only the first N prompts (default: all)"
    )
    c.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        metavar="N",
        help=f"new tokens per prompt at most (default {DEFAULT_MAX_NEW_TOKENS})",
    )
    c.add_argument(
        "-k",
        "--num-speculative-tokens",
        type=int,
        default=DEFAULT_K,
        metavar="K",
        help=f"tokens drafted per step (default {DEFAULT_K})",
    )
    c.add_argument("--no-save", action="store_true", help="measure only; do not save the chosen layer")
    c.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    c.set_defaults(func=cmd_calibrate)
    return c


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure the exit layers on the prompts, print the table (or ``--json``), save the fastest."""
    from rich.console import Console

    from specdecode.limits import check_num_speculative_tokens
    from specdecode.models.torch.hf_loading import load_model, load_tokenizer, parse_dtype, resolve_model_dir
    from specdecode.sampling import SamplingParams

    layers = parse_layers(args.layers) if args.layers is not None else None  # cheap checks before loading
    check_num_speculative_tokens(args.num_speculative_tokens)
    SamplingParams(max_new_tokens=args.max_new_tokens)
    parse_dtype(args.dtype)
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    prompts = load_prompts(args.prompts)[: args.num_prompts]
    target_dir = resolve_model_dir(args.target, "target")
    target = load_model(target_dir, "target", args.dtype)
    if layers is not None:
        check_layers(layers, int(target.config.num_hidden_layers), name="--layers")
    err = Console(stderr=True)
    result = calibrate_early_exit(
        target,
        tokenizer=load_tokenizer(target_dir),
        layers=layers,
        prompts=prompts,
        max_new_tokens=args.max_new_tokens,
        num_speculative_tokens=args.num_speculative_tokens,
        save=not args.no_save,
        progress=lambda line: err.print(line, highlight=False),
    )
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    out = Console()
    if not out.is_terminal:
        out = Console(width=120)  # a file or pipe: room for the table's columns
    out.print(render_table(result))
    saved = f"saved to {result.saved_to}" if result.saved_to else "not saved (--no-save)"
    print(f"chosen exit layer: {result.exit_layer} ({saved})", file=sys.stdout)
    best = max(r.measured_speedup for r in result.rows)
    if best < 1.0:
        print(
            f"note: no exit layer was faster than the target alone here (best {best:.2f}x); without "
            "early-exit training (LayerSkip) shallow layers rarely agree with the full model.",
            file=sys.stdout,
        )
    return 0
