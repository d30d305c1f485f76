"""Structured output: constrain the target's output to a JSON schema, a regular expression or a
grammar, exactly, under speculation (docs/structured.md).

- :mod:`.spec`: the constraints a caller names (:class:`JsonSchema`, :class:`Regex`,
  :class:`Grammar`) and their compilation to an llguidance grammar;
- :mod:`.tokenizer`: the llguidance view of the target's tokenizer;
- :mod:`.state`: one sequence's grammar state: masks per draft position, grammar-aware drafting
  (cut at a forbidden token, forced tokens as free drafts), advance and rollback;
- :mod:`.masked_verify`: verification against the masked target distribution (pure functions);
- :mod:`.build`: from a constraint and the target's tokenizer to a sequence's state.

llguidance (guidance-ai) is imported only when a constraint is used.
"""

from specdecode.constraints.spec import Constraint, ConstraintError, Grammar, JsonSchema, Regex

__all__ = ["Constraint", "ConstraintError", "Grammar", "JsonSchema", "Regex"]
