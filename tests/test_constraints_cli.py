"""``specdecode generate --json-schema FILE / --regex PATTERN / --grammar FILE`` on tiny models."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from specdecode.commands.main import main

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


def run_json(capsys, target, draft, *args: str) -> dict:
    common = ["--target", str(target), "--draft", str(draft), "--max-new-tokens", "60", "--dtype", "float32"]
    assert main(["generate", "def add(a, b):", *common, *args, "--json", "--compare"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_schema_flag(model_dirs, tmp_path, capsys) -> None:
    target, draft = model_dirs
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    out = run_json(capsys, target, draft, "--json-schema", str(path), "-k", "3")
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert out["identical"], "speculative and target-only constrained outputs differ"
    assert out["forced_draft_tokens"] > 0


def test_regex_and_grammar_flags(model_dirs, tmp_path, capsys) -> None:
    target, draft = model_dirs
    out = run_json(capsys, target, draft, "--regex", r"[a-z]{2,6}\(\)")
    assert re.fullmatch(r"[a-z]{2,6}\(\)", out["text"]) and out["identical"]
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "x = " [0-9] [0-9]?')
    out = run_json(capsys, target, draft, "--grammar", str(grammar))
    assert re.fullmatch(r"x = [0-9][0-9]?", out["text"]) and out["identical"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--regex", "a("], "--regex"),
        (["--json-schema", "/no/such/schema.json"], "--json-schema"),
        (["--grammar", "/no/such/grammar.lark"], "--grammar"),
        (["--regex", "a", "--json-schema", "-"], "not allowed with"),
    ],
)
def test_bad_constraint_flags_name_themselves(model_dirs, capsys, args: list[str], message: str) -> None:
    target, _ = model_dirs
    with pytest.raises(SystemExit) if "not allowed" in message else _no_raise():
        assert main(["generate", "hi", "--target", str(target), *args]) == 2
    assert message in capsys.readouterr().err


def test_bad_schema_file_names_the_flag(model_dirs, tmp_path, capsys) -> None:
    target, _ = model_dirs
    path = tmp_path / "bad.json"
    path.write_text('{"type": "objectx"}')
    assert main(["generate", "hi", "--target", str(target), "--json-schema", str(path)]) == 2
    assert "--json-schema" in capsys.readouterr().err


class _no_raise:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False
