"""Streaming text with stop strings: nothing past a stop string is ever emitted."""

from __future__ import annotations

from specdecode.stop_strings import StopStringStream


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
