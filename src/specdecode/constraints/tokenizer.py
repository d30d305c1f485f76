"""The llguidance view of the target's tokenizer (built once per tokenizer, ~1 s for Qwen2.5's)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from specdecode.constraints.spec import _llguidance

_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], Any]] = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> Any:
    """An ``llguidance.LLTokenizer`` for ``tokenizer``, whose masks span the target's logits.

    Args:
        tokenizer: a Hugging Face *fast* tokenizer (the engine's; on the llama.cpp backend the one
            read from the GGUF file), or an ``llguidance.LLTokenizer`` (returned as it is), or any
            tokenizer with an ``llguidance_tokenizer`` attribute holding one.
        vocab_size: the width V of the target's logits (may exceed the tokenizer's size: the extra
            ids are never allowed; a tokenizer with more ids than V gets masks cut to V).
        eos_token_ids: the ids that end a sequence; the grammar allows them once it is complete.

    Raises:
        ValueError: a slow (Python) tokenizer, or none.
    """
    ll = _llguidance()
    tokenizer = getattr(tokenizer, "llguidance_tokenizer", tokenizer)  # a tokenizer that brings its own
    if isinstance(tokenizer, ll.LLTokenizer):
        return tokenizer
    if tokenizer is None or not getattr(tokenizer, "is_fast", False):
        raise ValueError("constraint: structured output needs the target's fast (Rust) tokenizer")
    eos = tuple(sorted(set(eos_token_ids))) or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
    key = (int(vocab_size), eos)
    per_tokenizer = _CACHE.setdefault(tokenizer, {})
    if key not in per_tokenizer:
        import llguidance.hf

        n_vocab = max(int(vocab_size), len(tokenizer))  # ids past V (added tokens) are never in the logits
        made = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=list(eos) or None)
        per_tokenizer[key] = made
    return per_tokenizer[key]
