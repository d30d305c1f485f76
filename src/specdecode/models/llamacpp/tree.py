"""Token trees on llama.cpp (the runner contract's ``forward_masked`` / ``compact``), exact.

The torch runner scores a token tree in one pass under an ancestor mask (:mod:`specdecode.tree`).
llama.cpp can express a tree in one batch too, each node tagged with the sequence id of every
branch it lies on, but not exactly, and not in the context the runner keeps:

- with ``kv_unified`` off (every runner here: one KV stream per sequence) a batch whose tokens
  belong to several sequences is refused: ``llama_batch_allocr::split_equal`` does not split
  "coupled" sequences ("you may need to use the -kvu flag");
- with ``kv_unified`` on, the tree's nodes share one run of KV cells, so between a node's
  ancestors lie its relatives' cells, masked. The masked cells add exact zeros, but they shift which
  SIMD lane and partial sum each real term of the softmax and of the ``V`` product goes to, so a
  node's logits round differently from the same branch decoded as a chain; and after a step the
  kept path's cells have holes that the next tokens fill out of order.

So the tree is walked depth-first on the runner's one sequence: the cache always holds one root
path of the tree after the cached sequence, in consecutive cells, as plain decoding would have
them; a run of nodes that continues that path is decoded in one pass (in exact mode, in chunks of
at most ``invariant_tokens``, the batch-invariant pass sizes), and going to another branch rolls
back to the fork (``llama_memory_seq_rm``) and decodes the branch from there. Every node is decoded
once, after exactly its ancestors, at its own position, so its logits are bit-identical to
decoding its branch token by token (exact mode; tested). The first child of every node is visited
last, so after the pass the cache holds the most likely path (siblings are ordered best first);
:meth:`TreeCache.settle` (``compact``) keeps the accepted path, rolling back to where it leaves the
cached one and decoding the rest of it again (a chunked pass without logits) when it does.

With ``greedy`` (a hint of the contract, as ``greedy_draft`` for chains) only the nodes greedy
verification can reach are decoded: from each node the walk goes on to the child whose token is
the node's argmax, so a greedy tree step costs the accepted path plus at most one chunk, and the
cache ends on the accepted path. Rows of nodes it never reached are NaN; the greedy verifier
(:func:`specdecode.verify.greedy_verify_tree`) reads the rows of the nodes on its path only, which
are the ones decoded.

The cost: a tree of N nodes takes as many ``llama_decode`` calls as it has branches (and chunks),
not one, and a draft model's per-depth tree expansion (``DraftModelProposer.propose_tree``, whose
nodes of one depth sit on different branches) decodes one node per call plus the ancestors it
rolls back to. Measured in docs/llamacpp.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdecode.sampling import argmax_ids


class TreeCache:
    """The logical cache of a llama.cpp runner that holds a token tree (see the module docstring).

    Entries ``0 .. trunk - 1`` are the plain cached sequence (cells ``0 .. trunk - 1``); entries from
    ``trunk`` on are tree nodes, each with a token and a parent entry (``trunk - 1`` for a node on
    the cached sequence; ``-1`` when nothing is cached); ``physical`` lists the tree entries in the
    cells after ``trunk``, in order: always one root path.

    Args:
        trunk: tokens cached before the first tree pass.
        chunk: most tokens of one ``llama_decode``.
        decode: ``decode(ids, start, scored) -> (logits [sum(scored), V] | None, hidden [n, H] | None)``:
            one pass over ``ids`` at positions ``start ..``; hidden states when the pass wants them.
        cut: ``cut(n)``: drop every cell from ``n`` on (``llama_memory_seq_rm``).
    """

    def __init__(
        self,
        trunk: int,
        chunk: int,
        decode: Callable[[list[int], int, list[bool]], tuple[torch.Tensor | None, torch.Tensor | None]],
        cut: Callable[[int], None],
    ) -> None:
        self.trunk = trunk
        self.chunk = chunk
        self._decode = decode
        self._cut = cut
        self.tokens: list[int] = []  # entry trunk + j -> its token
        self.parents: list[int] = []  # entry trunk + j -> its parent entry
        self.physical: list[int] = []  # the tree entries in cells trunk, trunk + 1, ...
        self.hidden: dict[int, torch.Tensor] = {}  # entry -> its hidden state [H], of passes that returned them

    @property
    def length(self) -> int:
        """Entries: cached tokens and tree nodes."""
        return self.trunk + len(self.tokens)

    def parent(self, entry: int) -> int:
        return entry - 1 if entry < self.trunk else self.parents[entry - self.trunk]

    def path(self, entry: int) -> list[int]:
        """The tree entries from the first below the cached sequence down to ``entry`` ([] for a cached one)."""
        out: list[int] = []
        while entry >= self.trunk:
            out.append(entry)
            entry = self.parents[entry - self.trunk]
        return out[::-1]

    # ------------------------------------------------------------------ adding nodes
    def add(self, ids: list[int], positions: list[int], attend: torch.Tensor) -> list[int]:
        """Record new nodes: ``ids`` with their ``positions`` and ``attend`` (bool ``[M, length + M]``);
        returns their entries.

        Raises:
            ValueError: a node that does not attend to exactly the whole cached sequence, the tree
                nodes on one root path and itself, or whose position is not its depth's.
        """
        L0, M = self.length, len(ids)
        try:
            self._add(ids, positions, attend.to(torch.bool).cpu())
        except ValueError:
            del self.tokens[L0 - self.trunk :], self.parents[L0 - self.trunk :]  # nothing recorded
            raise
        return list(range(L0, L0 + M))

    def _add(self, ids: list[int], positions: list[int], rows: torch.Tensor) -> None:
        L0, M = self.length, len(ids)
        for i in range(M):
            entry = L0 + i
            seen = rows[i, :entry].nonzero().flatten()  # (s,) what it attends to before itself
            parent = int(seen[-1]) if seen.numel() else -1
            if parent < self.trunk - 1:
                raise ValueError(
                    f"forward_masked on llama.cpp: node {i} must attend to all {self.trunk} cached tokens "
                    "(a tree continues the whole cached sequence)"
                )
            expected = torch.zeros(L0 + M, dtype=torch.bool)
            expected[: self.trunk] = True
            lineage = self.path(parent)  # the tree nodes above it (parents are recorded as nodes are added)
            expected[lineage] = True
            expected[entry] = True
            if not torch.equal(rows[i], expected):
                raise ValueError(
                    f"forward_masked on llama.cpp: node {i} attends to other entries than the cached sequence, "
                    "its ancestors and itself (llama.cpp runs trees, not arbitrary masks)"
                )
            if positions[i] != self.trunk + len(lineage):
                raise ValueError(
                    f"forward_masked on llama.cpp: node {i} has position {positions[i]}, its depth gives "
                    f"{self.trunk + len(lineage)}"
                )
            self.tokens.append(ids[i])
            self.parents.append(parent)

    # ------------------------------------------------------------------ decoding
    def ensure(self, lineage: list[int]) -> None:
        """Make the cells after the cached sequence hold ``lineage`` (a root path): roll back to
        where they part, decode the rest (no logits, chunks of :attr:`chunk`)."""
        k = 0
        while k < min(len(lineage), len(self.physical)) and lineage[k] == self.physical[k]:
            k += 1
        if k < len(self.physical):
            self._cut(self.trunk + k)
            del self.physical[k:]
        for start in range(k, len(lineage), self.chunk):
            part = lineage[start : start + self.chunk]
            tokens = [self.tokens[e - self.trunk] for e in part]
            self._decode(tokens, self.trunk + len(self.physical), [False] * len(part))
            self.physical.extend(part)

    def run(self, entries: list[int]) -> torch.Tensor:
        """Decode ``entries`` (a chain, at most :attr:`chunk` long) after their first one's ancestors;
        float32 logits ``[len(entries), V]``."""
        self.ensure(self.path(self.parent(entries[0])))
        tokens = [self.tokens[e - self.trunk] for e in entries]
        out, hidden = self._decode(tokens, self.trunk + len(self.physical), [True] * len(entries))
        assert out is not None
        if hidden is not None:
            self.hidden.update(zip(entries, hidden, strict=True))
        self.physical.extend(entries)
        return out

    def children(self, entries: list[int]) -> dict[int, list[int]]:
        """Per entry of ``entries`` (and their parents), its children among ``entries``, in order."""
        kids: dict[int, list[int]] = {}
        for e in entries:
            kids.setdefault(self.parent(e), []).append(e)
        return kids

    def score_all(self, entries: list[int]) -> dict[int, torch.Tensor]:
        """Decode every entry of ``entries`` (new nodes, topological order), depth first with each
        node's first child last; returns each entry's logits row ``[V]``."""
        kids = self.children(entries)
        new = set(entries)
        roots = [e for e in entries if self.parent(e) not in new]
        order: list[int] = []
        stack = list(roots)
        while stack:
            entry = stack.pop()
            order.append(entry)
            stack.extend(kids.get(entry, []))  # popped last to first: the first child is visited last
        rows: dict[int, torch.Tensor] = {}
        run: list[int] = []
        for entry in order + [-2]:  # -2: flush the last run
            if run and entry != -2 and self.parent(entry) == run[-1] and len(run) < self.chunk:
                run.append(entry)
                continue
            if run:
                rows.update(zip(run, self.run(run), strict=True))
            run = [entry]
        return rows

    def score_greedy(self, entries: list[int]) -> dict[int, torch.Tensor]:
        """Decode the nodes of ``entries`` (one tree, its root first) that greedy verification
        reaches: from a node, the first child whose token is the node's argmax. Each pass takes a
        node and its first-child chain up to :attr:`chunk` nodes; returns the decoded rows."""
        kids = self.children(entries)
        rows: dict[int, torch.Tensor] = {}
        start: int | None = entries[0]
        while start is not None:
            segment = [start]
            while len(segment) < self.chunk and kids.get(segment[-1]):
                segment.append(kids[segment[-1]][0])
            out = self.run(segment)
            start = None
            for j, entry in enumerate(segment):
                rows[entry] = out[j]
                best = int(argmax_ids(out[j]))
                nxt = next((c for c in kids.get(entry, []) if self.tokens[c - self.trunk] == best), None)
                if nxt is None:
                    break  # the walk ends here
                if j + 1 < len(segment) and segment[j + 1] == nxt:
                    continue
                start = nxt  # another child: roll back to this node and go on from it
                break
        return rows

    # ------------------------------------------------------------------ keeping a path
    def settle(self, keep: list[int]) -> int:
        """Keep entries ``[0, keep[0])`` and ``keep``, which must be one chain (each the parent of
        the next); the cells then hold exactly them. Returns the new length (the tree is gone).

        Raises:
            ValueError: ``keep`` is empty, not increasing, out of range, or not one chain.
        """
        if (
            not keep
            or keep[0] < 0
            or keep[-1] >= self.length
            or any(b <= a for a, b in zip(keep, keep[1:], strict=False))
        ):
            raise ValueError(f"keep must be increasing entries in [0, {self.length}), got {keep}")
        previous = keep[0] - 1
        for entry in range(self.trunk, keep[0]):  # tree entries before keep[0] stay too
            if self.parent(entry) != entry - 1:
                raise ValueError("compact: the entries before keep[0] are not one chain")
        for entry in keep:
            if self.parent(entry) != previous:
                raise ValueError(
                    f"compact on llama.cpp: keep must be one root path of the tree (entry {entry}'s parent is "
                    f"{self.parent(entry)}, not {previous})"
                )
            previous = entry
        if keep[-1] < self.trunk:
            self._cut(keep[-1] + 1)
            return keep[-1] + 1
        self.ensure(self.path(keep[-1]))
        return self.trunk + len(self.physical)
