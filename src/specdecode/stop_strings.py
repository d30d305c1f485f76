"""Incremental detokenization with stop strings, for streaming.

The text is what decoding all new token ids at once gives (byte-level BPE decodes a prefix of the
ids to a prefix of the text, up to an unfinished UTF-8 character, shown as U+FFFD and held back; a
SentencePiece byte-fallback run shows one U+FFFD per byte until the character is complete, so the
whole trailing run of them is held back, until more text or the end releases it).
Text that could be the beginning of a stop string is held back too, so no text past a stop string
is ever emitted, even when the stop string spans several tokens of one accepted draft.

Each token decodes a short window of the ids, not all of them (which costs the square of the
output length), as vLLM's incremental detokenizer and Hugging Face's ``TextStreamer`` do. The
text of the ids before a *settled* boundary is kept (its last characters, those a stop string may
still reach); the text after the boundary is the decode of the ids from the boundary before it on,
less that earlier stretch's own decode: those ids give the window's later ones their context (a
SentencePiece decoder drops the leading space of the first token it decodes). A boundary settles at
the latest token when the text there does not end in U+FFFD (no unfinished character straddles it)
and the ids since the previous boundary decode to some text (not only skipped special tokens);
until then the window grows. For decoders that turn each token into text on its own apart from
those two effects (byte-level BPE; SentencePiece's Metaspace, ByteFallback, Strip) that is what
decoding all ids gives. A step whose window does not begin with the earlier stretch's decode (a
byte-fallback run that turned invalid changes text before the boundary) decodes all ids, as every
step does for a tokenizer that cleans up tokenization spaces (`` 's`` to ``'s`` across tokens).
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def cleans_up_spaces(tokenizer: object) -> bool:
    """Whether ``tokenizer.decode`` cleans up tokenization spaces (`` .`` to ``.``, `` 's`` to
    ``'s``, ...) over the whole text: ``clean_up_tokenization_spaces`` set, unless transformers
    skips it for a BPE model (transformers 5 does, without
    ``clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output``)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    backend = getattr(tokenizer, "backend_tokenizer", None)
    bpe = backend is not None and type(backend.model).__name__ == "BPE"
    override = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    return not (bpe and hasattr(tokenizer, override) and not getattr(tokenizer, override))


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
        # The settled boundary (module docstring): the ids before `_read` decode to a text of which
        # `_settled` is the part from character `_base` on (the part a stop string may still reach);
        # the ids from `_prefix` to `_read` decode, on their own, to `_prefix_text`.
        self._prefix = 0
        self._read = 0
        self._prefix_text = ""
        self._settled = ""
        self._base = 0
        self._whole = cleans_up_spaces(tokenizer)  # then every step decodes all ids

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _tail(self) -> tuple[str, int]:
        """``(tail, base)``: the text of all ids (their decode at once) from character ``base`` on;
        ``base <= max(0, len(self.text) - max(len(s) for s in self.stop))``."""
        if not self._whole:
            window = self._decode(self.ids[self._prefix :])
            if window.startswith(self._prefix_text):
                return self._settled + window[len(self._prefix_text) :], self._base
        return self._decode(self.ids), 0  # the window's decode is not local here: decode everything

    def add(self, token_id: int) -> str:
        """Add one token; return the new text that can be shown (maybe ``""``).

        After a stop string appears, :attr:`stopped` is True and the text stops before it.
        """
        self.ids.append(token_id)
        tail, base = self._tail()  # the whole text is `base` characters (not kept) + tail
        end = base + len(tail)
        longest = max((len(s) for s in self.stop), default=0)
        start = max(0, len(self.text) - longest)  # a stop string found earlier would have stopped
        cut = min((base + i for s in self.stop if (i := tail.find(s, start - base)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            safe = cut
        else:
            safe = end - self._held_back(tail)
            # an unfinished multi-byte character: byte-level BPE shows it as one U+FFFD, a SentencePiece
            # byte-fallback run as one per byte so far (<0xE2><0x82> is two before <0xAC> makes a euro)
            safe = min(safe, end - (len(tail) - len(tail.rstrip("\ufffd"))))
        piece = tail[len(self.text) - base : safe - base] if safe > len(self.text) else ""
        self.text += piece
        self._settle(tail, base, longest)
        return piece

    def _settle(self, tail: str, base: int, longest: int) -> None:
        """Move the settled boundary to the end of the ids if the text there is complete (no
        trailing U+FFFD) and the ids since the boundary decode to some text on their own."""
        if self._whole or tail.endswith("\ufffd"):
            return
        prefix_text = self._decode(self.ids[self._read :])
        if not prefix_text:  # e.g. only skipped special tokens: no context for the next window
            return
        # Later stop searches start here or after (the emitted text can outrun the decode where
        # the decode is not prefix-stable, e.g. byte-fallback runs that turned invalid).
        keep = min(max(base, len(self.text) - longest), base + len(tail))
        self._prefix, self._read, self._prefix_text = self._read, len(self.ids), prefix_text
        self._settled, self._base = tail[keep - base :], keep

    def finish(self) -> str:
        """The generation ended without a stop string: release the held-back tail."""
        if self.stopped:
            return ""
        full = self._decode(self.ids)  # once per stream: everything, at once
        piece = full[len(self.text) :]
        self.text = full
        return piece
