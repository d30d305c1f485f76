"""The server's proposer pool: built once per key, cleared and reset when taken again, bounded."""

from __future__ import annotations

import pytest

from specdecode.serve.proposer_pool import ProposerPool, pool_key


class Fake:
    """Counts what the pool did to it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.resets = 0
        self.clears = 0

    def reset(self) -> None:
        self.resets += 1

    def clear_cache(self) -> None:
        self.clears += 1


def test_taken_again_after_a_give_cleared_and_reset_and_keyed_by_options() -> None:
    built: list[Fake] = []

    def build(name, options):
        built.append(Fake(name))
        return built[-1]

    pool = ProposerPool(build, max_idle=2)
    a, key = pool.take("draft_model", {"k": 4})
    assert (a.clears, a.resets) == (1, 1) and key == pool_key("draft_model", {"k": 4})
    pool.give(key, a)
    b, _ = pool.take("draft_model", {"k": 4})
    assert b is a and (b.clears, b.resets) == (2, 2)
    c, other = pool.take("draft_model", {"k": 5})  # other options: another proposer
    d, _ = pool.take("suffix", {})
    assert c is not a and d.name == "suffix" and other != key
    assert (pool.built, pool.reused) == (3, 1)


def test_at_most_max_idle_kept_per_key() -> None:
    pool = ProposerPool(lambda name, options: Fake(name), max_idle=1)
    taken = [pool.take("suffix", {}) for _ in range(3)]
    for proposer, key in taken:
        pool.give(key, proposer)
    assert pool.idle() == 1
    with pytest.raises(ValueError, match="max_idle"):
        ProposerPool(lambda name, options: Fake(name), max_idle=-1)


def test_a_build_error_reaches_the_caller() -> None:
    def broken(name, options):
        raise RuntimeError("no draft model")

    pool = ProposerPool(broken, max_idle=1)
    with pytest.raises(RuntimeError, match="no draft model"):
        pool.take("draft_model", {})
    assert (pool.built, pool.idle()) == (0, 0)


def test_a_conversations_next_request_takes_its_slots_proposer_uncleared() -> None:
    """A request continuing the conversation that left from a slot gets that slot's proposer, only
    reset (what it keeps across requests stays); any other gets one cleared and reset."""
    pool = ProposerPool(lambda name, options: Fake(name), max_idle=4)
    (a, key), (b, _) = pool.take("suffix", {}), pool.take("suffix", {})
    pool.give(key, a, slot=3)
    pool.give(key, b, slot=5)
    again, _ = pool.take("suffix", {}, continues=3)
    assert again is a and (a.clears, a.resets) == (1, 2)
    other, _ = pool.take("suffix", {}, continues=7)  # no proposer left from slot 7
    assert other is b and (b.clears, b.resets) == (2, 2)
