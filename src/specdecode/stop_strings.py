"""Incremental detokenization with stop strings, for streaming.

Text is decoded from all new token ids each time (byte-level BPE decodes a prefix of the ids to a
prefix of the text, up to an unfinished UTF-8 character, shown as U+FFFD and held back). Text that
could be the beginning of a stop string is held back too, so no text past a stop string is ever
emitted, even when the stop string spans several tokens of one accepted draft.
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class StopStringStream:
    """Feed token ids one at a time; get the text that is safe to show.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=True)``.
        stop: stop strings; the text ends right before the first one that appears.
    """

    def __init__(self, tokenizer: Decoder, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.stopped = False

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def add(self, token_id: int) -> str:
        """Add one token; return the new text that can be shown (maybe ``""``).

        After a stop string appears, :attr:`stopped` is True and the text stops before it.
        """
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        cut = min((i for s in self.stop if (i := full.find(s, start)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            safe = cut
        else:
            safe = len(full) - self._held_back(full)
            if full.endswith("\ufffd"):  # an unfinished multi-byte character
                safe = min(safe, len(full) - 1)
        piece = full[len(self.text) : safe] if safe > len(self.text) else ""
        self.text += piece
        return piece

    def finish(self) -> str:
        """The generation ended without a stop string: release the held-back tail."""
        if self.stopped:
            return ""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        piece = full[len(self.text) :]
        self.text = full
        return piece
