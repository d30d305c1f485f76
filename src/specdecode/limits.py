"""The allowed range of ``num_speculative_tokens`` (k), written once.

Everything that checks or documents a k (the engine, the server's settings and request schema,
proposers' defaults, schedules, the command line) reads these names; the literal bounds appear
nowhere else (``tests/test_admission.py`` checks). The module imports nothing, so the command line
can use it without loading torch.
"""

from __future__ import annotations

from typing import Any

MIN_SPECULATIVE_TOKENS = 1
MAX_SPECULATIVE_TOKENS = 64
K_RANGE = f"[{MIN_SPECULATIVE_TOKENS}, {MAX_SPECULATIVE_TOKENS}]"  # for messages and help texts


def is_num_speculative_tokens(k: Any) -> bool:
    """``k`` is an integer (not a bool) in ``[MIN_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS]``."""
    return isinstance(k, int) and not isinstance(k, bool) and MIN_SPECULATIVE_TOKENS <= k <= MAX_SPECULATIVE_TOKENS


def check_num_speculative_tokens(k: Any, name: str = "num_speculative_tokens", optional: bool = False) -> Any:
    """Return ``k`` if it is a valid number of speculative tokens.

    Args:
        k: the value to check.
        name: how the message names it (``"num_speculative_tokens"``, ``"--num-speculative-tokens"``,
            ``"max_speculative_tokens"``, ...).
        optional: None is valid too (and returned).

    Raises:
        ValueError: ``k`` is not an integer in ``[1, 64]`` (nor None when ``optional``):
            ``"{name} must be [None or ]an integer in [1, 64], got {k!r}"``.
    """
    if (optional and k is None) or is_num_speculative_tokens(k):
        return k
    either = "None or " if optional else ""
    raise ValueError(f"{name} must be {either}an integer in {K_RANGE}, got {k!r}")
