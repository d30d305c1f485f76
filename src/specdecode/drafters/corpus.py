"""A drafter's training text: corpus text cut into token sequences, and chat examples made from
the corpus's Python functions.

The corpus is text that installs offline (:func:`specdecode.token_map.corpus_files`: the Python
standard library's source, packaged prose; never the benchmark prompts). :func:`token_sequences`
joins its texts with EOS and cuts them into sequences of ``seq_len`` tokens. With ``--chat``
(:func:`chat_texts`) its documented functions become chat examples in the target's chat template
(complete this function -> the function): the format and the copying an instruct target meets on
code requests.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Any


def token_sequences(tokenizer: Any, texts: Iterable[str], seq_len: int, max_tokens: int) -> Iterator[list[int]]:
    """Sequences of exactly ``seq_len`` token ids from ``texts`` joined by EOS, at most ``max_tokens`` in all."""
    eos = getattr(tokenizer, "eos_token_id", None)
    buffer: list[int] = []
    made = 0
    for text in texts:
        buffer.extend(tokenizer.encode(text, add_special_tokens=False))
        if eos is not None:
            buffer.append(int(eos))
        while len(buffer) >= seq_len:
            if made + seq_len > max_tokens:
                return
            yield buffer[:seq_len]
            buffer = buffer[seq_len:]
            made += seq_len


CHAT_INSTRUCTIONS = (
    "Complete the following Python function:",
    "Implement this Python function.",
    "Write the body of the function below.",
    "Finish this code:",
    "Here is a function signature and its docstring. Write the implementation.",
)


def function_examples(text: str, max_lines: int = 80) -> Iterator[tuple[str, str]]:
    """``(header, function)`` pairs from Python source: every function or method with a docstring and
    at least two statements after it, at most ``max_lines`` lines, dedented; ``header`` is the ``def``
    line(s) and the docstring, ``function`` the whole definition. Source that does not parse yields nothing."""
    import ast
    import textwrap

    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    lines = text.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or ast.get_docstring(node) is None:
            continue
        if len(node.body) < 3 or node.end_lineno is None or node.end_lineno - node.lineno >= max_lines:
            continue
        doc_end = node.body[0].end_lineno or node.lineno
        whole = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
        header_lines = doc_end - node.lineno + 1
        yield "\n".join(whole.splitlines()[:header_lines]) + "\n", whole + "\n"


def chat_texts(tokenizer: Any, texts: Iterable[str], seed: int = 0) -> Iterator[str]:
    """Chat examples in the target's chat template, made from the functions of Python source.

    Each function with a docstring (:func:`function_examples`) becomes one user turn (an instruction
    from :data:`CHAT_INSTRUCTIONS`, picked at random, and the function's signature and docstring in a
    code block) and one assistant turn (the whole function in a code block). It teaches a drafter the
    chat format and the copying that an instruct target does when asked to complete code (its answer
    starts by repeating the signature and docstring), without generating anything: the labels are
    still the target's own predictions over these texts.

    Args:
        tokenizer: the target's tokenizer, with a chat template.
        texts: Python source texts (e.g. ``read_texts(corpus_files(["stdlib"]))``).
        seed: the instruction choice.

    Yields:
        the rendered chat (str), one per function.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat examples need a tokenizer with a chat template")
    pick = random.Random(seed)
    for text in texts:
        for header, function in function_examples(text):
            messages = [
                {"role": "user", "content": f"{pick.choice(CHAT_INSTRUCTIONS)}\n```python\n{header}```"},
                {"role": "assistant", "content": f"```python\n{function}```"},
            ]
            yield tokenizer.apply_chat_template(messages, tokenize=False)
