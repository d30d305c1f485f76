"""README.md's "A five-minute tour" works as written, on the default backend and the default models.

The commands are read from the README itself (every ``specdecode ...`` line of the tour's shell
block; ``"..."`` stands for a prompt), so a line added to the tour is tested with no change here.
Each runs as a user runs it, ``.venv/bin/specdecode`` in a subprocess, in a folder holding the files
the tour names (``person.json``, ``calc.py``), with a small budget appended (:data:`BUDGETS`), and must exit 0
with a meaningful output: text, the statistics table, ``identical`` under ``--compare``, parseable
JSON with log-probabilities under ``--json --logprobs``, output valid under ``--json-schema``. The
README's Python snippets run too: the library's (in this process) and the client's against a
``specdecode serve`` started as the README says (on a free port).

Skipped, with the reason, when llama-cpp-python or the default models are not installed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import require_default_gguf

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SPECDECODE = Path(sys.executable).with_name("specdecode")
PROMPT = "Write a Python function that adds two numbers."  # what the tour's "..." stands for
BUDGETS = {  # appended per subcommand: small enough for a test, still a real run of every part
    "generate": ["--max-new-tokens", "8"],
    "chat": ["--max-new-tokens", "8"],
    "bench": ["--categories", "qa", "--max-new-tokens", "8", "--no-progress"],
    "cost-table": ["--widths", "1,3", "--draft-widths", "1", "--depth", "16", "--prefill", "16", "--reps", "1",
                   "--step-tokens", "4"],
}
# the server's start-up measures the cost model of adaptive speculation for batches up to
# --max-batch-size (8: minutes on 2 busy cores); one row measures the same code in seconds
SERVE_BUDGET = ["--max-batch-size", "1"]
SCHEMA = {  # person.json: short enough to be completed in the budget below
    "type": "object",
    "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["age"],
    "additionalProperties": False,
}
SCHEMA_BUDGET = ["--max-new-tokens", "24"]  # a schema-valid answer needs the closing brace
TIMEOUT_S = 300
CALC = "def add(a, b):\n    return a + b\n"  # calc.py, the file the tour's edit predicts
CHAT_INPUT = "Write a Python function that adds two numbers.\nNow one that multiplies them.\n/exit\n"  # typed into chat


def tour_section() -> str:
    """The README's "A five-minute tour" section (to the next ``## `` heading)."""
    text = README.read_text(encoding="utf-8")
    match = re.search(r"^## A five-minute tour\n(.*?)(?=^## )", text, flags=re.S | re.M)
    assert match, "README.md has no '## A five-minute tour' section"
    return match.group(1)


def code_blocks(language: str) -> list[str]:
    """The tour's fenced code blocks of ``language``."""
    return re.findall(rf"^```{language}\n(.*?)^```", tour_section(), flags=re.S | re.M)


def tour_commands() -> list[list[str]]:
    """Every ``specdecode ...`` line of the tour's shell blocks as argv (comments dropped, ``...``
    replaced by :data:`PROMPT`)."""
    commands = []
    for block in code_blocks("bash"):
        for line in block.splitlines():
            argv = shlex.split(line, comments=True)
            if argv and argv[0] == "specdecode":
                commands.append([PROMPT if arg == "..." else arg for arg in argv[1:]])
    return commands


COMMANDS = tour_commands()


def test_the_tour_has_commands_and_snippets() -> None:
    """The extraction finds what the tour shows (a guard against a heading or fence renamed)."""
    assert len(COMMANDS) >= 5 and all(argv[0] in ("generate", "chat", "bench", "serve", "doctor", "cost-table")
                                      for argv in COMMANDS)  # fmt: skip
    assert any("--compare" in argv for argv in COMMANDS)
    assert len(code_blocks("python")) == 2


@pytest.fixture(scope="module")
def installed() -> None:
    """Skip (with the reason) where llama-cpp-python or the default models are missing (from the
    files: no model is loaded to decide)."""
    require_default_gguf("target"), require_default_gguf("draft")
    assert SPECDECODE.is_file(), f"no {SPECDECODE}: run scripts/setup.sh"


