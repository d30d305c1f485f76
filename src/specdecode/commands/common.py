"""The arguments several commands share: models, dtype, backend, proposer and its options."""

from __future__ import annotations

import argparse
import dataclasses
import re
import textwrap
from typing import Any

from specdecode.commands.registry import COMMANDS

DEFAULT_K = 4  # = proposers.base.DEFAULT_NUM_SPECULATIVE_TOKENS (tested; not imported: this module loads no torch)
# the proposers' own k, as the -k help of generate, serve and bench gives it
PROPOSER_KS = f"{DEFAULT_K}; eagle and medusa 2; prompt_lookup 8; 8 behind prompt lookup"
# the metavar of a proposer option: the field's metadata "metavar", else this table, else by type
OPTION_METAVARS = {"token_map": "MAP", "drafter": "DIR", "draft_quantization": "MODE", "head_quantization": "MODE"}
TYPE_METAVARS: dict[type, str] = {int: "N", float: "X", str: "VALUE"}


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, wrapping at spaces only (an option named in a help text,
    ``--prompt-lookup-min``, is never split at its hyphens) and never inside ``(default X``,
    ``(default: X`` or ``A = B`` (so no line starts with a default's lone value)."""

    @staticmethod
    def _wrap(text: str, width: int, indent: str = "") -> list[str]:
        glued = re.sub(r"\(default:? ", lambda m: m.group(0)[:-1] + "\0", " ".join(text.split()))
        glued = glued.replace(" = ", "\0=\0")
        lines = textwrap.wrap(glued, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False)
        return [line.replace("\0", " ") for line in lines]

    def _split_lines(self, text: str, width: int) -> list[str]:
        return self._wrap(text, width)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(self._wrap(text, width, indent))


def add_command_parser(subparsers: Any, name: str, description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand's parser, its help wrapped by :class:`HelpFormatter`.

    Args:
        subparsers: from ``ArgumentParser.add_subparsers``.
        name: the command, a key of :data:`specdecode.commands.registry.COMMANDS` (which holds its
            line in ``specdecode --help``).
        description: the opening of its own ``--help`` (default: its summary).
    """
    summary = COMMANDS[name].summary
    return subparsers.add_parser(name, help=summary, description=description or summary, formatter_class=HelpFormatter)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--target --draft --dtype``, shared by every command that loads models."""
    p.add_argument("--target", help="target: HF model folder or .gguf file (default: Qwen2.5-Coder-1.5B-Instruct)")
    p.add_argument(
        "--draft",
        help="draft: HF model folder, .gguf file or packaged name; smollm2 is SmolLM2-135M-Instruct, another "
        "tokenizer, drafting through cross_tokenizer (default: Qwen2.5-Coder-0.5B-Instruct)",
    )
    add_dtype_arg(p)
    p.add_argument(
        "--device",
        default="auto",
        metavar="{auto,cpu,cuda,cuda:N,mps}",
        help="where torch runs the models; auto (default): the CUDA GPU where torch sees one, else the CPU "
        "(cpu also keeps a CUDA llama.cpp build's layers on the CPU)",
    )
    p.add_argument(
        "--cuda-graphs",
        default=True,
        action=argparse.BooleanOptionalAction,
        help="torch on a CUDA GPU: static KV cache and CUDA graphs per pass width (default); --no-cuda-graphs: "
        "eager passes",
    )


def add_dtype_arg(p: argparse.ArgumentParser) -> None:
    """``--dtype {auto,bfloat16,float32}`` (:func:`specdecode.models.torch.hf_loading.parse_dtype`)."""
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="compute dtype; auto (default): bfloat16 where the CPU multiplies it natively (or on a GPU), else "
        "float32 with oneDNN linears (specdecode.models.torch.cpu)",
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
    p.add_argument("--threads", type=int, default=None, metavar="N", help="llamacpp: CPU threads (default: every core)")
    p.add_argument(
        "--exact",
        default=None,
        action=argparse.BooleanOptionalAction,
        help="every verification row bit-identical to a one-token pass, greedy output equal to plain decoding "
        "(llama.cpp: batch-invariant chunks; torch bf16/fp16: exact passes); default on, except torch on a GPU "
        "(fixed-width passes, opt in); --no-exact verifies in one pass, faster, equal up to near-ties",
    )


def backend_options(args: argparse.Namespace) -> dict[str, Any]:
    """``backend=, threads=, exact=`` for :meth:`SpeculativeGenerator.from_pretrained`.

    Raises:
        ValueError: ``--threads`` below 1.
    """
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    return {"backend": args.backend, "threads": args.threads, "exact": args.exact}


def given_proposer_options(args: argparse.Namespace) -> dict[str, Any]:
    """Every proposer option given on the command line (flags left unset omitted), for any proposer:
    :func:`specdecode.load.plan_models` chooses the proposer (``--proposer auto``) and checks that
    they are its own, naming the proposers an option belongs to."""
    from specdecode.proposers import PROPOSERS

    every = {f.name for spec in PROPOSERS.values() for f in dataclasses.fields(spec.config)}
    return {name: value for name in sorted(every) if (value := getattr(args, name, None)) is not None}


def resolve_auto_proposer(args: argparse.Namespace, backend: str | None = None) -> None:
    """``--proposer auto`` on ``backend`` (None: resolved here) by the load path's rule
    (:func:`specdecode.load.auto_proposer`: the backend's measured best, or ``draft_model`` when the
    options given are the draft model's only), its options set where the user set none; other
    proposers stay as they are. ``generate`` and ``serve`` leave this to :func:`specdecode.load.plan_models`."""
    if args.proposer != "auto":
        return
    from specdecode.load import auto_proposer
    from specdecode.models.backends import resolve_backend

    backend = backend or resolve_backend(args.backend, args.target, args.dtype)
    args.proposer, options = auto_proposer(backend, args.draft, given_proposer_options(args))
    for option, value in options.items():  # options the user set win (they are among these)
        setattr(args, option, value)


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
            f"{choices}; auto (default): draft_model with --draft, else prompt_lookup (--min-ngram 3) on "
            "llamacpp, draft_model on torch"
        )
    else:
        default, text = "draft_model", f"{choices} (default: draft_model)"
    names = sorted(PROPOSERS) + (["auto"] if auto else [])
    p.add_argument("--proposer", default=default, choices=names, metavar="NAME", help=text)
    seen: dict[str, list[str]] = {}
    helps: dict[str, dict[str, list[str]]] = {}  # option -> help text -> the proposers that say it
    defaults: dict[str, Any] = {}
    annotations: dict[str, str] = {}
    metavars: dict[str, str] = {}
    for name, spec in PROPOSERS.items():
        for f in dataclasses.fields(spec.config):
            seen.setdefault(f.name, []).append(name)
            helps.setdefault(f.name, {}).setdefault(f.metadata.get("help", ""), []).append(name)
            defaults[f.name] = f.default
            annotations[f.name] = str(f.type)
            if "metavar" in f.metadata:
                metavars[f.name] = f.metadata["metavar"]
    for option in seen:
        kind = _option_type(defaults[option], annotations[option])
        text = "; ".join(f"{'/'.join(owners)}: {words}" for words, owners in helps[option].items())
        metavar = metavars.get(option) or OPTION_METAVARS.get(option) or TYPE_METAVARS.get(kind, "VALUE")
        p.add_argument("--" + option.replace("_", "-"), type=kind, default=None, metavar=metavar, help=text)


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
