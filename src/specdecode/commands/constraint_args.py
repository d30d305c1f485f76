"""``--json-schema FILE``, ``--regex RE``, ``--grammar FILE``: structured output on the command
line (:mod:`specdecode.constraints`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_constraint_args(p: argparse.ArgumentParser) -> None:
    """Add the mutually exclusive constraint options to ``p``."""
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--json-schema",
        metavar="FILE",
        help="constrain the output to JSON valid against the schema in FILE ('-': any JSON object)",
    )
    group.add_argument("--regex", metavar="RE", help="constrain the output to match the regular expression RE in full")
    group.add_argument(
        "--grammar", metavar="FILE", help="constrain the output to the grammar in FILE (Lark, or GBNF with ::=)"
    )


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as error:
        raise ValueError(f"{flag}: cannot read {path!r}: {error.strerror or error}") from None


def constraint_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~specdecode.constraints.JsonSchema` / ``Regex`` / ``Grammar`` the flags name, checked
    by llguidance (before any model loads), or None.

    Raises:
        ValueError: an unreadable file, or a constraint llguidance rejects (the message names the flag).
    """
    from specdecode.constraints.spec import Grammar, JsonSchema, Regex, compile_constraint

    constraint = None
    if getattr(args, "json_schema", None) is not None:
        if args.json_schema == "-":
            constraint = JsonSchema({"type": "object"}, param="--json-schema")
        else:
            text = _read(args.json_schema, "--json-schema")
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"--json-schema: {args.json_schema} is not valid JSON: {error}") from None
            constraint = JsonSchema(schema, param="--json-schema")
    elif getattr(args, "regex", None) is not None:
        constraint = Regex(args.regex, param="--regex")
    elif getattr(args, "grammar", None) is not None:
        constraint = Grammar(_read(args.grammar, "--grammar"), param="--grammar")
    if constraint is not None:
        compile_constraint(constraint)  # raises ConstraintError naming the flag
    return constraint
