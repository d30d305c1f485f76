"""``specdecode``: the top-level parser and :func:`main`, the console script.

Run as ``specdecode <command>`` or ``python -m specdecode.commands.main <command>``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Collection, Sequence

from specdecode.commands.common import HelpFormatter
from specdecode.commands.registry import COMMANDS
from specdecode.errors import SpecDecodeError


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``specdecode`` parser: every subcommand listed, each sets ``func``, its command function.

    Args:
        commands: the commands whose own parsers (options, ``func``) are built, importing their
            modules; the others are listed with their summary only. None (default): all of them.
    """
    parser = argparse.ArgumentParser(
        prog="specdecode",
        description="Lossless speculative decoding.",
        epilog="Run 'specdecode COMMAND --help' for the options of a command.",
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    for name, command in COMMANDS.items():
        if commands is None or name in commands:
            getattr(importlib.import_module(command.module), command.add_parser)(sub)
        else:
            sub.add_parser(name, help=command.summary, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the command.

    Returns:
        the exit status: the command's (0), 2 for an error of the input (its message on stderr,
        ``specdecode <command>: error: ...``), 130 after Ctrl-C.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # only the command named is built: `specdecode --help` imports no command's module
    parser = build_parser(argv[:1] if argv and argv[0] in COMMANDS else [])
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
