"""Token trees: many draft continuations verified in one target pass (SpecInfer, Medusa, EAGLE-2).

A chain of k drafts dies at its first wrong token. A tree keeps several candidates per position;
the target scores every node in one pass (each node attends to the prefix and its own ancestors
only) and the verifier walks down the tree, keeping the longest path it accepts.

Node numbering, used everywhere in this project: node 0 is the *root*, the last token of the
context (the token the target has not cached yet, fed first as in the chain loop); nodes
``1 .. N`` are drafted tokens in topological order (every parent before its children, in
practice breadth-first). A tree is given by ``parents``: int64 ``[N]``, ``parents[i - 1]`` is the
parent node of node ``i``, in ``[0, i)``. Siblings are ordered: the verifier tries them in node
order, so a proposer puts its most likely candidate first.

Two kinds of tree:

- **static**: a fixed shape given as a list of paths of candidate ranks (Medusa's "tree
  choices"): ``[0]`` is the proposer's top candidate after the root, ``[0, 1]`` the second
  candidate after that one, ... Compiled once (:func:`compile_paths`) into parents, depths,
  ranks, the tree attention mask and the retrieve indices of every root-to-leaf path.
  Named shapes are in :data:`TREE_SHAPES` (``treeN``: the N nodes of largest expected accepted
  length for the default draft's measured rank acceptance, :func:`greedy_paths`, with a depth cap,
  since each depth costs one draft pass); ``default`` is the shape that peaked on this project's
  benchmark machine (lab/notebook/2026-11-21-token-trees.md).
- **dynamic** (EAGLE-2, Li et al. 2024, arXiv 2406.16858): built per step from the proposer's
  cumulative log-probabilities; each depth expands the ``top_k`` best nodes of the previous one
  by their ``top_k`` best children, and the ``budget`` nodes of highest cumulative log-probability
  are kept (:class:`DynamicTree`).

``--tree`` / ``tree=`` takes a shape name, a path to a JSON list of paths, or ``dynamic:N``
(``dynamic:N:D:K`` sets the depth D and the branching K too), see :func:`parse_tree`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

MAX_TREE_NODES = 256
MAX_TREE_DEPTH = 64


def tree_attention(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depths and ancestor mask of a tree given by its parents.

    Args:
        parents: int64 ``[N]``; ``parents[i - 1]`` is the parent of node ``i``, in ``[0, i)``.

    Returns:
        ``(depths, mask)``: int64 ``[N + 1]`` (root 0), and bool ``[N + 1, N + 1]`` with
        ``mask[i, j]`` true when node j is node i or one of its ancestors (what node i attends to
        inside the tree).

    Raises:
        ValueError: ``parents`` is not a 1-D integer tensor in topological order.
    """
    parents = _check_parents(parents)
    N = parents.shape[0]
    depths = torch.zeros(N + 1, dtype=torch.int64)  # (N + 1,)
    mask = torch.eye(N + 1, dtype=torch.bool)  # (N + 1, N + 1)
    for i, parent in enumerate(parents.tolist(), start=1):
        depths[i] = depths[parent] + 1
        mask[i] |= mask[parent]
    return depths, mask


def _check_parents(parents: torch.Tensor) -> torch.Tensor:
    parents = torch.as_tensor(parents)
    if parents.dim() != 1 or parents.is_floating_point() or parents.dtype == torch.bool:
        raise ValueError(f"parents must be a 1-D integer tensor, got {parents.dtype} {list(parents.shape)}")
    parents = parents.to(torch.int64)
    index = torch.arange(1, parents.shape[0] + 1)
    if parents.numel() and (bool((parents < 0).any()) or bool((parents >= index).any())):
        raise ValueError("parents[i - 1] (the parent of node i) must be in [0, i): nodes in topological order")
    return parents


def children_lists(parents: torch.Tensor) -> list[list[int]]:
    """Per node ``0 .. N``, its children in node order (the order the verifier tries them)."""
    children: list[list[int]] = [[] for _ in range(parents.shape[0] + 1)]
    for i, parent in enumerate(parents.tolist(), start=1):
        children[parent].append(i)
    return children


