"""The arguments several commands share: models, dtype, backend, proposer and its options."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

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
