"""The ``logprobs`` fields of the OpenAI API: validation of the request's fields, and the response
objects built from :class:`~specdecode.logprobs.TokenLogprob` records.

Values are the target's raw distribution (:mod:`specdecode.logprobs`: ``log_softmax`` of its
float32 logits, before temperature / top-k / top-p), the same with speculation on or off.

Request fields (OpenAI's rules; 20 alternatives at most, as OpenAI's chat and vLLM):

- chat: ``logprobs`` (bool) turns them on; ``top_logprobs`` (0 .. 20) alternatives per position,
  above 0 only with ``logprobs: true``;
- completions: ``logprobs`` (0 .. 20) turns them on with that many alternatives.

Response shapes:

- chat: ``choices[].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}, ...]}, ...]}``; in a stream, each chunk carries the entries of its tokens;
- completions: ``choices[].logprobs = {"tokens", "token_logprobs", "top_logprobs", "text_offset"}``,
  ``top_logprobs`` one ``{token text: logprob}`` dict per position holding the N alternatives and
  the chosen token (so up to N + 1 entries, as OpenAI says), ``text_offset`` each token's start in
  the completion text (the running sum of the tokens' texts); in a stream, per chunk, offsets
  continuing.

A log-probability below ``-9999`` (or ``-inf``) is reported as ``-9999.0``, as vLLM does: JSON has
no infinity.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from specdecode.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, check_num_logprobs

FLOOR = -9999.0  # JSON has no -inf
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte fallback


def completion_num_logprobs(value: Any) -> int | None:
    """``/v1/completions`` ``logprobs``: None (or false) is off, an integer in ``[0, 20]`` the
    number of alternatives.

    Raises:
        ValueError: anything else (true, a negative or larger number, a string); names ``logprobs``.
    """
    if value is None or value is False:
        return None
    if isinstance(value, bool):
        raise ValueError(
            f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] on /v1/completions (the number of "
            "alternatives per token), got true"
        )
    return check_num_logprobs(value, "logprobs")


def chat_num_logprobs(logprobs: Any, top_logprobs: Any) -> int | None:
    """``/v1/chat/completions``: the number of alternatives (None: off) from ``logprobs`` (bool)
    and ``top_logprobs`` (``[0, 20]``; above 0 only with ``logprobs: true``).

    Raises:
        ValueError: ``logprobs`` not a boolean, ``top_logprobs`` out of range or given without
            ``logprobs: true``; the message names the field.
    """
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ValueError(
            f"logprobs must be true or false on /v1/chat/completions (the number of alternatives is "
            f"top_logprobs), got {logprobs!r}"
        )
    top = check_num_logprobs(top_logprobs, "top_logprobs")
    if top and not logprobs:  # 0 without logprobs is harmless (as vLLM reads it)
        raise ValueError("top_logprobs needs logprobs: true")
    return (top or 0) if logprobs else None


@lru_cache(maxsize=1)
def _bytes_of_char() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-unicode table (byte-level BPE tokens are written in it)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The raw bytes of one token: a byte-level BPE token's own bytes (GPT-2's table inverted), a
    SentencePiece byte token's (``<0x0A>``) or word piece's (``▁`` is a space), else the UTF-8 of
    its decoded text. A token that is part of a character gives its part (not U+FFFD)."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id)) if hasattr(tokenizer, "convert_ids_to_tokens") else None
    if isinstance(piece, str) and piece:
        table = _bytes_of_char()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        byte = _BYTE_TOKEN.match(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        if "▁" in piece:
            return piece.replace("▁", " ").encode("utf-8")
    return tokenizer.decode([int(token_id)]).encode("utf-8")


def _value(logprob: float) -> float:
    return logprob if logprob >= FLOOR else FLOOR


class LogprobsFormat:
    """One request's ``logprobs`` objects, chunk by chunk (it keeps the completion's text offset).

    Args:
        tokenizer: the target's tokenizer (``decode``, ``convert_ids_to_tokens``), used in the
            HTTP layer's thread.
        chat: the chat shape (else the completions shape).
    """

    def __init__(self, tokenizer: Any, chat: bool) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.offset = 0  # completions: characters of completion text before the next token
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        """A token's text (``tokenizer.decode([id])``), cached."""
        if token_id not in self._texts:
            self._texts[token_id] = self.tokenizer.decode([token_id])
        return self._texts[token_id]

    def format(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        """The ``logprobs`` object of a choice (or of a chunk) for ``entries``, the tokens it carries."""
        return self._chat(entries) if self.chat else self._completion(entries)

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self.text(token_id),
            "logprob": _value(logprob),
            "bytes": list(token_bytes(self.tokenizer, token_id)),
        }

    def _chat(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        content = []
        for e in entries:
            item = self._chat_entry(e.token_id, e.logprob)
            item["top_logprobs"] = [self._chat_entry(t, lp) for t, lp in e.top]
            content.append(item)
        return {"content": content}

    def _completion(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        for e in entries:
            text = self.text(e.token_id)
            tokens.append(text)
            values.append(_value(e.logprob))
            top: dict[str, float] = {}
            for t, lp in [*e.top, (e.token_id, e.logprob)]:  # the chosen token is always there
                top.setdefault(self.text(t), _value(lp))  # two tokens of one text: the likelier
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