def run_cli(argv: list[str], cwd: Path, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}  # the statistics table on one line per row
    return subprocess.run(
        [str(SPECDECODE), *argv], cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def stats_rows(stderr: str) -> dict[str, str]:
    """The rows of ``generate``'s statistics table (rich, on stderr) as ``{name: value}``."""
    rows = {}
    for line in stderr.splitlines():
        cells = [cell.strip() for cell in re.split(r"[│|]", line) if cell.strip()]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    return rows


def same_run_here(argv: list[str]) -> bool:
    """Whether ``argv`` runs exactly as another tour command on this machine: ``--device cpu`` where
    torch sees no GPU (``--device auto`` is the CPU then), beside the same command without it."""
    import torch

    if "--device" not in argv or argv[argv.index("--device") + 1] != "cpu" or torch.cuda.is_available():
        return False
    at = argv.index("--device")
    return argv[:at] + argv[at + 2 :] in COMMANDS


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(a) for a in COMMANDS])
def test_tour_command(argv: list[str], installed: None, tmp_path: Path) -> None:
    if same_run_here(argv):
        pytest.skip("no GPU here: --device cpu is --device auto, run by the command without it")
    (tmp_path / "person.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "calc.py").write_text(CALC)
    budget = SCHEMA_BUDGET if "--json-schema" in argv else BUDGETS.get(argv[0], [])
    if argv[0] == "bench":
        budget = [*budget, "--out", str(tmp_path / "bench")]
    done = run_cli([*argv, *budget], tmp_path, CHAT_INPUT if argv[0] == "chat" else "")
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    if argv[0] == "generate":
        check_generate(argv, done)
    elif argv[0] == "chat":  # two answers; the second turn prefilled after the first turn's cached prefix
        cached = [int(n) for n in re.findall(r"cached tokens (\d+) of \d+", done.stderr)]
        assert done.stdout.strip() and len(cached) == 2 and cached[0] == 0 and cached[1] > 20, done.stderr
    elif argv[0] == "bench":
        check_bench(argv, done, tmp_path / "bench")
    elif argv[0] == "doctor":  # the machine, the build, its smoke test (passed: these tests run on it), the choice
        assert done.stdout.startswith("cpu: ") and "smoke test" in done.stdout and "passed" in done.stdout, done.stdout
        lines = done.stdout.strip().splitlines()
        assert lines[-2].startswith("--backend auto: llamacpp"), done.stdout
        assert lines[-1].startswith("--device auto (torch): "), done.stdout
    elif argv[0] == "cost-table":  # a table bench --cost-table reads back, of both models
        from specdecode.cost.table import load_cost_table

        table = load_cost_table(tmp_path / argv[argv.index("--out") + 1])
        assert table.target.widths == (1, 3) and table.draft is not None and table.step_ms is not None
        assert "llama.cpp" in table.device and f"--cost-table {argv[argv.index('--out') + 1]}" in done.stdout
    else:
        assert done.stdout.strip(), "no output"


def check_generate(argv: list[str], done: subprocess.CompletedProcess[str]) -> None:
    if "--json" in argv:
        out = json.loads(done.stdout)
        assert out["text"].strip() and out["token_ids"]
        if "--logprobs" in argv:
            n = int(argv[argv.index("--logprobs") + 1])
            assert len(out["logprobs"]) == len(out["token_ids"])
            assert all(entry["logprob"] <= 0 and len(entry["top_logprobs"]) == n for entry in out["logprobs"])
        return
    assert done.stdout.strip(), f"no text\nstderr:\n{done.stderr[-4000:]}"
    rows = stats_rows(done.stderr)
    assert "decoding statistics" in done.stderr and float(rows["tokens_per_second"]) > 0, done.stderr
    if "--compare" in argv:
        assert rows["identical"] == "True", done.stderr  # greedy speculation gives the target's own tokens
    if "--prediction" in argv:  # the prediction's usage, as OpenAI reports it
        assert int(rows["prediction_tokens"]) > 0 and "accepted_prediction_tokens" in rows, done.stderr
    if "--json-schema" in argv:
        jsonschema = pytest.importorskip("jsonschema")
        jsonschema.validate(json.loads(done.stdout), SCHEMA)
    if "--backend" in argv:  # the statistics name the weights: gguf-... on llama.cpp, a torch dtype on torch
        backend = argv[argv.index("--backend") + 1]
        assert rows["dtype"].startswith("gguf") == (backend == "llamacpp"), (backend, rows["dtype"])


def check_bench(argv: list[str], done: subprocess.CompletedProcess[str], out: Path) -> None:
    results = json.loads((out / "results.json").read_text())
    methods = results["methods"]
    assert "target" in methods and len(methods) >= 2 and not results["skipped"], (methods, results["skipped"])
    assert {r["method"] for r in results["records"]} == set(methods)  # every method decoded
    assert all(r["new_tokens"] > 0 for r in results["records"])
    assert all(name in done.stdout for name in methods)  # the side-by-side table


# ------------------------------------------------------------------------------------- Python
def python_snippet(marker: str) -> str:
    """The tour's Python block containing ``marker``, with small budgets."""
    (code,) = [block for block in code_blocks("python") if marker in block]
    code = re.sub(r"max_new_tokens=\d+", "max_new_tokens=8", code)
    return re.sub(r"max_tokens=\d+", "max_tokens=8", code)


def test_python_snippet(installed: None) -> None:
    code = python_snippet("SpeculativeGenerator")
    out, names = io.StringIO(), {}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), names)  # noqa: S102 - the README's own code
    result, printed = names["result"], out.getvalue()
    assert result.text.strip() and result.stats.mean_acceptance_length >= 1.0
    assert printed.startswith(f"{result.text} {result.stats.mean_acceptance_length}\n")
    assert printed[len(result.text) :].split("\n", 1)[1].strip(), printed  # the streamed answer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_server_snippet(installed: None, tmp_path: Path) -> None:
    """``specdecode serve`` as the README starts it (another port), then the README's client code."""
    pytest.importorskip("openai")
    import httpx

    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    argv = ["serve", "--port", str(port), *SERVE_BUDGET]
    server = subprocess.Popen([str(SPECDECODE), *argv], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the server did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            time.sleep(1)
        code = python_snippet("OpenAI").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the README's own code
        printed = out.getvalue()
        assert printed.strip() and "{" in printed, printed  # the answer, then the speculative report
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:  # still measuring its cost model: SIGTERM waits for start-up
            server.kill()
            server.wait(timeout=30)
        log.close()
