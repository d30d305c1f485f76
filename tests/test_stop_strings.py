"""Streaming text with stop strings: nothing past a stop string is ever emitted."""

from __future__ import annotations

import random
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from specdecode.stop_strings import StopStringStream, cleans_up_spaces


class Letters:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def feed(stream: StopStringStream, ids: list[int]) -> list[str]:
    pieces = []
    for i in ids:
        pieces.append(stream.add(i))
        if stream.stopped:
            break
    return pieces


def test_stop_string_spanning_tokens_is_never_emitted() -> None:
    s = StopStringStream(Letters(), stop=("cde",))
    pieces = feed(s, [0, 1, 2, 3, 4, 5])  # a b c d e f
    assert s.stopped and s.text == "ab"
    assert "".join(pieces) == "ab"
    assert pieces[2] == ""  # "c" was held back: it could begin the stop string


def test_held_back_text_is_released() -> None:
    s = StopStringStream(Letters(), stop=("cx",))
    pieces = feed(s, [0, 1, 2, 3])  # "c" held back, then released when "d" shows it is no stop
    assert "".join(pieces) == "abcd" and not s.stopped
    s = StopStringStream(Letters(), stop=("cx",))
    feed(s, [0, 2])
    assert s.text == "a" and s.finish() == "c" and s.text == "ac"


def test_unfinished_utf8_is_held_back() -> None:
    class Bytes:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return bytes(ids).decode("utf-8", errors="replace")

    s = StopStringStream(Bytes())
    euro = list("€".encode())
    assert s.add(euro[0]) == "" and s.add(euro[1]) == "" and s.add(euro[2]) == "€"


