"""Prefix caching over a batched runner's slots: what a finished request read stays for the next.

Chat clients, editors and agents re-send the whole history every turn. A batched runner whose
rows are slots with KV streams of their own (llama.cpp's sequence ids, ``kv_unified`` off) keeps a
finished row's cells in its slot instead of freeing them (``remove_row(row, keep=True)``); a new
request then adopts the idle slot whose cached tokens share the longest common prefix with its
prompt (``add_row(slot, keep=n)``: the cells past ``n`` dropped) and prefills only the rest. This is
llama-server's slot reuse (``cache_prompt``, a slot picked by prompt similarity) and what vLLM's
automatic prefix caching and SGLang's RadixAttention report as cached tokens; the structure here
is the scheduler's bookkeeping of which slot holds which tokens, nothing inside the runner.

Within the KV budget by construction: a slot's cells are reserved when the context is made, so an
idle cached prefix costs no memory a running request could use; a request that finds no empty slot
evicts the least recently used idle one. A request is never refused or failed for the cache.

Scopes: a cached prefix is offered only to requests of the same scope key (``None`` for the
server-wide ``global`` scope; a client's ``user`` under ``--prefix-cache-scope user``). A shared
cache is a timing side channel: a request that hits a prefix answers its first token sooner, which
tells its sender that someone sent that prefix before (docs/serving.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SIMILARITY = 0.5
"""An idle slot is a request's own continuation when the common prefix covers at least this share
of the slot's cached tokens (llama-server's ``--slot-prompt-similarity``, 0.5 there too); then it
is taken even where an empty slot is free. A smaller common prefix (a shared system prompt) is
used only when no empty slot is left, so one conversation does not take another's cache for a few
tokens."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class CachedPrefix:
    """An idle slot's cached tokens (its cells hold ``ids`` at positions ``0 .. len(ids) - 1``).

    Attributes:
        ids: the token ids the slot's cells hold.
        scope: who may reuse them (None: anyone).
        used: when it was last left (the cache's clock: larger is more recent).
    """

    ids: tuple[int, ...]
    scope: str | None
    used: int


@dataclass(frozen=True)
class Pick:
    """A slot for a new request (:meth:`PrefixCache.pick`).

    Attributes:
        slot: the slot to add the row on.
        reused: prompt tokens whose cells the slot already holds (0 <= reused < prompt length).
        evicted: the idle cached prefix whose cells past ``reused`` are dropped for this request,
            which does not continue it (the least recently used one, or one sharing only a
            short prefix such as a system prompt); None: the slot was empty or its own.
    """

    slot: int
    reused: int
    evicted: tuple[int, ...] | None = None


class PrefixCache:
    """Which idle slot of a batched runner holds which tokens, and which slot a new request takes.

    Attributes:
        idle: per idle slot that holds cells, its :class:`CachedPrefix`.
    """

    def __init__(self) -> None:
        self.idle: dict[int, CachedPrefix] = {}
        self._clock = itertools.count()

    def pick(self, prompt: Sequence[int], free: Iterable[int], scope: str | None = None) -> Pick:
        """The slot a request with ``prompt`` takes among the ``free`` slots (not running a row),
        and how many of its tokens are cached there. The slot leaves the idle set (its row now).

        In order: the idle slot of ``scope`` sharing the longest common prefix, when that covers at
        least :data:`SIMILARITY` of what it holds (a conversation's next turn); else the lowest
        empty slot; else the idle slot of ``scope`` with the longest common prefix, if any;
        else the least recently used idle slot (evicted). At most ``len(prompt) - 1`` tokens are
        reused: the prompt's last token is always fed, for its logits.

        Raises:
            ValueError: an empty prompt.
            RuntimeError: no free slot.
        """
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        free = sorted(free)
        if not free:
            raise RuntimeError("no free slot for a new row")
        mine = [s for s in free if s in self.idle and self.idle[s].scope == scope]
        shared = {s: min(common_prefix(self.idle[s].ids, prompt), len(prompt) - 1) for s in mine}
        best = max(mine, key=lambda s: (shared[s], self.idle[s].used), default=None)
        best_n = shared[best] if best is not None else 0
        if best_n == 0:
            best = None
        empty = [slot for slot in free if slot not in self.idle]
        if best is not None and best_n >= SIMILARITY * len(self.idle[best].ids):
            del self.idle[best]
            return Pick(best, best_n)
        if empty:
            return Pick(empty[0], 0)
        if best is not None:
            return Pick(best, best_n, self.idle.pop(best).ids)
        oldest = min((s for s in free if s in self.idle), key=lambda s: self.idle[s].used)
        return Pick(oldest, 0, self.idle.pop(oldest).ids)

    def leave(self, slot: int, ids: Sequence[int], scope: str | None = None) -> None:
        """A finished row's ``slot`` keeps its cells, which hold ``ids`` (its cached tokens)."""
        if ids:
            self.idle[slot] = CachedPrefix(tuple(int(i) for i in ids), scope, next(self._clock))
        else:
            self.idle.pop(slot, None)