@dataclass(frozen=True)
class TreeShape:
    """A static tree, compiled once from its paths of candidate ranks.

    Attributes:
        paths: the paths, sorted by length then ranks (node ``i`` is ``paths[i - 1]``).
        parents: int64 ``[N]``, the parent node of nodes ``1 .. N``.
        ranks: int64 ``[N]``, which candidate of its parent each node is (0 = the best).
        depths: int64 ``[N + 1]``, depth of each node (root 0): its position offset.
        mask: bool ``[N + 1, N + 1]``, ``mask[i, j]``: node i attends to node j.
        retrieve: int64 ``[L, D + 1]``, the nodes of each root-to-leaf path (root first), padded
            with -1; L leaves, D the depth.
        name: the shape's name or source.
    """

    paths: tuple[tuple[int, ...], ...]
    parents: torch.Tensor
    ranks: torch.Tensor
    depths: torch.Tensor
    mask: torch.Tensor
    retrieve: torch.Tensor
    name: str = "custom"

    @property
    def num_nodes(self) -> int:
        """N, drafted nodes (the root not counted)."""
        return len(self.paths)

    @property
    def depth(self) -> int:
        return len(self.paths[-1]) if self.paths else 0

    def widths(self) -> list[int]:
        """Per node ``0 .. N``: how many candidates the proposer must rank after it (1 + max child rank, or 0)."""
        widths = [0] * (self.num_nodes + 1)
        for parent, rank in zip(self.parents.tolist(), self.ranks.tolist(), strict=True):
            widths[parent] = max(widths[parent], rank + 1)
        return widths


def compile_paths(paths: list[list[int]] | tuple[tuple[int, ...], ...], name: str = "custom") -> TreeShape:
    """Compile a static tree from its paths of candidate ranks (Medusa's tree choices).

    Args:
        paths: non-empty list of non-empty lists of ranks >= 0; every prefix of a path must be a path
            too (e.g. ``[[0], [1], [0, 0]]``). Duplicates are an error.
        name: a label for stats and errors.

    Returns:
        :class:`TreeShape`.

    Raises:
        ValueError: an empty tree, a path with a missing prefix, a duplicate path, a negative or
            non-integer rank, more than :data:`MAX_TREE_NODES` nodes or a depth over
            :data:`MAX_TREE_DEPTH`.
    """
    if not isinstance(paths, list | tuple) or not paths:
        raise ValueError(f"tree {name}: paths must be a non-empty list of lists of ranks, got {paths!r}")
    clean: list[tuple[int, ...]] = []
    for path in paths:
        if not isinstance(path, list | tuple) or not path:
            raise ValueError(f"tree {name}: every path must be a non-empty list of ranks, got {path!r}")
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path):
            raise ValueError(f"tree {name}: ranks must be integers >= 0, got {list(path)!r}")
        clean.append(tuple(path))
    ordered = sorted(clean, key=lambda p: (len(p), p))
    if len(set(ordered)) != len(ordered):
        raise ValueError(f"tree {name}: duplicate paths")
    if len(ordered) > MAX_TREE_NODES or len(ordered[-1]) > MAX_TREE_DEPTH:
        raise ValueError(
            f"tree {name}: at most {MAX_TREE_NODES} nodes and depth {MAX_TREE_DEPTH}, got {len(ordered)} "
            f"nodes and depth {len(ordered[-1])}"
        )
    node_of = {(): 0}
    parents, ranks = [], []
    for i, path in enumerate(ordered, start=1):
        if path[:-1] not in node_of:
            raise ValueError(f"tree {name}: path {list(path)} has no parent path {list(path[:-1])}")
        node_of[path] = i
        parents.append(node_of[path[:-1]])
        ranks.append(path[-1])
    parent_t = torch.tensor(parents, dtype=torch.int64)
    depths, mask = tree_attention(parent_t)
    prefixes = {p[:-1] for p in ordered}
    leaves = [p for p in ordered if p not in prefixes]
    D = len(ordered[-1])
    retrieve = torch.full((len(leaves), D + 1), -1, dtype=torch.int64)  # (L, D + 1)
    for row, leaf in enumerate(leaves):
        retrieve[row, : len(leaf) + 1] = torch.tensor([node_of[leaf[:j]] for j in range(len(leaf) + 1)])
    return TreeShape(tuple(ordered), parent_t, torch.tensor(ranks, dtype=torch.int64), depths, mask, retrieve, name)


