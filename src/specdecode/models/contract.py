"""The runner contract (docs/design.md §2b) as code: what everything above ``models/`` may call.

The engine, the proposers, the verifier, trees, the server and bench talk to a model only through a
runner: :class:`Runner` (one sequence, batch 1) or :class:`BatchedRunner` (many sequences, one pass;
the server's). Both are ``typing.Protocol`` s, ``runtime_checkable``, so ``isinstance(r, Runner)``
checks that every member is there (not their signatures). The implementations:

- torch: :class:`~specdecode.models.torch.runner.ModelRunner`,
  :class:`~specdecode.models.torch.batch.TorchBatchedRunner` (which implements this module's
  :class:`BatchedRunner` protocol);
- llamacpp: :class:`~specdecode.models.llamacpp.LlamaCppRunner`,
  :class:`~specdecode.models.llamacpp.batch.LlamaCppBatchedRunner`.

What a runner can do beyond the common members is **declared**, not probed: every runner has a
``capabilities`` attribute, a frozen :class:`RunnerCapabilities`. A caller that needs one asks it
(``runner.capabilities.trees``) or calls :meth:`RunnerCapabilities.require`, which refuses with an
error naming the runner and the capability. Nothing above ``models/`` branches on a backend's name;
``capabilities.backend`` is there for records and messages only.

Device policy (§2b): a runner's :attr:`~Runner.device` is where its logits and hidden states live
(the torch runners: the model's device; llama.cpp's: ``cpu``). Inputs (ids, positions, masks,
``keep``) may be CPU tensors: the runner moves them to its device itself. Logits are float32 and
are not copied back to the host.

:class:`RowTable` is the batched runners' row bookkeeping (rows ``0 .. num_rows - 1``, one cached
length per row, a slot per row that moves with it), written once for both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


class CapabilityError(ValueError):
    """A caller asked a runner for something it declares it cannot do (the message names both)."""


@dataclass(frozen=True)
class RunnerCapabilities:
    """What a runner can do beyond the contract's common members: declared by every runner as its
    ``capabilities`` attribute, read by callers, never probed.

    Attributes:
        backend: ``"torch"`` or ``"llamacpp"``: for records and error messages only; nothing above
            ``models/`` branches on it.
        returns_hidden: ``forward(..., return_hidden=True)`` returns the target's features (final
            hidden states after the final norm, what the LM head reads): Medusa and EAGLE need it.
        trees: token trees: ``forward_masked`` (explicit positions and an ancestor mask) and
            ``compact(keep)`` after it.
        reduced_head: the runner can be built with ``head_ids`` (a reduced LM head over a token map,
            FR-Spec): a draft's ``token_map``.
        model_insides: the model is a ``transformers`` module whose parts a proposer may use: its
            first layers (early exit), an int8 copy of its linear layers (``draft_quantization``),
            its LM head and embeddings (a trained drafter borrows them); else they come from the
            model's file (a GGUF's LM-head rows and embeddings, dequantized).
        batch_invariant: a verification pass gives every scored row the logits a one-token pass
            would, bit for bit, so greedy output equals plain decoding by construction (llama.cpp's
            ``exact`` mode); False: equal up to near-ties that rounding flips.
        greedy_hints: the greedy hints (``greedy_draft``, ``greedy_drafts``, ``greedy``) may cut a
            pass short: fewer logits rows (or NaN rows of a tree) than asked come back, and
            ``length`` / ``lengths`` say how many tokens were cached. A caller must read the rows it
            got, whatever this says; it is for records.
        greedy_stop_rows: with a greedy hint, a pass computes its first chunk of this many rows,
            then chunks of ``greedy_stop_then`` rows, and stops after the first chunk whose argmax
            disagrees with the draft (llama.cpp's exact mode); None: every row is computed. For the
            draft gate's price of a draft (:mod:`specdecode.draft_gate`): a wrong draft then costs
            the chunks up to it, not the pass.
        greedy_stop_then: the rows of each chunk after the first (None: as many as the first).
        prompt_reuse: the runner has ``restart(input_ids, num_logits=1, return_hidden=False)``: a
            new sequence's first pass, answered without a pass when the previous sequence also began
            with a ``restart`` of the same arguments and the cache still holds its entries (exact bit for bit:
            :mod:`specdecode.models.first_pass`); its ``reused_prompt`` then says whether it was, and
            ``cached_tokens`` how many prompt tokens it did not feed (llama.cpp's runner also keeps
            the longest common prefix with the cached sequence).
        prefix_cache: a batched runner whose rows are slots with KV cells of their own: a leaving
            row may keep its cells (``remove_row(row, keep=True)``) and a new row may adopt a free
            slot's first ``n`` cells (``add_row(slot, keep=n)``, the rest dropped), so the server's
            prefix cache (:mod:`specdecode.models.prefix_cache`) prefills only what is new.
    """

    backend: str
    returns_hidden: bool = True
    trees: bool = True
    reduced_head: bool = False
    model_insides: bool = False
    batch_invariant: bool = False
    greedy_hints: bool = False
    greedy_stop_rows: int | None = None
    greedy_stop_then: int | None = None
    prompt_reuse: bool = False
    prefix_cache: bool = False

    def require(self, capability: str, runner: object, need: str) -> None:
        """Raise :class:`CapabilityError` unless ``capability`` (a field name) is True.

        Args:
            capability: the field, e.g. ``"returns_hidden"``.
            runner: the runner (or its class) asked, named in the message.
            need: what needs it, e.g. ``"proposer 'eagle'"``.

        Raises:
            CapabilityError: the runner lacks it; the message names the runner, its backend and the
                capability.
            AttributeError: ``capability`` is not a field.
        """
        value = vars(self).get(capability)
        if not isinstance(value, bool):
            raise AttributeError(f"{capability!r} is not a runner capability")
        if not value:
            name = runner.__name__ if isinstance(runner, type) else type(runner).__name__
            raise CapabilityError(
                f"{need} needs a runner with {capability}; {name} (backend {self.backend}) does not have it"
            )


@runtime_checkable
class Runner(Protocol):
    """One sequence (batch 1) with a KV cache that rolls back by truncation.

    The cache always holds the first :attr:`length` tokens of the sequence; :meth:`forward` appends,
    :meth:`truncate` drops the newest (rollback after a rejected draft), never re-running a prefill.

    Attributes:
        capabilities: what it can do beyond these members (:class:`RunnerCapabilities`).
        length: tokens cached.
        head_ids: int64 ``[N]`` token ids of a reduced LM head (the logits' columns), or None for
            the full vocabulary (``capabilities.reduced_head`` runners only set it).
        model: the loaded model it runs (records, weight accounting); not to be called directly.
    """

    capabilities: RunnerCapabilities
    length: int
    head_ids: torch.Tensor | None
    model: Any

    @property
    def device(self) -> torch.device:
        """Where logits and hidden states live (``cpu`` for llama.cpp)."""
        ...

    @property
    def dtype(self) -> str:
        """What the weights are, for records (``"bfloat16"``, ``"gguf-Q4_K_M"``)."""
        ...

    @property
    def vocab_size(self) -> int:
        """V, the size of the logits' last dimension (the full head's; ``len(head_ids)`` with one)."""
        ...

    @property
    def max_length(self) -> int:
        """The most tokens the sequence may hold."""
        ...

    def reset(self) -> None:
        """Forget the whole sequence (``length`` becomes 0)."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        num_logits: int = 1,
        return_hidden: bool = False,
        greedy_draft: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append ``input_ids`` (int64 ``[T]``, T >= 1, CPU or :attr:`device`) and score the last
        ``num_logits`` positions (1 <= num_logits <= T).

        Returns:
            float32 ``[num_logits, V]`` on :attr:`device`, row i scoring the token after
            ``input_ids[T - num_logits + i]``; with ``return_hidden`` (``capabilities.returns_hidden``)
            ``(logits, hidden [T, H])``. With ``greedy_draft`` (the drafted tokens ``input_ids[1:]``
            of a greedy verification pass) a runner may stop early and return ``[m, V]``,
            ``m < num_logits``; :attr:`length` then counts only the tokens it cached.
        """
        ...

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached tokens (0 <= length <= :attr:`length`)."""
        ...

    def forward_masked(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attend: torch.Tensor,
        num_logits: int | None = None,
        return_hidden: bool = False,
        greedy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """A token tree's pass (``capabilities.trees``): ``input_ids`` int64 ``[M]``,
        ``position_ids`` int64 ``[M]``, ``attend`` bool ``[M, length + M]`` (all may be CPU tensors).

        Returns:
            float32 ``[num_logits, V]`` on :attr:`device` (default ``num_logits = M``); with
            ``return_hidden`` ``(logits, hidden [M, H])``. With ``greedy``, rows the greedy walk
            never reaches may be NaN.
        """
        ...

    def compact(self, keep: torch.Tensor) -> None:
        """After a tree pass, keep the cache entries ``keep`` (int64 ``[n]``, increasing, on the
        CPU: the accepted root path) right after the entries before ``keep[0]``; drop the rest."""
        ...

    def prepare_widths(self, widths: Iterable[int]) -> None:
        """Get ready for chain passes of these widths (tokens per :meth:`forward`), called after
        the prefill: a runner that replays CUDA graphs captures them now, outside the decoding steps
        (:class:`~specdecode.models.torch.static_runner.StaticCacheRunner`); others do nothing. The
        cached sequence is unchanged."""
        ...


@runtime_checkable
class BatchedRunner(Protocol):
    """Up to :attr:`max_rows` sequences (rows ``0 .. num_rows - 1``) that share one pass per step.

    Rows join at the end (:meth:`add_row`) and leave by :meth:`remove_row`, after which the last
    row takes the freed index: the active rows are always ``0 .. num_rows - 1``.

    Attributes:
        capabilities: what it can do (:class:`RunnerCapabilities`; ``trees`` is False for both
            batched runners today).
        max_rows: the most rows at once.
        model: the loaded model it runs (records).
    """

    capabilities: RunnerCapabilities
    max_rows: int
    model: Any

    @property
    def device(self) -> torch.device:
        """Where logits and hidden states live."""
        ...

    @property
    def vocab_size(self) -> int:
        """V, the size of the logits' last dimension."""
        ...

    @property
    def max_length(self) -> int:
        """The most tokens one row may hold."""
        ...

    @property
    def num_rows(self) -> int:
        """Rows in use."""
        ...

    @property
    def lengths(self) -> list[int]:
        """Per row, its cached tokens (read only: the runner keeps it)."""
        ...

    def add_row(self, slot: int | None = None, keep: int = 0) -> int:
        """Start a row at the end and return its index (RuntimeError when all are in use): an empty
        one on the lowest free slot, or (``capabilities.prefix_cache``) on ``slot`` with its first
        ``keep`` cached tokens kept."""
        ...

    def remove_row(self, row: int, keep: bool = False) -> int | None:
        """Free ``row`` (``keep``, with ``capabilities.prefix_cache``: its slot keeps its cells);
        returns the former index of the row that moved into it (the last one), or None when
        ``row`` was the last."""
        ...

    def truncate(self, row: int, length: int) -> None:
        """Keep the first ``length`` cached tokens of ``row`` (rollback)."""
        ...

    def forward(
        self,
        first: int,
        inputs: Sequence[torch.Tensor],
        num_logits: Sequence[int],
        return_hidden: bool = False,
        greedy_drafts: Sequence[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Append ``inputs[b]`` (int64 ``[n_b]`` on the CPU) to row ``first + b`` for every b.

        Returns:
            per row, float32 ``[num_logits[b], V]`` on :attr:`device`; with ``return_hidden``
            (``capabilities.returns_hidden``) ``(logits, hidden)``, ``hidden[b]`` ``[n_b, H]``. A row
            cut short by ``greedy_drafts`` returns ``[m_b, V]`` and caches ``m_b`` tokens (see
            :attr:`lengths`).
        """
        ...


class RowTable:
    """The rows of a batched runner: rows ``0 .. num_rows - 1``, each with its cached length and a
    *slot* (an id in ``[0, max_rows)`` that stays with the row when it moves: llama.cpp's sequence
    id; the torch runner, which moves the row's data instead, does not read it).

    A new row takes the lowest free slot (so that the rows' llama.cpp sequence ids stay consecutive,
    :mod:`specdecode.models.llamacpp.batch`); a removed row's index goes to the last row, which keeps
    its slot and length.

    Args:
        max_rows: the most rows at once.

    Raises:
        ValueError: ``max_rows`` is not an integer >= 1.
    """

    def __init__(self, max_rows: int) -> None:
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows must be an integer >= 1, got {max_rows!r}")
        self.max_rows = max_rows
        self.lengths: list[int] = []  # per row: cached tokens
        self.slots: list[int] = []  # per row: its slot
        self._free = set(range(max_rows))

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def free_slots(self) -> list[int]:
        """Slots no row is on, lowest first."""
        return sorted(self._free)

    def add(self, slot: int | None = None, length: int = 0) -> int:
        """Start a row at the end, on ``slot`` (None: the lowest free slot) with its first ``length``
        tokens cached already (a prefix the slot kept: :mod:`specdecode.models.prefix_cache`);
        returns its index.

        Raises:
            RuntimeError: all ``max_rows`` rows are in use.
            ValueError: ``slot`` is not a free slot, or ``length`` is negative.
        """
        if not self._free:
            raise RuntimeError(f"all {self.max_rows} rows of the batched runner are in use")
        if slot is None:
            slot = min(self._free)
        elif slot not in self._free:
            raise ValueError(f"slot must be a free slot {sorted(self._free)}, got {slot!r}")
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"length must be an integer >= 0, got {length!r}")
        self._free.remove(slot)
        self.slots.append(slot)
        self.lengths.append(length)
        return self.num_rows - 1

    def check_row(self, row: int) -> int:
        """``row`` itself if it is in use.

        Raises:
            ValueError: ``row`` is not in ``0 .. num_rows - 1``.
        """
        last = self.num_rows - 1
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row <= last:
            raise ValueError(f"row must be in [0, {last}], got {row!r}")
        return row

    def remove(self, row: int) -> int | None:
        """Free ``row`` and its slot; the last row takes its index (with its slot and length).

        Returns:
            the former index of the row that moved to ``row``, or None when ``row`` was the last.

        Raises:
            ValueError: ``row`` not in use.
        """
        last = self.num_rows - 1
        self._free.add(self.slots[self.check_row(row)])
        slot, length = self.slots.pop(), self.lengths.pop()
        if row == last:
            return None
        self.slots[row], self.lengths[row] = slot, length
        return last

    def truncate(self, row: int, length: int) -> bool:
        """Keep the first ``length`` tokens of ``row``; True when that drops any (the runner then
        rolls its cache back).

        Raises:
            ValueError: ``row`` not in use, or ``length`` outside ``[0, lengths[row]]``.
        """
        have = self.lengths[self.check_row(row)]
        if not 0 <= length <= have:
            raise ValueError(f"truncate length of row {row} must be in [0, {have}], got {length}")
        self.lengths[row] = length
        return length < have

    def check_call(self, first: int, num_inputs: int, num_logits: int) -> None:
        """Check a forward's rows: ``num_inputs`` >= 1 inputs (and as many ``num_logits``) for rows
        ``first .. first + num_inputs - 1``, all in use.

        Raises:
            ValueError: otherwise (the message names the rows and counts).
        """
        if num_inputs == 0 or num_logits != num_inputs or not 0 <= first <= first + num_inputs <= self.num_rows:
            raise ValueError(
                f"rows {first}..{first + num_inputs - 1} with {num_logits} num_logits, have {self.num_rows}"
            )
