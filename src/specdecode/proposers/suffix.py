"""Suffix decoding: draft what most often followed the longest matching suffix of the context.

SuffixDecoding (Oliaro, Jia, Campos, Qiao 2024, arXiv 2411.04975; reference implementation:
Snowflake's ArcticInference, also behind vLLM's ``suffix`` method). Model-free like prompt lookup,
but it also remembers what this proposer's earlier requests generated, which pays off where
outputs repeat across requests (agent loops, the same tool call, boilerplate, rewrites).

Two indexes are searched at every step:

- the *request* index: the current request's prompt and every token generated so far, extended
  in place as tokens arrive (``observe``; ``propose`` catches up with, or rolls back to, the
  context it is given) and never rebuilt;
- the *cache*: the outputs of earlier requests of this proposer instance, each added at the next
  ``reset()``; at most ``max_cached_tokens`` tokens, the oldest requests evicted first.

**Structure: an implicit suffix trie.** A suffix trie of depth D built from dicts costs O(T·D)
node insertions and Python objects: for a random 8,192-token prompt and D = 24, ~200,000 nodes,
57 MB and 0.8 s on the 2-core development machine, per request. A suffix tree (Ukkonen) is O(T) but cannot keep per-node
counts up to date without O(depth) work per token, and is long code. So the index stores the token
sequences in one int64 array and, per token value, the sorted positions where it occurs. A trie
node (a string s) *is* the set of positions where an occurrence of s ends; its count is the size
of that set, and its child x is the subset followed by x. The counts are exactly those of an
explicit, unbounded-depth suffix trie, while adding a token is one append (O(1)), memory is O(T),
a rollback or an eviction costs O(its tokens), and a lookup is a few vectorised filters over the
occurrences of the context's last token: O(occurrences · (match length + draft length)).

**Counts.** Only occurrences followed by a token count (the context's own last tokens, at the end
of the request index, have no continuation yet). So ``count(child) / count(node)`` is the empirical
probability that the node's string is followed by the child's token.

**Proposal** (per index; the index with the higher score wins, the request index on a tie — the
"pick the better of the two" reading of the paper, as ArcticInference does):

1. match: the longest suffix of the context's last ``max_depth`` tokens that occurs, followed by a
   token, in the index; its length is the match length m;
2. walk: from that node, repeatedly take the child with the highest count (ties: the most recent
   occurrence), at most ``min(k, ceil(max_spec_factor · m))`` tokens (the paper's adaptive
   speculation length: short matches are weak evidence);
3. stop when the draft's estimated probability, the product of ``count(child) / count(node)``
   along the walk (for the first token exactly ``count(child) / count(node)``), falls below
   ``min_token_prob``, as ArcticInference does; the score is the sum of these products, the
   expected number of accepted tokens under the counts.

The proposal is deterministic (``probs=None``): the verifier treats it as a one-hot q, so greedy
output and the sampled distribution stay exactly the target's.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from specdecode.proposers.base import DraftTokens, ProposerBase
from specdecode.sampling import SamplingParams
from specdecode.verify import VerifyResult

SEP = -1  # precedes every sequence of an index and follows the last token; never a token id
Positions = npt.NDArray[np.int64]
_NONE: Positions = np.empty(0, dtype=np.int64)


def _check(name: str, value: object, low: float, high: float, integer: bool, open_low: bool = False) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is an integer (or a number) in the range."""
    number = isinstance(value, int) if integer else isinstance(value, int | float)
    if (
        not number
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not low <= value <= high
        or (open_low and value == low)
    ):
        what = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {what} in {'(' if open_low else '['}{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class SuffixConfig:
    """Options of :class:`SuffixProposer` (defaults from the paper and ArcticInference / vLLM).

    Attributes:
        max_depth: the longest suffix of the context looked up, in tokens, in [1, 1024]. It bounds
            the match length only; drafts are bounded by k, ``max_spec_factor`` and ``min_token_prob``.
        max_spec_factor: draft at most ``ceil(max_spec_factor * match length)`` tokens, in (0, 64].
        min_token_prob: stop drafting when the product of the continuation probabilities along
            the draft falls below this, in [0, 1]; 0 drafts as far as the other bounds allow.
        max_cached_tokens: tokens of earlier requests' outputs kept for later requests, >= 0;
            the oldest requests are evicted first; 0 turns the cache off. 16 to 32 bytes a token.

    Raises:
        ValueError: a value outside the above (the message names the field and the range).
    """

    max_depth: int = field(default=24, metadata={"help": "longest context suffix matched, tokens (default 24)"})
    max_spec_factor: float = field(
        default=1.0,
        metadata={"help": "draft at most ceil(factor * match length) tokens (default: suffix 1.0, prompt_lookup 2.0)"},
    )
    min_token_prob: float = field(
        default=0.1, metadata={"help": "stop when the draft's estimated probability < this (default 0.1)"}
    )
    max_cached_tokens: int = field(
        default=262_144, metadata={"help": "earlier outputs kept for later requests, tokens; 0 = off (default 262144)"}
    )

    def __post_init__(self) -> None:
        _check("max_depth", self.max_depth, 1, 1024, integer=True)
        _check("max_spec_factor", self.max_spec_factor, 0, 64, integer=False, open_low=True)
        _check("min_token_prob", self.min_token_prob, 0, 1, integer=False)
        _check("max_cached_tokens", self.max_cached_tokens, 0, 2**40, integer=True)


@dataclass(frozen=True)
class Speculation:
    """One index's proposal.

    Attributes:
        ids: the drafted token ids (may be empty).
        score: sum over the draft of its estimated probability up to each token (expected accepted
            tokens under the counts).
        match_length: tokens of the context's suffix that matched (0: none).
    """

    ids: tuple[int, ...] = ()
    score: float = 0.0
    match_length: int = 0


class SuffixIndex:
    """An implicit suffix trie over token sequences (see the module docstring).

    Sequences lie one after another in one int64 array, each preceded by :data:`SEP`, with a
    :data:`SEP` after the last token; positions are absolute and never change (evicting the oldest
    sequences moves an origin, not the positions). ``self._where[token]`` is an increasing
    ``array('q')`` of the positions of ``token``.
    """

    def __init__(self) -> None:
        self._tokens = np.full(64, SEP, dtype=np.int64)  # _tokens[pos - _origin] is the token at pos
        self._origin = 0
        self._end = 0  # one past the last position in use
        self._starts: deque[int] = deque()  # position of each sequence's leading SEP, oldest first
        self._where: dict[int, array] = {}
        self.num_tokens = 0  # tokens held, separators excluded

    @property
    def num_sequences(self) -> int:
        return len(self._starts)

    def sequences(self) -> list[list[int]]:
        """The sequences held, oldest first."""
        bounds = [*self._starts, self._end]
        o = self._origin
        return [self._tokens[a + 1 - o : b - o].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def last_sequence(self) -> Positions:
        """int64 ``[n]``: the last sequence's tokens (a view, valid until the next change).

        Raises:
            ValueError: the index holds no sequence.
        """
        if not self._starts:
            raise ValueError("the index holds no sequence")
        return self._tokens[self._starts[-1] + 1 - self._origin : self._end - self._origin]

    # ------------------------------------------------------------------ updates
    def _reserve(self, n: int) -> None:
        """Room for ``n`` more tokens and the final SEP; drops evicted slots when it reallocates."""
        if self._end - self._origin + n + 1 <= self._tokens.shape[0]:
            return
        first = self._starts[0] if self._starts else self._end
        used = self._end - first
        grown = np.full(max(64, 2 * (used + n + 1)), SEP, dtype=np.int64)
        grown[:used] = self._tokens[first - self._origin : self._end - self._origin]
        self._tokens, self._origin = grown, first

    def add_sequence(self, tokens: Sequence[int] | npt.NDArray[np.integer]) -> None:
        """Start a new sequence holding ``tokens`` (int ``[n]``, ids >= 0; may be empty)."""
        self._reserve(1)
        self._starts.append(self._end)
        self._tokens[self._end - self._origin] = SEP
        self._end += 1
        self._tokens[self._end - self._origin] = SEP
        self.extend(tokens)

    def extend(self, tokens: Sequence[int] | npt.NDArray[np.integer]) -> None:
        """Append ``tokens`` (int ``[n]``, ids >= 0) to the last sequence: O(n).

        Raises:
            ValueError: no sequence was started, or a negative id.
        """
        values = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if not self._starts:
            raise ValueError("the index holds no sequence; call add_sequence first")
        if values.shape[0] == 0:
            return
        if int(values.min()) < 0:
            raise ValueError(f"token ids must be >= 0, got {int(values.min())}")
        n = values.shape[0]
        self._reserve(n)
        at = self._end - self._origin
        self._tokens[at : at + n] = values
        self._tokens[at + n] = SEP
        where = self._where
        for pos, token in enumerate(values.tolist(), self._end):
            found = where.get(token)
            if found is None:
                where[token] = array("q", (pos,))
            else:
                found.append(pos)
        self._end += n
        self.num_tokens += n

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens of the last sequence (a rollback): O(tokens removed).

        Raises:
            ValueError: no sequence, or ``length`` outside [0, its length].
        """
        held = self.last_sequence().shape[0]
        if not 0 <= length <= held:
            raise ValueError(f"length must be in [0, {held}], got {length}")
        stop = self._end - held + length
        for token in reversed(self._tokens[stop - self._origin : self._end - self._origin].tolist()):
            found = self._where[token]
            found.pop()
            if not found:
                del self._where[token]
        self._tokens[stop - self._origin] = SEP
        self.num_tokens -= self._end - stop
        self._end = stop

    def evict_oldest(self) -> int:
        """Remove the oldest sequence and its counts; return its length. O(its tokens).

        Raises:
            ValueError: the index holds no sequence.
        """
        if not self._starts:
            raise ValueError("the index holds no sequence")
        start = self._starts.popleft()
        stop = self._starts[0] if self._starts else self._end
        for token in set(self._tokens[start + 1 - self._origin : stop - self._origin].tolist()):
            found = self._where[token]
            del found[: bisect_left(found, stop)]  # the oldest positions come first
            if not found:
                del self._where[token]
        self.num_tokens -= stop - start - 1
        return stop - start - 1

    # ------------------------------------------------------------------ queries
    def _at(self, positions: Positions) -> Positions:
        return self._tokens[positions - self._origin]

    def match(self, pattern: npt.NDArray[np.int64]) -> tuple[Positions, int]:
        """The longest suffix of ``pattern`` that occurs followed by a token.

        Args:
            pattern: int64 ``[m]``, m >= 1, token ids (the context's last tokens).

        Returns:
            ``(node, length)``: int64 ``[c]`` increasing positions where the suffix's occurrences
            end (c is the trie node's count), and the suffix's length; ``(empty, 0)`` if even the
            last token never occurs followed by one.
        """
        found = self._where.get(int(pattern[-1]))
        if found is None:
            return _NONE, 0
        every = np.frombuffer(found, dtype=np.int64)
        node = every[self._at(every + 1) != SEP]  # a copy: ``found`` may grow later
        del every
        if node.shape[0] == 0:
            return _NONE, 0
        length = 1
        while length < pattern.shape[0]:
            longer = node[self._at(node - length) == pattern[-1 - length]]
            if longer.shape[0] == 0:
                break
            node, length = longer, length + 1
        return node, length

    def _best_child(self, node: Positions) -> tuple[int, int]:
        """The most frequent next token after ``node`` (ties: the most recent) and its count."""
        following = self._at(node + 1)
        if following.shape[0] > 256:
            values, last, counts = np.unique(following[::-1], return_index=True, return_counts=True)
            best = int(np.lexsort((last, -counts))[0])  # highest count, then most recent
            return int(values[best]), int(counts[best])
        tokens = following.tolist()
        counts = Counter(tokens)
        top = max(counts.values())
        token = next(t for t in reversed(tokens) if counts[t] == top)
        return token, top

    def walk(self, node: Positions, max_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
        """Follow the most frequent continuation of ``node`` (from :meth:`match`).

        Returns:
            ``(ids, score)``: at most ``max_tokens`` token ids, and the sum of the draft's
            estimated probability up to each of them.
        """
        ids: list[int] = []
        prob, score = 1.0, 0.0
        while len(ids) < max_tokens and node.shape[0]:
            if node.shape[0] == 1:  # one occurrence: copy what followed it, probability unchanged
                at = int(node[0]) + 1 - self._origin
                run = self._tokens[at : at + max_tokens - len(ids)]
                stops = np.flatnonzero(run == SEP)
                run = run[: int(stops[0])] if stops.shape[0] else run
                ids += run.tolist()
                score += prob * run.shape[0]
                break
            token, count = self._best_child(node)
            prob *= count / node.shape[0]
            if prob < min_token_prob:
                break
            ids.append(token)
            score += prob
            node = node[self._at(node + 1) == token] + 1
            node = node[self._at(node + 1) != SEP]  # keep the occurrences that continue
        return ids, score

    def continuations(self, pattern: Sequence[int]) -> dict[int, int]:
        """The children of the trie node ``pattern`` (one token or more): ``{next token: count}``,
        empty if ``pattern`` never occurs followed by a token."""
        node, length = self.match(np.asarray(pattern, dtype=np.int64))
        if length < len(pattern):
            return {}
        return dict(Counter(self._at(node + 1).tolist()))

    def speculate(
        self, pattern: npt.NDArray[np.int64], max_tokens: int, max_spec_factor: float, min_token_prob: float
    ) -> Speculation:
        """Match ``pattern`` (int64 ``[m]``), then walk at most ``min(max_tokens, ceil(max_spec_factor
        * match length))`` tokens (see the module docstring)."""
        if pattern.shape[0] == 0 or max_tokens < 1:
            return Speculation()
        node, length = self.match(pattern)
        if length == 0:
            return Speculation()
        limit = min(max_tokens, math.ceil(max_spec_factor * length - 1e-9))
        ids, score = self.walk(node, limit, min_token_prob)
        return Speculation(tuple(ids), score, length)


class SuffixProposer(ProposerBase):
    """Suffix decoding over the request and this proposer's earlier outputs (deterministic
    proposal, ``probs=None``: one-hot q for the verifier, which keeps sampling exact).

    ``reset()`` moves the finished request's output into :attr:`cache` and forgets the request.
    The output is the request's tokens from the last token of the first context ``propose`` saw
    onwards: with the engine (first ``propose`` right after the prefill's token), exactly the
    generated tokens, plus any the last verification produced after an EOS. The cache is shared
    by all requests of this instance and by nobody else; :meth:`clear_cache` empties it.

    Args:
        config: :class:`SuffixConfig` (default: the paper's settings).
    """

    name = "suffix"

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self.cache = SuffixIndex()
        self._request = SuffixIndex()
        self._output_start: int | None = None  # None: no request in progress

    @property
    def indexes(self) -> tuple[SuffixIndex, SuffixIndex]:
        """The request index and the cache, in the order ties are broken."""
        return self._request, self.cache

    def reset(self) -> None:
        """Cache the finished request's output (evicting the oldest over the bound); forget the request."""
        if self._output_start is not None:
            self._remember(self._request.last_sequence()[self._output_start :])
        self._request = SuffixIndex()
        self._output_start = None

    def clear_cache(self) -> None:
        """Forget every earlier request's output (the cache) and the request in progress: the state
        of a new instance. The benchmark calls it before each prompt, so that no prompt's timing
        depends on what was decoded before it."""
        self.cache = SuffixIndex()
        self._request = SuffixIndex()
        self._output_start = None

    def _remember(self, output: npt.NDArray[np.int64]) -> None:
        """Add ``output`` (int64 ``[n]``) to the cache, evicting the oldest requests over the bound."""
        bound = self.config.max_cached_tokens
        if bound == 0 or output.shape[0] == 0:
            return
        output = output[-bound:]
        while self.cache.num_tokens + output.shape[0] > bound:
            self.cache.evict_oldest()
        self.cache.add_sequence(output)

    def _sync(self, context: npt.NDArray[np.int64]) -> None:
        """Make the request index hold exactly ``context``: extend it, or roll back first."""
        if self._output_start is None:
            self._request.add_sequence(context)
            self._output_start = max(context.shape[0] - 1, 0)
            return
        held = self._request.last_sequence()
        n = min(held.shape[0], context.shape[0])
        differ = np.flatnonzero(held[:n] != context[:n])
        keep = int(differ[0]) if differ.shape[0] else n
        if keep < held.shape[0]:
            self._request.truncate(keep)
        self._request.extend(context[keep:])

    def propose(
        self,
        context: torch.Tensor,
        num_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftTokens:
        """Draft up to ``num_tokens`` tokens after ``context`` (int64 ``[T]``): int64 ``[m]``,
        0 <= m <= num_tokens, ``probs=None``.

        Raises:
            ValueError: ``context`` is not one-dimensional.
        """
        if context.dim() != 1:
            raise ValueError(f"context must be int64 [T], got shape {list(context.shape)}")
        ids = context.detach().cpu().numpy()
        self._sync(ids)
        c = self.config
        pattern = ids[-c.max_depth :]
        options = [i.speculate(pattern, num_tokens, c.max_spec_factor, c.min_token_prob) for i in self.indexes]
        best = max(options, key=lambda s: s.score)  # the first (the request index) on a tie
        return DraftTokens(torch.tensor(best.ids, dtype=torch.int64))

    def observe(self, result: VerifyResult) -> None:
        """Add the accepted and the target's own tokens to the request index."""
        if self._output_start is not None:
            self._request.extend(result.tokens.detach().cpu().numpy())