def greedy_paths(num_nodes: int, rank_acceptance: list[float], max_depth: int = 8) -> list[list[int]]:
    """The static tree of ``num_nodes`` nodes with the largest expected accepted length.

    Models the chance that a node is reached and accepted as the product, along its path, of
    ``rank_acceptance[rank]`` (the measured chance that the proposer's candidate of that rank is
    the target's token), and adds nodes greedily by that value (how Medusa and EAGLE derive their
    static trees, Cai et al. 2024, arXiv 2401.10774, §3.1).

    Args:
        num_nodes: N >= 1.
        rank_acceptance: per candidate rank, its acceptance probability in (0, 1].
        max_depth: the deepest path.

    Returns:
        N paths of ranks, every prefix included.
    """
    frontier: dict[tuple[int, ...], float] = {(r,): a for r, a in enumerate(rank_acceptance)}
    chosen: list[tuple[int, ...]] = []
    while len(chosen) < num_nodes and frontier:
        best = max(frontier, key=lambda p: (frontier[p], -len(p)))
        value = frontier.pop(best)
        chosen.append(best)
        if len(best) < max_depth:
            for r, a in enumerate(rank_acceptance):
                frontier[best + (r,)] = value * a
    return [list(p) for p in chosen]


# How often the default draft's (Qwen2.5-Coder-0.5B, bf16) candidate of rank 0, 1, 2, 3 is the default
# target's greedy token: the 8 calibration prompts (specdecode/data/calibration_prompts.jsonl), 64 tokens
# each, teacher-forced (`python lab/scripts/rank_acceptance.py`): 0.826, 0.094, 0.033, 0.014 (3.3% beyond).
_RANKS = [0.826, 0.094, 0.033, 0.014]
TREE_SHAPES: dict[str, list[list[int]]] = {
    "chain4": [[0] * d for d in range(1, 5)],
    "tree8": greedy_paths(8, _RANKS, max_depth=4),
    "tree12": greedy_paths(12, _RANKS, max_depth=5),
    "tree16": greedy_paths(16, _RANKS, max_depth=6),
    "tree24": greedy_paths(24, _RANKS, max_depth=6),
    "tree32": greedy_paths(32, _RANKS, max_depth=7),
}
TREE_SHAPES["default"] = TREE_SHAPES["tree8"]  # peaked in lab/notebook/2026-11-21-token-trees.md (issue 5 run)


@dataclass(frozen=True)
class DynamicTree:
    """A tree built per step from the proposer's cumulative log-probabilities (EAGLE-2).

    Attributes:
        budget: N, the most drafted nodes kept (the target scores N + 1 tokens).
        depth: D, the most expansion steps (the deepest node).
        top_k: K, nodes expanded per depth and children taken per expanded node.
    """

    budget: int = 16
    depth: int = 6
    top_k: int = 4

    def __post_init__(self) -> None:
        for field_name, value, top in (
            ("budget", self.budget, MAX_TREE_NODES),
            ("depth", self.depth, MAX_TREE_DEPTH),
            ("top_k", self.top_k, 64),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top:
                raise ValueError(f"dynamic tree {field_name} must be an integer in [1, {top}], got {value!r}")

    @property
    def name(self) -> str:
        return f"dynamic:{self.budget}:{self.depth}:{self.top_k}"

    @property
    def num_nodes(self) -> int:
        return self.budget


TreeSpec = TreeShape | DynamicTree


def parse_tree(spec: str | list[list[int]] | TreeShape | DynamicTree) -> TreeSpec:
    """A tree from what ``--tree`` / ``tree=`` takes.

    Args:
        spec: a name in :data:`TREE_SHAPES`; a path to a JSON file holding a list of paths;
            ``"dynamic:N"`` or ``"dynamic:N:D:K"`` (budget N nodes, depth D, branching K;
            defaults of :class:`DynamicTree`); a list of paths; or a compiled tree.

    Raises:
        ValueError: anything else, naming ``tree`` and what is allowed.
    """
    if isinstance(spec, TreeShape | DynamicTree):
        return spec
    if isinstance(spec, list):
        return compile_paths(spec)
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"tree must be a shape name, a JSON file of paths or 'dynamic:N', got {spec!r}")
    if spec in TREE_SHAPES:
        return compile_paths(TREE_SHAPES[spec], name=spec)
    if spec.startswith("dynamic"):
        parts = spec.split(":")[1:]
        if not 1 <= len(parts) <= 3 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"tree: 'dynamic:N' or 'dynamic:N:D:K' with integers, got {spec!r}")
        values = [int(p) for p in parts]
        names = ("budget", "depth", "top_k")
        return DynamicTree(**dict(zip(names, values, strict=False)))
    path = Path(spec)
    if path.is_file():
        try:
            paths = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"tree: {spec} is not a JSON list of paths: {error}") from error
        return compile_paths(paths, name=path.name)
    raise ValueError(
        f"tree must be one of {sorted(TREE_SHAPES)}, a JSON file of paths, or 'dynamic:N[:D:K]', got {spec!r}"
    )


