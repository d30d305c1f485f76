"""What a caller asks the output to match: a JSON schema, a regular expression or a grammar.

The three specs are plain frozen dataclasses; :func:`compile_constraint` turns one into an
`llguidance <https://github.com/guidance-ai/llguidance>`_ grammar and checks it, so that bad input
fails before any decoding with a :class:`ConstraintError` naming the parameter. llguidance is
imported inside the functions, never at ``import specdecode``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from specdecode.errors import MissingDependencyError

JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How JSON is laid out under a :class:`JsonSchema`: one line, ``", "`` between items and ``": "``
after keys (as Python's ``json.dumps``). Fixed separators make a schema's keys and punctuation
forced tokens, which grammar-aware drafting proposes for free. A schema's own ``"x-guidance"``
object overrides these (llguidance's JSON options, e.g. ``{"whitespace_flexible": true}``)."""


class ConstraintError(ValueError):
    """A constraint llguidance rejects (bad schema, pattern or grammar); ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class JsonSchema:
    """Output is one JSON value valid against ``schema`` (a dict or its JSON text).

    ``JsonSchema({"type": "object"})`` is "any JSON object" (OpenAI's ``json_object`` mode).
    ``param`` is the name bad-input errors give (the API argument, CLI flag or request field).
    """

    schema: dict[str, Any] | str
    param: str = field(default="json_schema", compare=False)


@dataclass(frozen=True)
class Regex:
    """Output matches the regular expression ``pattern`` in full (Rust ``regex`` syntax)."""

    pattern: str
    param: str = field(default="regex", compare=False)


@dataclass(frozen=True)
class Grammar:
    """Output is a sentence of a context-free grammar.

    Attributes:
        text: the grammar: Lark syntax (llguidance's dialect, rules ``start: ...``) or GBNF / EBNF
            as llama.cpp writes it (rules ``root ::= ...``).
        syntax: ``"lark"``, ``"gbnf"``, or ``"auto"`` (GBNF when the text has ``::=``, else Lark).
    """

    text: str
    syntax: str = "auto"
    param: str = field(default="grammar", compare=False)


Constraint = JsonSchema | Regex | Grammar


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as error:  # pragma: no cover - a dependency of the package
        raise MissingDependencyError(
            "structured output needs llguidance: pip install 'llguidance>=1.0'  (a dependency of specdecode)"
        ) from error
    return llguidance


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar (its JSON grammar format) of ``constraint``, not yet checked.

    Raises:
        ConstraintError: a schema that is not a JSON object, an empty pattern or grammar, an
            unknown grammar syntax.
        TypeError: ``constraint`` is not a :class:`JsonSchema`, :class:`Regex` or :class:`Grammar`.
    """
    ll = _llguidance()
    if isinstance(constraint, JsonSchema):
        schema = constraint.schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ConstraintError(f"not valid JSON: {error}", constraint.param) from None
        if not isinstance(schema, dict):
            raise ConstraintError(f"a JSON schema must be a JSON object, got {type(schema).__name__}", constraint.param)
        try:
            return ll.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        except (ValueError, TypeError) as error:
            raise ConstraintError(str(error), constraint.param) from None
    if isinstance(constraint, Regex):
        if not isinstance(constraint.pattern, str) or not constraint.pattern:
            raise ConstraintError("the pattern must be a non-empty string", constraint.param)
        return ll.LLMatcher.grammar_from_regex(constraint.pattern)
    if isinstance(constraint, Grammar):
        if not isinstance(constraint.text, str) or not constraint.text.strip():
            raise ConstraintError("the grammar must be a non-empty string", constraint.param)
        syntax = constraint.syntax
        if syntax == "auto":
            syntax = "gbnf" if "::=" in constraint.text else "lark"
        if syntax not in ("lark", "gbnf"):
            message = f"syntax must be 'lark', 'gbnf' or 'auto', got {constraint.syntax!r}"
            raise ConstraintError(message, constraint.param)
        try:
            return ll.grammar_from(syntax, constraint.text)
        except ValueError as error:
            raise ConstraintError(str(error), constraint.param) from None
    raise TypeError(f"constraint must be JsonSchema, Regex or Grammar, got {type(constraint).__name__}")


def compile_constraint(constraint: Constraint, ll_tokenizer: Any = None) -> str:
    """:func:`grammar_text`, checked by llguidance (against ``ll_tokenizer`` when given).

    Returns:
        the grammar, ready for :class:`~specdecode.constraints.state.ConstraintState`.

    Raises:
        ConstraintError: llguidance rejects it (unknown schema keyword, regex syntax, grammar
            syntax); the message is llguidance's, prefixed with the parameter's name.
    """
    ll = _llguidance()
    grammar = grammar_text(constraint)
    is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer)
    if is_error:
        raise ConstraintError(messages[0].strip() if messages else "invalid", constraint.param)
    return grammar
