"""``specdecode chat``: an interactive conversation with the target, each answer streamed.

Each user line is one turn: the whole history (the system prompt, then every user and assistant
message) goes through the tokenizer's chat template, the answer streams as the target's tokens
are accepted, and one line of statistics follows it on stderr (tokens, tokens/s, time to first
token, mean acceptance length, acceptance rate, cached tokens). Where the target's runner keeps
its cells (llama.cpp), a turn prefills only what the previous sequence did not hold: the
history's common prefix is reported as cached tokens.

A line that is one of :data:`CHAT_COMMANDS` is a command; empty lines are ignored. Ctrl-C during
an answer ends that answer (the text so far stays in the history); Ctrl-C at the prompt, EOF,
``/exit`` or ``/quit`` end the conversation.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from specdecode.commands.common import (
    add_backend_args,
    add_command_parser,
    add_model_args,
    add_proposer_args,
    backend_options,
    given_proposer_options,
)
from specdecode.commands.generate import add_sampling_args, sampling_from_args
from specdecode.stats import SpecStats

if TYPE_CHECKING:
    from specdecode.engine import CheckedRequest, GenerationResult, SpeculativeGenerator
    from specdecode.sampling import SamplingParams

PROMPT = ">>> "
CHAT_COMMANDS: dict[str, str] = {
    "/reset": "forget the conversation (the system prompt stays)",
    "/help": "list these commands",
    "/exit": "end the conversation (also /quit, Ctrl-D, Ctrl-C at the prompt)",
    "/quit": "end the conversation",
}
"""The commands a chat line may be, each with its line in ``/help``."""


def add_chat_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``chat`` subcommand to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    c = add_command_parser(
        subparsers,
        "chat",
        "chat with the target interactively: each line of standard input is a user turn, the answer streams, "
        "one line of statistics follows on stderr; /help lists the commands",
    )
    c.add_argument("--system", default=None, metavar="TEXT", help="a system prompt, the first message of the history")
    add_model_args(c)
    add_backend_args(c)
    add_sampling_args(c, max_new_tokens=512)
    add_proposer_args(c, auto=True)
    c.set_defaults(func=cmd_chat)
    return c


def initial_messages(system: str | None) -> list[dict[str, str]]:
    """The history of a new conversation: the system message when there is a system prompt, else empty."""
    return [{"role": "system", "content": system}] if system is not None else []


def format_turn_stats(stats: SpecStats, interrupted: bool = False) -> str:
    """One line of a turn's :class:`~specdecode.stats.SpecStats`: tokens, tokens/s, time to first
    token, mean acceptance length, acceptance rate and the prompt's cached tokens."""
    line = (
        f"[{stats.new_tokens} tokens, {stats.tokens_per_second:.1f} tokens/s, "
        f"time to first token {stats.time_to_first_token_s:.3f} s, "
        f"mean acceptance length {stats.mean_acceptance_length:.2f}, "
        f"acceptance rate {stats.acceptance_rate:.0%} of {stats.draft_tokens} drafted, "
        f"cached tokens {stats.cached_tokens} of {stats.prompt_tokens}]"
    )
    return line + " (interrupted)" if interrupted else line


def line_reader(stdin: TextIO) -> Callable[[], str | None]:
    """A function returning the next user line (its newline dropped), None at EOF.

    On a terminal it prompts with :data:`PROMPT` (``input``, with line editing where ``readline``
    exists); otherwise it reads lines and prints no prompt (piped input).
    """
    if stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 (line editing and history for input())

        def read_tty() -> str | None:
            try:
                return input(PROMPT)
            except EOFError:
                print()
                return None

        return read_tty

    def read_pipe() -> str | None:
        line = stdin.readline()
        return line.rstrip("\r\n") if line else None

    return read_pipe


def cmd_chat(args: argparse.Namespace) -> int:
    """Run the conversation until EOF, ``/exit``, ``/quit`` or Ctrl-C at the prompt; returns 0.

    The sampling parameters, k, the tree and ``--system`` are checked, then the load planned
    (:func:`specdecode.load.plan_models`, as ``specdecode generate`` does), all before any weights load.

    Raises:
        ValueError: a bad option value (the message names it), or a target whose tokenizer has
            no chat template.
    """
    from specdecode.engine import SpeculativeGenerator, check_request
    from specdecode.load import load_models, plan_models

    sampling = sampling_from_args(args)  # validate cheap input before loading anything
    request = check_request(None, args.num_speculative_tokens, args.tree)
    if args.system is not None and not args.system.strip():
        raise ValueError("--system must not be empty")
    plan = plan_models(
        args.target,
        args.draft,
        args.proposer,
        dtype=args.dtype,
        device=args.device,
        cuda_graphs=args.cuda_graphs,
        **backend_options(args),
        **given_proposer_options(args),
    )
    generator = SpeculativeGenerator.from_loaded(load_models(plan))
    if not generator.tokenizer.chat_template:
        raise ValueError("the target's tokenizer has no chat template; chat needs one")
    read_line = line_reader(sys.stdin)
    messages = initial_messages(args.system)
    while True:
        try:
            line = read_line()
        except KeyboardInterrupt:  # Ctrl-C at the prompt: the end
            print()
            return 0
        text = line.strip() if line is not None else "/exit"
        if text in ("/exit", "/quit"):
            return 0
        if not text:
            continue
        if text == "/help":
            for command, words in CHAT_COMMANDS.items():
                print(f"{command:8} {words}", file=sys.stderr)
        elif text == "/reset":
            messages = initial_messages(args.system)
            kept = " (the system prompt kept)" if args.system is not None else ""
            print(f"[conversation reset{kept}]", file=sys.stderr)
        elif text.startswith("/") and len(text.split()) == 1:
            print(f"[unknown command {text}; /help lists the commands]", file=sys.stderr)
        else:
            messages.append({"role": "user", "content": text})
            chat_turn(generator, messages, request, sampling, args.schedule)


def chat_turn(
    generator: SpeculativeGenerator,
    messages: list[dict[str, str]],
    request: CheckedRequest,
    sampling: SamplingParams,
    schedule: str,
) -> None:
    """Answer the last user message of ``messages``: the whole history through the chat template,
    the answer streamed to stdout, the assistant message appended, one line of statistics on stderr.

    Ctrl-C ends the answer early: the text so far is the assistant message (none: the user message
    is dropped) and the target's runner is reset (the next turn prefills its whole prompt). A
    history the chat template or the target's context cannot take drops the user message, with
    the error on stderr.
    """
    from jinja2 import TemplateError

    tokenizer = generator.tokenizer
    result: GenerationResult | None = None
    interrupted = False
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens
        stream = generator.stream_request(ids, request, sampling, schedule=schedule)
        try:
            for _, piece, result in stream:
                print(piece, end="", flush=True)
        finally:
            stream.close()
    except KeyboardInterrupt:  # possibly mid-pass: the runner's cells may not match its sequence
        interrupted = True
        generator.target.reset()
    except (ValueError, TemplateError) as error:  # too long a history, a template refusing it
        messages.pop()
        print(f"[error: {error}; /reset starts over]", file=sys.stderr)
        return
    if result is None:
        print()
        messages.pop()
        print("[interrupted before the first token]", file=sys.stderr)
        return
    print()
    messages.append({"role": "assistant", "content": result.text})
    print(format_turn_stats(result.stats, interrupted), file=sys.stderr, flush=True)