@dataclass(frozen=True)
class DraftTree:
    """Tokens a proposer drafts as a tree for one step.

    Attributes:
        ids: int64 ``[N]``, the token of nodes ``1 .. N``.
        parents: int64 ``[N]``, the parent node of nodes ``1 .. N`` (in ``[0, i)``; 0 is the root,
            the last context token). Siblings in the order the verifier tries them.

    Under sampling a tree is always a *deterministic* proposal (its candidates are the proposer's
    top-ranked tokens, chosen without the verifier's randomness); see
    :func:`specdecode.verify.rejection_sample_tree`.
    """

    ids: torch.Tensor
    parents: torch.Tensor

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @staticmethod
    def empty() -> DraftTree:
        return DraftTree(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))

    @staticmethod
    def chain(ids: torch.Tensor) -> DraftTree:
        """A chain ``ids[0] -> ids[1] -> ...`` as a tree."""
        return DraftTree(ids, torch.arange(ids.shape[0], dtype=torch.int64))

    @property
    def depth(self) -> int:
        return int(tree_attention(self.parents)[0].max()) if len(self) else 0

    def prune(self, max_depth: int) -> DraftTree:
        """The nodes at depth <= ``max_depth`` (parents renumbered); ``self`` when none is deeper."""
        depths = tree_attention(self.parents)[0]  # (N + 1,)
        keep = (depths[1:] <= max_depth).nonzero().flatten()  # (M,) node i + 1 kept
        if keep.shape[0] == len(self):
            return self
        new_index = torch.zeros(len(self) + 1, dtype=torch.int64)
        new_index[keep + 1] = torch.arange(1, keep.shape[0] + 1)
        return DraftTree(self.ids[keep], new_index[self.parents[keep]])


# --------------------------------------------------------------------------- building draft trees
# ``expand(nodes, ids, parents)``: the proposer's log-probabilities (float ``[len(nodes), C]``) of the
# token after each of ``nodes`` (nodes >= 1 of the partial tree ``ids`` / ``parents``, lists of node
# 1 .. n's token and parent). Column j is token ``columns[j]`` (or token j when ``columns`` is None).
Expand = Callable[[list[int], list[int], list[int]], torch.Tensor]


def _top(scores: torch.Tensor, width: int, columns: torch.Tensor | None) -> list[tuple[list[int], list[float]]]:
    """Per row of ``scores`` ``[m, C]`` (any device; ``columns`` on the same), its ``width`` best
    ``(tokens, scores)``, best first, in one host copy for all rows (float64 holds float32 scores
    and the ids exactly)."""
    values, index = scores.topk(min(width, scores.shape[-1]), dim=-1)  # (m, w), best first
    tokens = index if columns is None else columns[index]
    host = torch.stack([tokens.double(), values.double()]).tolist()  # (2, m, w)
    return [([int(t) for t in ts], vs) for ts, vs in zip(host[0], host[1], strict=True)]


def build_static_tree(
    shape: TreeShape, root_scores: torch.Tensor, expand: Expand, columns: torch.Tensor | None = None
) -> DraftTree:
    """Fill a static shape with a proposer's ranked candidates, one ``expand`` call per depth > 1.

    Node ``[..., r]`` gets the proposer's r-th most likely token after its parent.

    Args:
        shape: the compiled shape.
        root_scores: float ``[C]``, log-probabilities of the token after the root.
        expand: see :data:`Expand`; called with the nodes of one depth that have children.
        columns: int64 ``[C]`` token id of each score column, or None (column j is token j).

    Returns:
        :class:`DraftTree` with the shape's parents.
    """
    widths = shape.widths()
    parents = shape.parents.tolist()
    ranks = shape.ranks.tolist()
    depths = shape.depths.tolist()
    ids: list[int] = []
    candidates: dict[int, list[int]] = {0: _top(root_scores.view(1, -1), widths[0], columns)[0][0]}
    for node in range(1, shape.num_nodes + 1):
        if depths[node] > 1 and parents[node - 1] not in candidates:  # first node of a new depth
            level = [n for n in range(1, node) if depths[n] == depths[node] - 1 and widths[n] > 0]
            scores = expand(level, ids, parents[: node - 1])  # (len(level), C)
            ranked = _top(scores, max(widths[n] for n in level), columns)  # one copy for the depth
            for (tokens, _), n in zip(ranked, level, strict=True):
                candidates[n] = tokens[: widths[n]]
        options = candidates[parents[node - 1]]
        ids.append(options[min(ranks[node - 1], len(options) - 1)])  # a vocabulary smaller than the width repeats
    return DraftTree(torch.tensor(ids, dtype=torch.int64), shape.parents.clone())


