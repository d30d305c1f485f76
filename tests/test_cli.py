"""``specdecode generate`` on tiny models saved to a folder, with a chat template and stop strings."""

from __future__ import annotations

import argparse
import json

import pytest

from specdecode.commands.main import main


def run_json(capsys, *args: str) -> dict:
    assert main(["generate", *args, "--json", "--dtype", "float32"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_compare(model_dirs, capsys) -> None:
    target, draft = model_dirs
    out = run_json(
        capsys,
        "def add(a, b):",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--max-new-tokens",
        "20",
        "-k",
        "3",
        "--compare",
    )
    for key in (
        "text",
        "token_ids",
        "new_tokens",
        "drafts",
        "draft_tokens",
        "accepted_tokens",
        "accepted_per_position",
        "acceptance_rate",
        "mean_acceptance_length",
        "target_forward_passes",
        "wall_time_s",
        "tokens_per_second",
        "num_speculative_tokens",
        "proposer",
        "dtype",
        "baseline_tokens_per_second",
        "speedup",
        "identical",
    ):
        assert key in out, key
    assert out["identical"] is True
    assert out["new_tokens"] == len(out["token_ids"]) == 20
    assert len(out["accepted_per_position"]) == 3
    assert out["proposer"] == "draft_model" and out["dtype"] == "float32"


def test_generate_streams_text_and_stats(model_dirs, capsys) -> None:
    target, draft = model_dirs
    assert (
        main(
            [
                "generate",
                "for i in",
                "--target",
                str(target),
                "--draft",
                str(draft),
                "--max-new-tokens",
                "12",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert "mean_acceptance_length" in captured.err


def test_no_speculation_and_raw(model_dirs, capsys) -> None:
    target, _ = model_dirs
    out = run_json(capsys, "def", "--target", str(target), "--no-speculation", "--raw", "--max-new-tokens", "5")
    assert out["proposer"] == "none" and out["drafts"] == 0 and out["new_tokens"] == 5


def test_stop_string_from_the_cli(model_dirs, capsys) -> None:
    target, draft = model_dirs
    full = run_json(capsys, "class", "--target", str(target), "--draft", str(draft), "--max-new-tokens", "30")
    assert full["num_speculative_tokens"] == 4  # no -k: the draft model's default k
    text = full["text"]
    assert len(text) > 6
    stop = text[3:6]
    out = run_json(
        capsys, "class", "--target", str(target), "--draft", str(draft), "--max-new-tokens", "30", "--stop", stop
    )
    assert out["text"] == text[: text.find(stop)] and out["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
        (["-k", "0"], "num_speculative_tokens"),
        (["--draft", "/no/such/model"], "--draft"),
        (["--proposer", "prompt_lookup", "--min-ngram", "0"], "min_ngram"),
        (["--max-ngram", "2"], "--max-ngram"),
    ],
)
def test_cli_errors_name_the_parameter(model_dirs, capsys, args: list[str], message: str) -> None:
    target, _ = model_dirs
    assert main(["generate", "hi", "--target", str(target), *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_an_empty_prompt(capsys) -> None:
    assert main(["generate", ""]) == 2
    assert "prompt" in capsys.readouterr().err


def test_the_cli_default_k_is_the_libraries() -> None:
    from specdecode.commands.common import DEFAULT_K
    from specdecode.proposers.base import DEFAULT_NUM_SPECULATIVE_TOKENS

    assert DEFAULT_K == DEFAULT_NUM_SPECULATIVE_TOKENS


def test_every_help_fits_an_80_column_terminal(monkeypatch) -> None:
    """``specdecode --help`` and every command's ``--help`` as argparse renders them with COLUMNS=80: no
    line longer than 80 characters, no option name split at a hyphen, every command listed on one line."""
    import argparse
    import re

    from specdecode.commands.main import build_parser

    monkeypatch.setenv("COLUMNS", "80")  # argparse sizes its help to shutil.get_terminal_size()
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(commands.choices) >= {"generate", "prepare", "bench", "serve", "train-drafter"}
    helps = {"specdecode": parser.format_help()} | {name: p.format_help() for name, p in commands.choices.items()}
    for name, text in helps.items():
        for line in text.splitlines():
            assert len(line) <= 80, f"{name}: {line!r}"
            assert not re.search(r"-[a-z]+-$", line), f"{name}: an option split at its hyphen: {line!r}"
    top = helps["specdecode"].splitlines()
    for name in commands.choices:
        (row,) = [i for i, line in enumerate(top) if line.split()[:1] == [name]]
        first = row if len(top[row].split()) > 1 else row + 1  # a name too long for its column: summary below
        assert not top[first + 1].startswith(" " * 24), f"{name}: its summary takes two lines"


def test_the_top_level_help_imports_no_command_module() -> None:
    """``specdecode --help`` lists the commands from the registry alone: no command module, torch or
    transformers is imported (they cost seconds); a command's own parser comes with its name."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from specdecode.commands.main import build_parser\n"
        "text = build_parser([]).format_help()\n"
        "heavy = [m for m in ('torch', 'transformers', 'specdecode.commands.generate') if m in sys.modules]\n"
        "print(heavy, 'train-drafter' in text)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] True"


def test_the_registry_lists_every_command_as_its_parser_does() -> None:
    import argparse

    from specdecode.commands.main import build_parser
    from specdecode.commands.registry import COMMANDS

    full, lazy = build_parser(), build_parser(["generate"])
    for parser in (full, lazy):
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        assert list(sub.choices) == list(COMMANDS)
        assert [a.help for a in sub._choices_actions] == [c.summary for c in COMMANDS.values()]
    (sub,) = [a for a in lazy._actions if isinstance(a, argparse._SubParsersAction)]
    assert sub.choices["generate"].get_default("func") is not None  # the command named: its own parser
    assert sub.choices["bench"].get_default("func") is None  # the others: listed only


def test_auto_proposer_follows_the_options_given() -> None:
    """``--proposer auto`` (the default): the backend's default proposer with its options, unless the
    options given are the draft model's only (README: ``generate "..." --prompt-lookup-min 2``)."""
    from specdecode.commands.common import resolve_auto_proposer
    from specdecode.commands.main import build_parser

    def resolved(*flags: str) -> argparse.Namespace:
        args = build_parser().parse_args(["generate", "x", "--backend", "llamacpp", *flags])
        resolve_auto_proposer(args)
        return args

    plain = resolved()
    assert (plain.proposer, plain.min_ngram) == ("prompt_lookup", 3)
    assert (resolved("--min-ngram", "2").proposer, resolved("--min-ngram", "2").min_ngram) == ("prompt_lookup", 2)
    drafted = resolved("--prompt-lookup-min", "2")
    assert (drafted.proposer, drafted.prompt_lookup_min, drafted.min_ngram) == ("draft_model", 2, None)
    assert resolved("--proposer", "suffix").proposer == "suffix"  # a named proposer stays


def test_generate_with_a_prediction_file(model_dirs, capsys, tmp_path) -> None:
    """``--prediction FILE``: the same tokens as the target alone, the prediction's usage in the
    statistics; an unreadable file is refused naming the flag. The usage is checked with every
    draft sent (``--schedule ungated``): the default's draft gate decides from measured pass times,
    and on a tiny model under a loaded machine it may withhold the prediction (a flaky count)."""
    target, _ = model_dirs
    common = ("def add(a, b):", "--target", str(target), "--proposer", "prompt_lookup", "--max-new-tokens", "20")
    plain = run_json(capsys, *common, "--no-speculation")
    path = tmp_path / "prediction.txt"
    path.write_text(plain["text"], encoding="utf-8")
    for schedule in ("constant", "ungated"):  # the default (gated), then every draft sent
        out = run_json(capsys, *common, "--prediction", str(path), "--schedule", schedule)
        assert out["token_ids"] == plain["token_ids"]
        assert out["proposer"] == "prediction+prompt_lookup" and out["num_speculative_tokens"] == 16
        assert out["accepted_prediction_tokens"] + out["rejected_prediction_tokens"] == out["prediction_tokens"]
    assert out["accepted_prediction_tokens"] > 0
    assert main(["generate", *common, "--prediction", str(tmp_path / "missing.txt")]) == 2
    assert "--prediction" in capsys.readouterr().err
