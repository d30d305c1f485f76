"""Proposers kept between a server's requests, so that a request does not build its own.

A proposer that runs a model (``draft_model``, the hybrid, the cross-tokenizer draft) holds a runner:
a llama.cpp context with its KV cache, or a torch static cache with its CUDA graphs. Built per
request, that cost 74-80 ms (330 ms for a process's first two) before the request's first token on
the 2-core AMD EPYC (the default 0.5B GGUF draft: a new llama.cpp context each time, 2026-12-02),
and on a GPU a graph capture per pass width. The calibration's proposer (built in a thread of its
own that has ended) joins the pool too: a llama.cpp context is not bound to a thread; a torch draft's
CUDA graphs replayed from another thread than their capture's are not tested on a GPU yet.

The scheduler takes a proposer from its :class:`ProposerPool` when a request starts and
gives it back, with the batch slot its request left from, when the request leaves the batch. A
request that continues a conversation (its prompt starts with what that slot's cached prefix holds:
:mod:`specdecode.models.prefix_cache`) takes the proposer its slot's last request gave back, only
reset (``reset``: the request in progress), so what it keeps across requests stays: suffix
decoding's store of the conversation's earlier outputs, a draft model's cells (SuffixDecoding,
arXiv 2411.04975: agent loops repeat their own earlier output). Any other request gets a proposer
first cleared (``clear_cache``) and reset, which the proposer contract
(:class:`~specdecode.proposers.base.Proposer`) says leaves the state of a new instance, so it drafts
exactly what a new one would and its drafts depend on no other conversation's text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from specdecode.proposers.base import Proposer

PoolKey = tuple[str, str]
"""A proposer's name and a canonical text of its options: proposers built alike share a key."""


def pool_key(name: str, options: Mapping[str, Any]) -> PoolKey:
    """The key of proposer ``name`` built with ``options`` (keyword arguments of
    :func:`~specdecode.proposers.make_proposer`; values compared by ``repr``)."""
    return name, repr(sorted(options.items()))


class ProposerPool:
    """Idle proposers by :func:`pool_key`, at most ``max_idle`` per key.

    Args:
        build: makes a new proposer from a name and options (the scheduler's
            :func:`~specdecode.proposers.make_proposer` over its target and draft); its errors reach
            :meth:`take`'s caller.
        max_idle: the most idle proposers kept per key (the server's ``max_batch_size``: no more
            are ever in use at once); a proposer given back beyond it is dropped.

    Attributes:
        built: proposers :meth:`take` built; reused: those it took from the pool.

    Raises:
        ValueError: ``max_idle`` < 0.
    """

    def __init__(self, build: Callable[[str, Mapping[str, Any]], Proposer], max_idle: int) -> None:
        if max_idle < 0:
            raise ValueError(f"max_idle must be >= 0, got {max_idle}")
        self._build = build
        self.max_idle = max_idle
        self._idle: dict[PoolKey, list[tuple[Proposer, int | None]]] = {}  # with the slot each left from
        self.built = 0
        self.reused = 0

    def take(self, name: str, options: Mapping[str, Any], continues: int | None = None) -> tuple[Proposer, PoolKey]:
        """A proposer ``name`` with ``options`` and the key to :meth:`give` it back under: the one
        given back from slot ``continues`` (the request continues that slot's conversation), only
        reset; else one in the state of a new one (cleared and reset)."""
        key = pool_key(name, options)
        idle = self._idle.get(key, [])
        mine = [i for i, (_, slot) in enumerate(idle) if continues is not None and slot == continues]
        if mine:
            proposer, _ = idle.pop(mine[-1])
            self.reused += 1
            proposer.reset()
            return proposer, key
        if idle:
            proposer, _ = idle.pop()
            self.reused += 1
        else:
            proposer = self._build(name, options)
            self.built += 1
        proposer.clear_cache()
        proposer.reset()
        return proposer, key

    def give(self, key: PoolKey, proposer: Proposer, slot: int | None = None) -> None:
        """Keep ``proposer`` (taken under ``key``, its request over, which left from batch ``slot``)
        for a later :meth:`take` (the oldest idle one of its key goes past ``max_idle``)."""
        idle = self._idle.setdefault(key, [])
        idle.append((proposer, slot))
        if len(idle) > self.max_idle:
            idle.pop(0)

    def idle(self) -> int:
        """Proposers kept now, over every key."""
        return sum(len(v) for v in self._idle.values())