def build_dynamic_tree(
    spec: DynamicTree, root_scores: torch.Tensor, expand: Expand, columns: torch.Tensor | None = None
) -> DraftTree:
    """EAGLE-2's dynamic draft tree (Li et al. 2024, arXiv 2406.16858, §4): expand, then rerank.

    Expansion: at each depth the ``top_k`` nodes of highest cumulative log-probability (the sum of
    the proposer's log-probabilities along the root path) get their ``top_k`` best children; one
    ``expand`` call per depth after the first. Reranking: of all nodes created, the ``budget`` with
    the highest cumulative log-probability are kept (a child never scores above its parent, so the
    kept set is a tree; ties go to the shallower node), in breadth-first order, siblings best first.

    Args:
        spec: budget, depth and branching.
        root_scores: float ``[C]``, log-probabilities of the token after the root.
        expand: see :data:`Expand`; called with the ``top_k`` frontier nodes of each depth.
        columns: int64 ``[C]`` token id of each score column, or None.

    Returns:
        :class:`DraftTree` with at most ``budget`` nodes.
    """
    ids: list[int] = []
    parents: list[int] = []
    score = [0.0]  # per node, cumulative log-probability (root 0)
    depth = [0]
    frontier = [0]
    for d in range(1, spec.depth + 1):
        if d == 1:
            rows = root_scores.view(1, -1)  # (1, C)
        else:
            rows = expand(frontier, ids, parents)  # (len(frontier), C)
        level: list[int] = []
        for (tokens, values), parent in zip(_top(rows, spec.top_k, columns), frontier, strict=True):
            for token, value in zip(tokens, values, strict=True):
                if value == float("-inf"):
                    break
                ids.append(token)
                parents.append(parent)
                score.append(score[parent] + value)
                depth.append(d)
                level.append(len(ids))
        if not level:
            break
        frontier = sorted(level, key=lambda n: -score[n])[: spec.top_k]
    order = sorted(range(1, len(ids) + 1), key=lambda n: (-score[n], depth[n], n))[: spec.budget]
    kept = sorted(order, key=lambda n: (depth[n], n))  # breadth-first; creation order keeps siblings best first
    new_index = {0: 0} | {n: i for i, n in enumerate(kept, start=1)}
    kept = [n for n in kept if parents[n - 1] in new_index]  # (only float ties could orphan a node)
    new_index = {0: 0} | {n: i for i, n in enumerate(kept, start=1)}
    return DraftTree(
        torch.tensor([ids[n - 1] for n in kept], dtype=torch.int64),
        torch.tensor([new_index[parents[n - 1]] for n in kept], dtype=torch.int64),
    )


def trie_tree(sequences: list[list[int]], budget: int, max_depth: int) -> DraftTree:
    """Merge candidate continuations into one tree (a trie), highest priority first.

    Args:
        sequences: token lists, the most likely first; each is a path from the root.
        budget: the most nodes.
        max_depth: the deepest node.

    Returns:
        :class:`DraftTree`; siblings in the order their first sequence came.
    """
    ids: list[int] = []
    parents: list[int] = []
    child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for sequence in sequences:
        node = 0
        for token in sequence[:max_depth]:
            nxt = child.get((node, token))
            if nxt is None:
                if len(ids) >= budget:
                    break
                ids.append(token)
                parents.append(node)
                nxt = child[(node, token)] = len(ids)
            node = nxt
    # creation order is topological but not breadth-first; the verifier only needs parents first
    return DraftTree(torch.tensor(ids, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64))
