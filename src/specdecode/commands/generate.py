"""``specdecode generate``: one prompt, streamed, with decoding statistics."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from specdecode.commands.common import (
    PROPOSER_KS,
    add_backend_args,
    add_command_parser,
    add_model_args,
    add_proposer_args,
    backend_options,
    given_proposer_options,
)
from specdecode.commands.constraint_args import add_constraint_args, constraint_from_args


def add_generate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``generate`` subcommand to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    g = add_command_parser(
        subparsers,
        "generate",
        "generate text for one prompt, streaming, with statistics",
    )
    g.add_argument("prompt", help="the prompt, in the chat template unless --raw")
    add_model_args(g)
    add_backend_args(g)
    add_sampling_args(g, max_new_tokens=256)
    add_proposer_args(g, auto=True)
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--no-speculation", action="store_true", help="decode with the target alone (same loop)")
    g.add_argument("--compare", action="store_true", help="also run the target alone; report speedup and identity")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="with --json: each token's log-probability and the N (0-20) likeliest alternatives, from the "
        "target's raw distribution (before temperature, top-k, top-p)",
    )
    g.add_argument(
        "--prediction",
        default=None,
        metavar="FILE",
        help="the expected answer (a text file, '-' for standard input): its tokens are drafted where the "
        "answer follows it (OpenAI's Predicted Outputs; edits of a file), the proposer drafts elsewhere; "
        "the output is still the target's own",
    )
    add_constraint_args(g)
    g.set_defaults(func=cmd_generate)
    return g


def add_sampling_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """``--temperature --top-k --top-p --seed --max-new-tokens -k --schedule --tree``."""
    p.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="sampling temperature (default 0: greedy)"
    )
    p.add_argument("--top-k", type=int, default=0, metavar="N", help="keep the N likeliest tokens (default 0: off)")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="nucleus sampling: the likeliest tokens up to mass P (default 1.0: off)",
    )
    p.add_argument("--seed", type=int, default=None, metavar="N", help="sampling seed (default: a random one)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=max_new_tokens,
        metavar="N",
        help=f"new tokens at most (default {max_new_tokens})",
    )
    p.add_argument(
        "-k",
        "--num-speculative-tokens",
        type=int,
        default=None,
        metavar="K",
        help="tokens drafted per step, the starting k of a varying schedule (default: the proposer's own, "
        f"measured best: {PROPOSER_KS})",
    )
    p.add_argument(
        "--schedule",
        default="constant",
        choices=["constant", "heuristic", "adaptive", "ungated"],
        help="k per step: constant (default), heuristic (grow after full acceptance, shrink after a "
        "rejection), adaptive (heuristic + measured fallback to plain decoding); constant and heuristic pass "
        "greedy copied drafts (prompt lookup, --prediction) through the draft gate (sent only as far as "
        "measured acceptance and pass costs say they pay), ungated is constant without it",
    )
    p.add_argument(
        "--tree",
        default=None,
        metavar="TREE",
        help="draft a token tree instead of a chain (default: a chain): a shape name ('default', tree8 .. "
        "tree32), a JSON file of rank paths, or dynamic:N[:D:K] (EAGLE-2, N nodes); proposers draft_model, "
        "prompt_lookup, eagle, medusa, early_exit; both backends (llama.cpp walks the tree: exact)",
    )


def sampling_from_args(args: argparse.Namespace) -> Any:
    """:class:`~specdecode.sampling.SamplingParams` from the parsed flags (validated)."""
    from specdecode.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop=tuple(getattr(args, "stop", None) or ()),
    )


def print_stats(stats: dict[str, Any]) -> None:
    """A readable table of the decoding statistics on stderr."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="decoding statistics", show_header=False)
    for key, value in stats.items():
        if key in ("text", "token_ids"):
            continue
        if isinstance(value, float):
            value = f"{value:.3f}"
        elif isinstance(value, list):
            value = ", ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in value)
        table.add_row(key, str(value))
    Console(stderr=True).print(table)


def read_prediction(path: str | None) -> str | None:
    """The text of ``--prediction FILE`` (``-``: standard input), or None without the flag.

    Raises:
        ValueError: the file cannot be read or is not UTF-8 text (the message names ``--prediction``).
    """
    if path is None:
        return None
    import sys
    from pathlib import Path

    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--prediction: cannot read {path!r} as UTF-8 text ({error})") from None


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate for one prompt: stream the text (or ``--json``), then the statistics.

    The request (prompt, k, tree, log-probabilities, constraint) is checked once, then the load is
    planned (:func:`specdecode.load.plan_models`: backend resolved once, proposer chosen, paths and
    options checked), all before any weights load.
    """
    from specdecode.engine import SpeculativeGenerator, check_request
    from specdecode.load import load_models, plan_models

    sampling = sampling_from_args(args)  # validate cheap input before loading anything
    names = {"prompt": "prompt", "logprobs": "--logprobs", "prediction": "--prediction"}
    prediction = read_prediction(args.prediction)
    request = check_request(args.prompt, args.num_speculative_tokens, args.tree, args.logprobs, names, prediction)
    if args.logprobs is not None and not args.json:
        raise ValueError("--logprobs needs --json (the log-probabilities are a field of its output)")
    constraint = constraint_from_args(args)  # --json-schema / --regex / --grammar, checked before loading
    proposer = None if args.no_speculation else args.proposer
    plan = plan_models(
        args.target,
        args.draft,
        proposer,
        dtype=args.dtype,
        device=args.device,
        cuda_graphs=args.cuda_graphs,
        **backend_options(args),
        **({} if args.no_speculation else given_proposer_options(args)),
    )
    generator = SpeculativeGenerator.from_loaded(load_models(plan))
    generator.reuse_prompt = not args.compare  # --compare times the target alone on the same prompt: in full
    call = dict(sampling=sampling, raw=args.raw, schedule=args.schedule, constraint=constraint)
    speculative = not args.no_speculation
    stream = generator.stream_request(args.prompt, request, speculative=speculative, **call)
    if args.json:
        for _, _, result in stream:
            pass
    else:
        for _, piece, result in stream:
            print(piece, end="", flush=True)
        print()
    out = result.to_dict(generator.tokenizer)  # with --logprobs: "logprobs", each token with its text
    if args.compare:
        plain = dataclasses.replace(request, logprobs=None)
        for _, _, baseline in generator.stream_request(args.prompt, plain, speculative=False, **call):
            pass
        out["baseline_tokens_per_second"] = baseline.stats.tokens_per_second
        out["speedup"] = baseline.stats.wall_time_s / result.stats.wall_time_s
        out["identical"] = baseline.token_ids == result.token_ids
    if args.json:
        print(json.dumps(out))
    else:
        print_stats(out)
    return 0
