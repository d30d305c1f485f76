"""``specdecode chat`` on tiny models saved to a folder (torch backend): turns read from piped
standard input, the history through the chat template, ``/reset``, Ctrl-C, the statistics lines."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pytest

from specdecode.commands.main import main
from specdecode.engine import SpeculativeGenerator

MAX_NEW_TOKENS = "6"


def chat_argv(model_dirs: Any, *extra: str) -> list[str]:
    target, draft = model_dirs
    return [
        "chat",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--backend",
        "torch",
        "--dtype",
        "float32",
        "--max-new-tokens",
        MAX_NEW_TOKENS,
        *extra,
    ]


@pytest.fixture
def turns(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every turn the generator streams: its prompt ids and final result (the real stream, recorded)."""
    recorded: list[dict[str, Any]] = []
    original = SpeculativeGenerator.stream_request

    def stream_request(self: SpeculativeGenerator, prompt: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        turn = {"ids": list(prompt), "result": None}
        recorded.append(turn)
        for item in original(self, prompt, *args, **kwargs):
            turn["result"] = item[2]
            yield item

    monkeypatch.setattr(SpeculativeGenerator, "stream_request", stream_request)
    return recorded


def template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def stats_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("[") and "tokens/s" in line]


def test_turns_keep_the_history_and_reset_forgets_it(model_dirs, tiny_tokenizer, turns, monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("def add(a, b):\n\nfor i in\n/reset\nclass Stack:\n"))
    assert main(chat_argv(model_dirs, "--system", "You write Python.")) == 0
    out, err = capsys.readouterr()
    assert len(turns) == 3
    answers = [turn["result"].text for turn in turns]
    assert all(turn["result"].stats.new_tokens > 0 for turn in turns)
    system = {"role": "system", "content": "You write Python."}
    first = [system, {"role": "user", "content": "def add(a, b):"}]
    assert turns[0]["ids"] == template_ids(tiny_tokenizer, first)
    second = [*first, {"role": "assistant", "content": answers[0]}, {"role": "user", "content": "for i in"}]
    assert turns[1]["ids"] == template_ids(tiny_tokenizer, second)  # the first answer is in the second prompt
    after_reset = [system, {"role": "user", "content": "class Stack:"}]
    assert turns[2]["ids"] == template_ids(tiny_tokenizer, after_reset)  # /reset: the system prompt only
    assert out == "".join(answer + "\n" for answer in answers)  # no prompt printed: stdin is not a terminal
    lines = stats_lines(err)
    assert len(lines) == 3 and "conversation reset (the system prompt kept)" in err
    for line, turn in zip(lines, turns, strict=True):
        stats = turn["result"].stats
        assert f"[{stats.new_tokens} tokens, " in line and "time to first token" in line
        assert "mean acceptance length" in line and "acceptance rate" in line
        assert f"cached tokens {stats.cached_tokens} of {stats.prompt_tokens}]" in line
        assert stats.proposer == "draft_model"  # --proposer auto with --draft: the draft model


def test_eof_exit_and_commands(model_dirs, turns, monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(chat_argv(model_dirs)) == 0  # EOF at once: no turn
    assert turns == [] and capsys.readouterr().out == ""
    monkeypatch.setattr("sys.stdin", io.StringIO("/help\n/nonsense\n/quit\ndef add(a, b):\n"))
    assert main(chat_argv(model_dirs)) == 0
    err = capsys.readouterr().err
    assert turns == []  # /quit ended it before the last line
    assert "/reset" in err and "/exit" in err and "unknown command /nonsense" in err


def test_ctrl_c_ends_the_answer_and_keeps_its_text(model_dirs, tiny_tokenizer, monkeypatch, capsys) -> None:
    """Ctrl-C after the first piece: the answer so far is the assistant turn, the chat goes on (the
    target's runner reset); Ctrl-C at the prompt ends the chat with status 0."""
    original = SpeculativeGenerator.stream_request
    prompts: list[list[int]] = []
    partial: list[str] = []

    def stream_request(self: SpeculativeGenerator, prompt: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        prompts.append(list(prompt))
        for item in original(self, prompt, *args, **kwargs):
            yield item
            if len(prompts) == 1:
                partial.append(item[2].text)
                raise KeyboardInterrupt

    class Lines(io.StringIO):
        def readline(self, *args: Any) -> str:
            line = super().readline(*args)
            if not line:
                raise KeyboardInterrupt  # Ctrl-C at the prompt
            return line

    monkeypatch.setattr(SpeculativeGenerator, "stream_request", stream_request)
    monkeypatch.setattr("sys.stdin", Lines("def add(a, b):\nfor i in\n"))
    assert main(chat_argv(model_dirs)) == 0
    err = capsys.readouterr().err
    assert len(prompts) == 2 and len(stats_lines(err)) == 2 and "(interrupted)" in err
    history = [
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": partial[0]},
        {"role": "user", "content": "for i in"},
    ]
    assert prompts[1] == template_ids(tiny_tokenizer, history)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "-1"], "temperature"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
        (["-k", "0"], "num_speculative_tokens"),
        (["--tree", "no-such-tree"], "tree"),
        (["--system", " "], "--system"),
        (["--draft", "/no/such/model"], "--draft"),
        (["--max-ngram", "2"], "--max-ngram"),
    ],
)
def test_bad_options_are_errors_naming_them(model_dirs, monkeypatch, capsys, args: list[str], message: str) -> None:
    target, _ = model_dirs
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main(["chat", "--target", str(target), "--dtype", "float32", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdecode chat: error: ") and message in err


def test_a_target_without_a_chat_template_is_refused(tmp_path, tiny_tokenizer, monkeypatch, capsys) -> None:
    from conftest import make_tiny_model

    tokenizer = tiny_tokenizer.__class__(tokenizer_object=tiny_tokenizer.backend_tokenizer, eos_token="<|end|>")
    make_tiny_model(vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    argv = ["chat", "--target", str(tmp_path), "--backend", "torch", "--dtype", "float32", "--proposer", "suffix"]
    assert main(argv) == 2
    assert "no chat template" in capsys.readouterr().err