# ---------------------------------------------------------------------- incremental decoding
class FullDecodeStream:
    """The reference: every token re-decodes all ids (what StopStringStream computes in windows)."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False

    def _held_back(self, text: str) -> int:
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        cut = min((i for s in self.stop if (i := full.find(s, start)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            safe = cut
        else:
            safe = len(full) - self._held_back(full)
            safe = min(safe, len(full.rstrip("\ufffd")))  # an unfinished character: every U+FFFD at the end
        piece = full[len(self.text) : safe] if safe > len(self.text) else ""
        self.text += piece
        return piece

    def finish(self) -> str:
        if self.stopped:
            return ""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        piece = full[len(self.text) :]
        self.text = full
        return piece


def sentencepiece_like(decoder: str) -> PreTrainedTokenizerFast:
    """A SentencePiece-style vocabulary (``▁`` for spaces, ``<0xNN>`` byte fallback, ``<s>`` / ``</s>``
    special) with Llama 2's decoder (``strip``: Replace, ByteFallback, Fuse, Strip one leading space),
    a Metaspace one (``metaspace``: the first token's leading space dropped) or WordPiece's (``##``)."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    pieces = ["▁", "▁▁", "▁a", "▁the", "b", "c", "▁'", "s", ".", "é", "日本", "▁x", "x", "▁=", "'", "##b", "##c"]
    vocab |= {p: len(vocab) + i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = {
        "strip": decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        ),
        "metaspace": decoders.Metaspace(),
        "wordpiece": decoders.WordPiece(),
    }[decoder]
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def random_cases(tokenizer: Any, rng: random.Random, texts: list[str]) -> list[tuple[list[int], tuple[str, ...]]]:
    """Token sequences (random ids, or encoded text with multi-byte characters) and stop strings (some
    cut from the sequence's own text, so that they appear, often across tokens; some that only start)."""
    n = len(tokenizer)
    cases = []
    for _ in range(150):
        if rng.random() < 0.5:
            ids = [rng.randrange(n) for _ in range(rng.randrange(1, 40))]
        else:
            text = "".join(rng.choice(texts) for _ in range(rng.randrange(1, 6)))
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and rng.random() < 0.5:  # a token cut into a multi-byte character, a special token
                ids.insert(rng.randrange(len(ids)), rng.randrange(n))
        full = tokenizer.decode(ids, skip_special_tokens=True)
        stop: list[str] = []
        for _ in range(rng.randrange(4)):
            if full and rng.random() < 0.7:
                i = rng.randrange(len(full))
                stop.append(full[i : i + rng.randrange(1, 8)])
            else:
                stop.append(rng.choice(["xyz", "e\u20ac", " the q", "\n\n", "b.", "日本語"]))
        cases.append((ids, tuple(stop)))
    return cases


TEXTS = ["the quick ", "def f(x):\n", "prix 5€ ", "日本語 ", "naïve café", "😀👍 ", "it 's a . ", "a = ' ' ", " \n\t"]


@pytest.mark.parametrize("kind", ["byte-level", "strip", "metaspace", "wordpiece"])
def test_windowed_decoding_is_the_full_decode(kind: str, tiny_tokenizer: Any) -> None:
    """Per token the same pieces, stop and held-back text as re-decoding every id, then the same
    finish, over random ids (invalid and unfinished UTF-8, skipped special tokens, byte-fallback
    runs) and encoded text, with stop strings that span tokens."""
    tokenizer = tiny_tokenizer if kind == "byte-level" else sentencepiece_like(kind)
    rng = random.Random(kind)
    for ids, stop in random_cases(tokenizer, rng, TEXTS):
        mine, reference = StopStringStream(tokenizer, stop), FullDecodeStream(tokenizer, stop)
        for i, token in enumerate(ids):
            assert mine.add(token) == reference.add(token), (ids, stop, i)
            assert mine.stopped == reference.stopped
            if reference.stopped:
                break
        assert mine.finish() == reference.finish() and mine.text == reference.text, (ids, stop)


def test_each_token_decodes_a_short_window(tiny_tokenizer: Any) -> None:
    """Adding a token decodes a few ids, not all of them (that cost the square of the length)."""
    lengths: list[int] = []

    class Counting:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            lengths.append(len(ids))
            return tiny_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tiny_tokenizer.encode("".join(TEXTS) * 20, add_special_tokens=False)
    s = StopStringStream(Counting(), stop=("never there",))
    reference = FullDecodeStream(tiny_tokenizer, stop=("never there",))
    assert [s.add(t) for t in ids] == [reference.add(t) for t in ids]
    assert len(ids) > 500 and max(lengths) <= 8 and sum(lengths) <= 4 * len(ids)
    assert s.finish() == reference.finish() and s.text == reference.text == tiny_tokenizer.decode(ids)


def test_clean_up_of_spaces_decodes_everything(tiny_tokenizer: Any) -> None:
    """A decode that cleans up tokenization spaces changes text behind the window (``it`` then
    ``it 's`` -> ``it's``): every step then decodes all ids (transformers 5 skips the clean-up for
    BPE models unless forced)."""
    from tokenizers import Tokenizer, decoders, models

    words = ["[UNK]", "it", "'s", ".", "a", "n't", "?", "'", "b"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece(cleanup=False)
    wordlevel = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    assert wordlevel.decode([1, 2, 3]) == "it's."  # the clean-up is on
    assert cleans_up_spaces(wordlevel) and not cleans_up_spaces(tiny_tokenizer) and not cleans_up_spaces(Letters())
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(1, len(words)) for _ in range(rng.randrange(1, 20))]
        stop = tuple(rng.sample(["s.", "a b", "t's", "?"], rng.randrange(3)))
        mine, reference = StopStringStream(wordlevel, stop), FullDecodeStream(wordlevel, stop)
        for token in ids:
            assert mine.add(token) == reference.add(token) and mine.stopped == reference.stopped, (ids, stop)
        assert mine.finish() == reference.finish(), (ids, stop)


@pytest.mark.parametrize("kind", ["byte-level", "strip", "metaspace"])
def test_streamed_text_is_always_a_prefix_of_the_final_text(kind: str, tiny_tokenizer: Any) -> None:
    """Valid text streamed token by token never shows a character it later takes back: a byte-fallback
    run of a 3- or 4-byte character (``<0xE2><0x82><0xAC>``, decoded ``\ufffd\ufffd`` halfway) is held
    back whole, not shown as U+FFFD (Llama 2's and Mistral's tokenizers)."""
    tokenizer = tiny_tokenizer if kind == "byte-level" else sentencepiece_like(kind)
    rng = random.Random(f"prefix {kind}")
    for _ in range(100):
        text = "".join(rng.choice(TEXTS) for _ in range(rng.randrange(1, 6)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        final = tokenizer.decode(ids, skip_special_tokens=True)
        stream = StopStringStream(tokenizer)
        for i, token in enumerate(ids):
            stream.add(token)
            assert final.startswith(stream.text), (text, i, stream.text)
        stream.finish()
        assert stream.text == final
    if kind == "strip":  # Llama 2's decoder turns <0xNN> runs into characters (Metaspace alone keeps them)
        euro = [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "€".encode()]
        stream = StopStringStream(tokenizer)
        assert [stream.add(t) for t in euro] == ["", "", "€"]
