"""One sequence's grammar state under speculation: masks per position, drafts shaped by the
grammar, and the advance through the tokens the verifier kept.

The state is an ``llguidance.LLMatcher`` that always stands after the sequence's emitted tokens.
For one target pass it is walked forward through the draft (masks of each position: the grammar
state after the drafts before it) and rolled back (``LLMatcher.rollback``), so a rejected draft
leaves no trace; the tokens the verifier keeps are then consumed for good (:meth:`advance`). This is
the scheme of vLLM's and SGLang's structured output under speculation (a bitmask per draft
position, computed by advancing the matcher through the draft and rolling it back).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from specdecode.constraints.masked_verify import DraftCut, verify_constrained, verify_tree_constrained
from specdecode.constraints.spec import ConstraintError, _llguidance
from specdecode.proposers.base import DraftTokens
from specdecode.sampling import SamplingParams
from specdecode.tree import DraftTree
from specdecode.verify import VerifyResult


class ConstraintState:
    """The grammar state of one sequence.

    Args:
        grammar: an llguidance grammar (:func:`~specdecode.constraints.spec.compile_constraint`).
        ll_tokenizer: the ``llguidance.LLTokenizer`` of the target
            (:func:`~specdecode.constraints.tokenizer.ll_tokenizer`), its ``vocab_size`` equal to V.
        param: the parameter the constraint came from (named in errors).
        grammar_aware_drafting: cut a draft at its first forbidden token and propose the grammar's
            forced tokens as drafts (jump-forward). False sends every draft to the verifier as the
            proposer made it (only the masks apply): the same output, for measuring what the
            drafting saves.
        vocab_size: V, the width of the target's logits (default: the tokenizer's size); masks
            are cut to it.

    Attributes:
        vocab_size: V, the width of the target's logits (default: the tokenizer's size); masks
            are cut to it.
        forced_draft_tokens / forced_accepted_tokens: forced tokens proposed / kept by the verifier.
        cut_draft_tokens: draft tokens never sent to the target because the grammar forbids them
            (the forbidden token and those after it).

    Raises:
        ConstraintError: llguidance cannot build a matcher for the grammar.
    """

    def __init__(
        self,
        grammar: str,
        ll_tokenizer: Any,
        param: str = "constraint",
        grammar_aware_drafting: bool = True,
        vocab_size: int | None = None,
    ):
        ll = _llguidance()
        self.param = param
        self.vocab_size = int(vocab_size if vocab_size is not None else ll_tokenizer.vocab_size)
        if self.vocab_size > ll_tokenizer.vocab_size:
            raise ValueError(
                f"vocab_size {self.vocab_size} exceeds the llguidance tokenizer's {ll_tokenizer.vocab_size}"
            )
        self.grammar_aware_drafting = grammar_aware_drafting
        self.matcher = ll.LLMatcher(ll_tokenizer, grammar, log_level=0)
        self._check("grammar")
        self.forced_draft_tokens = 0
        self.forced_accepted_tokens = 0
        self.cut_draft_tokens = 0
        self._pending: tuple[int, int, DraftCut | None] | None = None  # (valid drafts, forced drafts, cut)
        self._forced_nodes: frozenset[int] = frozenset()  # tree nodes of forced tokens, last shape_tree

    def _check(self, what: str) -> None:
        if self.matcher.is_error():
            raise ConstraintError(f"{what}: {self.matcher.get_error()}", self.param)

    # ------------------------------------------------------------------ masks
    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next: bool ``[V]`` (EOS ids once the grammar is complete)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        self._check("mask")  # e.g. llguidance's ParserTooComplex: never decode on a stale mask
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(np.bool_))

    def allowed_along(self, ids: Sequence[int]) -> torch.Tensor:
        """Masks of one pass: row i is what the grammar allows after ``ids[:i]``, bool ``[len(ids) + 1, V]``.

        The matcher is walked through ``ids`` and rolled back: it ends where it started. Rows after
        a forbidden ``ids[i]`` cannot be reached (the verifier rejects ``ids[i]`` for certain, its
        masked probability being 0) and allow every token.
        """
        rows = torch.ones(len(ids) + 1, self.vocab_size, dtype=torch.bool)  # (k + 1, V)
        consumed = 0
        rows[0] = self.allowed()
        for i, token in enumerate(ids):
            # a failed consume would leave the matcher in its error state for good: validate first
            if not rows[i, token] or self.matcher.validate_tokens([int(token)]) != 1:
                break
            self.matcher.consume_token(int(token))
            consumed += 1
            rows[i + 1] = self.allowed()
        self.matcher.rollback(consumed)
        self._check("masks")
        return rows

    def advance(self, ids: Sequence[int]) -> None:
        """Consume the tokens the verifier kept (they are allowed by construction).

        Raises:
            ConstraintError: a token the grammar forbids (a bug above: the masks exclude them).
        """
        for token in ids:
            if self.matcher.is_stopped():  # complete: only EOS remains, which ends the sequence
                return
            if not self.matcher.consume_token(int(token)):
                raise ConstraintError(f"token {int(token)} breaks the grammar: {self.matcher.get_error()}", self.param)

    def is_complete(self) -> bool:
        """Whether the output so far is a full sentence of the grammar (EOS allowed)."""
        return bool(self.matcher.is_accepting())

    # ------------------------------------------------------------------ drafting
    def shape_draft(self, draft: DraftTokens, budget: int) -> DraftTokens:
        """Grammar-aware drafting: the longest allowed prefix of ``draft``, then forced tokens.

        The draft is cut at its first token the grammar forbids (that token never reaches the
        target). Where the draft ends and the grammar forces the next tokens
        (``LLMatcher.compute_ff_tokens``: bytes only one continuation allows, e.g. a schema's keys),
        those are appended as deterministic drafts (one-hot q), up to ``budget`` tokens in all; the
        verifier still checks them, so the output is unchanged.

        A probabilistic draft (``draft.probs``) cut at a sampled forbidden token gets no forced
        tokens: the next token must then come from the residual ``norm(max(0, p - q))`` of the cut
        position, as if the verifier had rejected the forbidden token (it would, for certain); the
        cut is kept for :meth:`verify`.

        Args:
            draft: the proposer's draft, ids int64 ``[k]``, probs float ``[k, V]`` or None.
            budget: the most tokens to send (the step's k, within the length limit).
        """
        self._pending = None
        if not self.grammar_aware_drafting:
            return draft
        ids = draft.ids.tolist()
        valid = self.matcher.validate_tokens(ids) if ids else 0
        cut = None
        if valid < len(ids):
            self.cut_draft_tokens += len(ids) - valid
            if draft.probs is not None:
                cut = DraftCut(ids[valid], draft.probs[valid])
        forced: list[int] = []
        if cut is None and valid < budget:
            self.matcher.consume_tokens(ids[:valid])
            forced = self.matcher.compute_ff_tokens()[: budget - valid]
            self.matcher.rollback(valid)
        self._pending = (valid, len(forced), cut)
        if valid == len(ids) and not forced:
            return draft
        new_ids = torch.tensor(ids[:valid] + forced, dtype=torch.int64)  # (valid + forced,)
        probs = None
        if draft.probs is not None:  # on the probs' device (the logits')
            device = draft.probs.device
            one_hot = torch.zeros(len(forced), draft.probs.shape[1], dtype=draft.probs.dtype, device=device)
            forced_ids = torch.tensor(forced, dtype=torch.int64, device=device)  # (forced,)
            one_hot[torch.arange(len(forced), device=device), forced_ids] = 1.0
            probs = torch.cat([draft.probs[:valid], one_hot])  # (valid + forced, V)
        self.forced_draft_tokens += len(forced)
        return DraftTokens(new_ids, probs)

    def verify(
        self,
        draft: DraftTokens,
        target_logits: torch.Tensor,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> VerifyResult:
        """Verify one pass under the grammar (:func:`~specdecode.constraints.masked_verify.verify_constrained`):
        the masks of every position (grammar state after the drafts before it), the pending cut of
        the last :meth:`shape_draft`, and the count of forced tokens kept.

        Args:
            draft: what was sent (after :meth:`shape_draft`): ids int64 ``[k]`` (CPU), probs
                ``[k, V]`` (on the logits' device) | None.
            target_logits: float ``[k + 1, V]`` (any device: the masks are moved there).
        """
        pending, self._pending = self._pending, None
        ids = draft.ids[: target_logits.shape[0] - 1].cpu()  # (k,)
        allowed = self.allowed_along(ids.tolist()).to(target_logits.device)  # (k + 1, V): the masks' one move
        cut = pending[2] if pending is not None else None
        result = verify_constrained(ids, draft.probs, target_logits, allowed, sampling, generator, cut)
        if pending is not None:
            valid, forced = pending[0], pending[1]
            self.forced_accepted_tokens += max(0, min(result.num_accepted, valid + forced) - valid)
        return result

    # ------------------------------------------------------------------ token trees
    def _path(self, parents: list[int], ids: list[int], node: int) -> list[int]:
        path: list[int] = []
        while node > 0:
            path.append(ids[node - 1])
            node = parents[node - 1]
        return path[::-1]

    def shape_tree(self, tree: DraftTree) -> DraftTree:
        """Grammar-aware drafting for a token tree: the nodes whose root path the grammar allows (a
        forbidden node goes with its subtree; parents renumbered), then forced tokens as chains.

        Where a kept leaf (or the root, when every node was cut) stands above the tree's original
        depth and the grammar forces the next tokens (``LLMatcher.compute_ff_tokens``), they are
        appended as a chain under it, down to that depth (new nodes after the old ones, so parents
        stay in ``[0, i)``). A tree's candidates are deterministic proposals, so extra deterministic
        nodes leave the output unchanged; the verifier still checks them. Under grammar-aware
        drafting only; else ``tree`` itself.

        Args:
            tree: the proposer's tree, ids and parents int64 ``[N]``.

        Returns:
            The shaped tree, ids and parents int64 ``[M]``.
        """
        self._forced_nodes = frozenset()
        if not self.grammar_aware_drafting or not len(tree):
            return tree
        ids, parents = tree.ids.tolist(), tree.parents.tolist()
        keep = [i for i in range(1, len(ids) + 1) if self._allows(self._path(parents, ids, i))]
        self.cut_draft_tokens += len(ids) - len(keep)
        new_index = {0: 0, **{node: j + 1 for j, node in enumerate(keep)}}
        kept_ids = [ids[i - 1] for i in keep]
        kept_parents = [new_index[parents[i - 1]] for i in keep]
        forced = self._forced_chains(kept_ids, kept_parents, tree.depth)
        if len(keep) == len(ids) and not forced:
            return tree
        return DraftTree(torch.tensor(kept_ids, dtype=torch.int64), torch.tensor(kept_parents, dtype=torch.int64))

    def _forced_chains(self, ids: list[int], parents: list[int], depth: int) -> int:
        """Append (in place) forced-token chains under the leaves above ``depth``; returns how many
        nodes were added (their indices kept for :meth:`verify_tree`'s count)."""
        first = len(ids) + 1
        depths = [0] * (len(ids) + 1)
        for node in range(1, len(ids) + 1):
            depths[node] = depths[parents[node - 1]] + 1
        has_child = set(parents)
        leaves = [node for node in range(len(ids) + 1) if node not in has_child]  # the root only when empty
        for leaf in leaves:
            budget = depth - depths[leaf]
            if budget <= 0:
                continue
            path = self._path(parents, ids, leaf)
            self.matcher.consume_tokens(path)
            chain = self.matcher.compute_ff_tokens()[:budget]
            self.matcher.rollback(len(path))
            self._check("forced tokens")
            parent = leaf
            for token in chain:
                ids.append(int(token))
                parents.append(parent)
                parent = len(ids)
        added = len(ids) + 1 - first
        self.forced_draft_tokens += added
        self._forced_nodes = frozenset(range(first, len(ids) + 1))
        return added

    def _allows(self, path: list[int]) -> bool:
        return self.matcher.validate_tokens(path) == len(path)

    def allowed_tree(self, tree: DraftTree) -> torch.Tensor:
        """Masks of a tree pass: row i what the grammar allows after node i's root path (row 0 the
        root), bool ``[N + 1, V]``; rows of forbidden nodes allow every token (never reached)."""
        ids, parents = tree.ids.tolist(), tree.parents.tolist()
        rows = torch.ones(len(ids) + 1, self.vocab_size, dtype=torch.bool)  # (N + 1, V)
        rows[0] = self.allowed()
        for node in range(1, len(ids) + 1):
            path = self._path(parents, ids, node)
            if self._allows(path):
                self.matcher.consume_tokens(path)
                rows[node] = self.allowed()
                self.matcher.rollback(len(path))
        return rows

    def verify_tree(
        self,
        tree: DraftTree,
        target_logits: torch.Tensor,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> VerifyResult:
        """Verify a tree pass under the grammar
        (:func:`~specdecode.constraints.masked_verify.verify_tree_constrained`); ``target_logits``
        float ``[N + 1, V]``. ``tree`` is what :meth:`shape_tree` returned (its forced nodes are
        counted in ``forced_accepted_tokens`` when kept)."""
        allowed = self.allowed_tree(tree).to(target_logits.device)  # (N + 1, V)
        result = verify_tree_constrained(tree.ids, tree.parents, target_logits, allowed, sampling, generator)
        forced, self._forced_nodes = self._forced_nodes, frozenset()
        if forced and result.path is not None:
            self.forced_accepted_tokens += sum(int(node) in forced for node in result.path.tolist())
        return result
