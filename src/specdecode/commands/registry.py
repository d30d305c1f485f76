"""The ``specdecode`` commands: name, summary, and where each one's parser lives.

One table, light to import: ``specdecode --help`` lists the commands from it without importing any
command's module (some import torch and transformers at the top, seconds of start-up), and
``specdecode COMMAND ...`` imports only that command's module (:func:`specdecode.commands.main.build_parser`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One subcommand.

    Attributes:
        summary: its line in ``specdecode --help`` (54 characters at most keep it on one line of an
            80-column terminal).
        module: the module that defines its parser.
        add_parser: the name of that module's ``add_*_parser(subparsers)`` function.
    """

    summary: str
    module: str
    add_parser: str


COMMANDS: dict[str, Command] = {
    "generate": Command(
        "generate for one prompt: streamed text and statistics", "specdecode.commands.generate", "add_generate_parser"
    ),
    "chat": Command(
        "chat interactively: streamed answers and statistics", "specdecode.commands.chat", "add_chat_parser"
    ),
    "prepare": Command(
        "join, verify and convert the models into the cache", "specdecode.commands.prepare", "add_prepare_parser"
    ),
    "bench": Command("benchmark every method on the same prompts", "specdecode.commands.bench", "add_bench_parser"),
    "serve": Command(
        "serve an OpenAI-compatible API (batched speculation)", "specdecode.commands.serve", "add_serve_parser"
    ),
    "build-token-map": Command(
        "build a map of the N most frequent target tokens", "specdecode.commands.token_map", "add_token_map_parser"
    ),
    "calibrate-early-exit": Command(
        "measure exit layers of the target; save the fastest",
        "specdecode.commands.calibrate_early_exit",
        "add_calibrate_parser",
    ),
    "cost-table": Command(
        "measure pass costs here, to predict speedups", "specdecode.commands.cost_table", "add_cost_table_parser"
    ),
    "doctor": Command(
        "machine, llama.cpp build, the backend auto picks", "specdecode.commands.doctor", "add_doctor_parser"
    ),
    "train-drafter": Command(
        "train Medusa heads or an EAGLE head for the target", "specdecode.commands.train_drafter", "add_train_parser"
    ),
}
"""Every command, in the order ``specdecode --help`` lists them."""
