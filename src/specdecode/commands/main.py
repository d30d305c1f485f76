"""``specdecode``: the top-level parser and :func:`main`, the console script.

Run as ``specdecode <command>`` or ``python -m specdecode.commands.main <command>``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from specdecode.commands.bench import add_bench_parser
from specdecode.commands.calibrate import add_calibrate_parser
from specdecode.commands.common import HelpFormatter
from specdecode.commands.generate import add_generate_parser
from specdecode.commands.prepare import add_prepare_parser
from specdecode.commands.serve import add_serve_parser
from specdecode.commands.token_map import add_token_map_parser
from specdecode.commands.train_drafter import add_train_parser
from specdecode.errors import SpecDecodeError


def build_parser() -> argparse.ArgumentParser:
    """The ``specdecode`` parser with every subcommand (each sets ``func``, its command function)."""
    parser = argparse.ArgumentParser(
        prog="specdecode",
        description="Lossless speculative decoding.",
        epilog="Run 'specdecode COMMAND --help' for the options of a command.",
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    add_generate_parser(sub)
    add_prepare_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    add_token_map_parser(sub)
    add_calibrate_parser(sub)
    add_train_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the command.

    Returns:
        the exit status: the command's (0), 2 for an error of the input (its message on stderr,
        ``specdecode <command>: error: ...``), 130 after Ctrl-C.
    """
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
