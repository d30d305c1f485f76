"""Many sequences in one llama.cpp context: the llamacpp backend's batched runner (the server's).

:class:`LlamaCppBatchedRunner` has the interface of the torch backend's
:class:`~specdecode.models.torch.batch.TorchBatchedRunner` (rows ``0 .. num_rows - 1``, ``add_row``,
``remove_row``, ``truncate(row, n)``, ``forward(first, inputs, num_logits)``), over one llama.cpp
context holding up to ``max_rows`` sequences. Each row is a llama.cpp sequence id with its own KV
stream (``kv_unified`` off: a row's cells, and so its attention, never depend on another row's);
rollback is ``llama_memory_seq_rm`` of that sequence; a row that leaves frees its cells, and the
last row takes its index without moving any data (only the row -> sequence id map changes).

A :meth:`~LlamaCppBatchedRunner.forward` over several rows puts their tokens into llama.cpp
batches, each token tagged with its row's sequence id and position:

- ``exact=False`` (fast): one ``llama_decode`` over every row's tokens (split only when they
  exceed ``n_batch``): the continuous-batching pass. llama.cpp's matrix kernels pick their summation
  order by the pass's total rows, so a row's logits may differ in the last bits from the same row
  decoded alone: greedy output equals each request decoded alone up to near-ties.
- ``exact=True`` (the default, as for one sequence): every ``llama_decode`` carries at most
  :attr:`~specdecode.models.llamacpp.LlamaCppOptions.invariant_tokens` tokens in all, the passes
  measured bit-identical to one-token passes (:mod:`specdecode.models.llamacpp.model`), so each row gets
  the logits it would get alone and greedy output equals plain decoding by construction. A prefill
  (one scored position) goes alone, in ``n_batch`` chunks, as the single-sequence runner does.

Batch order matters for speed. With ``kv_unified`` off llama.cpp cuts a batch into micro-batches
(``llama_batch_allocr::split_equal``, sequential) that take the same number of tokens from each of
a run of *consecutive, increasing* sequence ids; every micro-batch is one more pass over the
weights. So a row takes the lowest free sequence id, tokens go into a batch in sequence-id order,
and exact mode fills each ``llama_decode`` with tokens of one row, or with one token each of rows
whose ids follow each other (measured, 8 rows of one token each: 133 ms in one micro-batch, 180
ms with the ids in the order ``[0, 1, 2, 7, 4, 5, 6, 3]``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from specdecode.models.contract import RowTable, RunnerCapabilities
from specdecode.models.llamacpp.model import (
    LlamaCppModel,
    _lib,
    decode_batch,
    free_context,
    greedy_chunks,
    new_context,
    reuses_prefixes,
)
from specdecode.sampling import argmax_ids


def plan_passes(
    entries: list[tuple[int, int, bool]],
    seq_ids: Sequence[int],
    limit: int,
    exact: bool,
    cuts: dict[int, list[int]] | None = None,
) -> list[list[tuple[int, int, bool]]]:
    """Cut a batched forward's tokens into ``llama_decode`` calls of at most ``limit`` tokens.

    Args:
        entries: every token as ``(row, index in the row's input, scored?)``, rows in sequence-id
            order, each row's tokens together and in order.
        seq_ids: per row, its llama.cpp sequence id.
        limit: the most tokens per call.
        exact: exact mode: a row's run of tokens goes in pieces of ``limit``; single tokens (a row
            of one token, or a run's last piece of one) share a call with the following rows' single
            tokens while their sequence ids follow each other, so that every call is one llama.cpp
            micro-batch (see the module docstring). Else plain cuts of ``limit``.
        cuts: exact mode, per row (by index), where its run's pieces end instead (exclusive ends
            within the run, increasing, the last its length; each piece at most ``limit``): a greedy
            verification's chunks (:func:`~specdecode.models.llamacpp.model.greedy_chunks`), so that a
            wrong draft token stops the row after its first chunk.

    Returns:
        the calls, in an order that keeps each row's tokens in order.
    """
    if not exact:
        return [entries[i : i + limit] for i in range(0, len(entries), limit)]
    passes: list[list[tuple[int, int, bool]]] = []
    singles: list[tuple[int, int, bool]] = []
    start = 0
    while start < len(entries):
        row = entries[start][0]
        end = start
        while end < len(entries) and entries[end][0] == row:
            end += 1
        ends = (
            [start + e for e in cuts[row]] if cuts and row in cuts else list(range(start + limit, end, limit)) + [end]
        )
        for piece in (entries[a:b] for a, b in zip([start, *ends[:-1]], ends, strict=True)):
            if len(piece) > 1:
                passes.append(piece)
                continue
            if singles and (len(singles) == limit or seq_ids[piece[0][0]] != seq_ids[singles[-1][0]] + 1):
                passes.append(singles)
                singles = []
            singles.append(piece[0])
        start = end
    if singles:
        passes.append(singles)
    return passes


class LlamaCppBatchedRunner:
    """Up to ``max_rows`` sequences of a :class:`~specdecode.models.llamacpp.LlamaCppModel` in one
    llama.cpp context.

    Args:
        model: the loaded GGUF model (its :class:`~specdecode.models.llamacpp.LlamaCppOptions`:
            threads, ``n_batch``, ``exact``, ``invariant_tokens``).
        max_rows: the most sequences at once (llama.cpp's ``n_seq_max``).
        n_ctx: KV cells of the whole context (default: ``options.n_ctx`` per row); each row may hold
            ``n_ctx // max_rows`` tokens (:attr:`max_length`).

    Attributes:
        reference_kernels: the reference-kernel switch in exact mode (as
            :attr:`~specdecode.models.llamacpp.LlamaCppRunner.reference_kernels`), else None.

    Raises:
        ValueError: ``max_rows`` < 1, or llama.cpp cannot create the context.
    """

    capabilities = RunnerCapabilities(backend="llamacpp", returns_hidden=False, trees=False, prefix_cache=True)
    """The runner contract's capabilities (:class:`~specdecode.models.contract.RunnerCapabilities`):
    prefix caching (a row's cells stay in its sequence id when it leaves with ``keep``; an instance
    offers it where :func:`~specdecode.models.llamacpp.model.reuses_prefixes`); no features
    (``return_hidden``: the server does not offer Medusa / EAGLE on this runner;
    ``specdecode generate`` runs them on llama.cpp, one sequence), no trees; an instance's
    ``batch_invariant`` and ``greedy_hints`` are its model's ``exact`` option, and a greedy row
    stops early where the single-sequence runner's pass does (``greedy_stop_rows``,
    ``greedy_stop_then``: :attr:`LlamaCppModel.capabilities
    <specdecode.models.llamacpp.model.LlamaCppModel.capabilities>`)."""

    def __init__(self, model: LlamaCppModel, max_rows: int, n_ctx: int | None = None) -> None:
        self.rows = RowTable(max_rows)  # checks max_rows; a row's slot is its llama.cpp sequence id
        lib = _lib()
        self.model = model
        self.max_rows = max_rows
        options = model.options
        stops = model.capabilities  # where a greedy pass stops early: as the single-sequence runner
        self._ctx, self.reference_kernels = new_context(model, n_ctx or options.n_ctx * max_rows, n_seq_max=max_rows)
        self.capabilities = replace(
            type(self).capabilities,
            batch_invariant=options.exact,
            greedy_hints=options.exact,
            greedy_stop_rows=stops.greedy_stop_rows,
            greedy_stop_then=stops.greedy_stop_then,
            prefix_cache=reuses_prefixes(options.exact, self.reference_kernels),
        )
        self._per_row = int(lib.llama_n_ctx(self._ctx)) // max_rows
        self._memory = lib.llama_get_memory(self._ctx)
        self._batch = lib.llama_batch_init(options.n_batch, 0, 1)
        self._lib = lib
        self.passes = 0  # llama_decode calls made

    # ------------------------------------------------------------------ rows
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # logits come back in host memory

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def max_length(self) -> int:
        """Tokens one row holds: the context's cells over ``max_rows``."""
        return self._per_row

    @property
    def num_rows(self) -> int:
        return self.rows.num_rows

    @property
    def lengths(self) -> list[int]:
        """Per row, its cached tokens (:class:`~specdecode.models.contract.RowTable`)."""
        return self.rows.lengths

    @property
    def seq_ids(self) -> list[int]:
        """Per row, its llama.cpp sequence id (the row table's slot)."""
        return self.rows.slots

    @property
    def free_slots(self) -> list[int]:
        """Sequence ids no row is on (lowest first); an idle one may still hold a kept row's cells."""
        return self.rows.free_slots

    def add_row(self, slot: int | None = None, keep: int = 0) -> int:
        """Start a row at the end and return its index: on ``slot`` (a free sequence id; None: the
        lowest free one, so rows' ids stay consecutive: one micro-batch, see the module docstring)
        with the first ``keep`` cells that sequence holds kept (a prefix a leaving row kept:
        :meth:`remove_row` ``keep``; :mod:`specdecode.models.prefix_cache`) and the rest dropped.

        Raises:
            RuntimeError: all ``max_rows`` rows are in use.
            ValueError: ``slot`` is not free, or ``keep`` is negative or more than a row holds.
        """
        if not 0 <= keep <= self._per_row:
            raise ValueError(f"keep must be in [0, {self._per_row}], got {keep!r}")
        row = self.rows.add(slot, keep)
        self._lib.llama_memory_seq_rm(self._memory, self.seq_ids[row], keep, -1)  # whatever it held after keep
        return row

    def remove_row(self, row: int, keep: bool = False) -> int | None:
        """Free ``row``; the last row takes its index (no data moves, only the row -> sequence id map
        changes). Its cells are freed, or with ``keep`` stay in its sequence (an idle cached prefix a
        later :meth:`add_row` on that slot adopts).

        Returns:
            the former index of the row that moved to ``row``, or None when ``row`` was the last.
        """
        if not keep:
            self._lib.llama_memory_seq_rm(self._memory, self.seq_ids[self.rows.check_row(row)], 0, -1)
        return self.rows.remove(row)

    def truncate(self, row: int, length: int) -> None:
        """Keep only the first ``length`` cached tokens of ``row`` (rollback).

        Raises:
            ValueError: ``length`` is negative or longer than the row.
        """
        if self.rows.truncate(row, length):
            if not self._lib.llama_memory_seq_rm(self._memory, self.seq_ids[row], length, -1):  # pragma: no cover
                raise RuntimeError(f"llama.cpp could not truncate row {row} to {length} tokens")

    # ------------------------------------------------------------------ passes
    def forward(
        self,
        first: int,
        inputs: Sequence[torch.Tensor],
        num_logits: Sequence[int],
        return_hidden: bool = False,
        greedy_drafts: Sequence[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]:
        """Append ``inputs[b]`` to row ``first + b`` for every b.

        Args:
            first: the first row; the call covers rows ``first .. first + len(inputs) - 1``.
            inputs: per row, int64 ``[n_b]`` (n_b >= 1), the tokens after the row's cached ones.
            num_logits: per row, how many of its last positions to score (1 <= num_logits[b] <= n_b).
            return_hidden: not served by this runner (features are for Medusa / EAGLE, which run on
                the torch backend).
            greedy_drafts: per row, for a greedy verification pass (``num_logits[b] == n_b``), the
                drafted tokens ``inputs[b][1:]`` (else None): in exact mode, which splits passes
                anyway, a row stops after the first pass in which a scored position's argmax
                disagrees with its draft (the verifier rejects there; later rows would be thrown
                away), as :meth:`~specdecode.models.llamacpp.LlamaCppRunner.forward` does, and its
                first pass is as short (:func:`~specdecode.models.llamacpp.model.greedy_chunks`).

        Returns:
            per row, float32 ``[num_logits[b], V]``; row i scores the token after
            ``inputs[b][n_b - num_logits[b] + i]``, as the single-sequence runner does. A row that
            stopped early (``greedy_drafts``) has fewer, ``[m_b, V]``, and only its first ``m_b``
            tokens are cached (:attr:`lengths` says so).

        Raises:
            ValueError: rows outside ``0 .. num_rows - 1``, an empty input, a bad ``num_logits``, a
                row that would not fit in :attr:`max_length`.
            CapabilityError: ``return_hidden`` (a ValueError; this runner returns no features).
            RuntimeError: ``llama_decode`` failed.
        """
        B = len(inputs)
        self.rows.check_call(first, B, len(num_logits))
        if return_hidden:
            self.capabilities.require("returns_hidden", self, "return_hidden (features for Medusa / EAGLE)")
        tokens = [x.reshape(-1).tolist() for x in inputs]
        for b, (ids, m) in enumerate(zip(tokens, num_logits, strict=True)):
            row = first + b
            if not ids or not 1 <= m <= len(ids):
                raise ValueError(f"row {row}: need 1 <= num_logits ({m}) <= tokens ({len(ids)})")
            if self.lengths[row] + len(ids) > self._per_row:
                raise ValueError(
                    f"row {row}: {self.lengths[row] + len(ids)} tokens exceed the {self._per_row} a row holds"
                )
        # Every token as (row, position in the row's input, scored?), rows in sequence-id order.
        order = sorted(range(B), key=lambda b: self.seq_ids[first + b])
        entries = [(first + b, i, i >= len(tokens[b]) - num_logits[b]) for b in order for i in range(len(tokens[b]))]
        options = self.model.options
        limit = options.n_batch
        out: dict[int, list[torch.Tensor]] = {first + b: [] for b in range(B)}
        done = dict.fromkeys(out, 0)  # per row: input tokens decoded
        if options.exact:
            prefills = [first + b for b, m in enumerate(num_logits) if m == 1 and len(tokens[b]) > 1]
            for row in prefills:  # one scored position over many tokens: alone, as one sequence prefills
                ids = tokens[row - first]
                rows_entries = [(row, i, i == len(ids) - 1) for i in range(len(ids))]
                for start in range(0, len(ids), limit):
                    out[row] += self._decode(rows_entries[start : start + limit], tokens, first)
                done[row] = len(ids)
            entries = [e for e in entries if e[0] not in prefills]
            limit = min(limit, options.invariant_tokens)
        drafts = {
            first + b: d
            for b, d in enumerate(greedy_drafts or [])
            if d is not None and options.exact and num_logits[b] == len(tokens[b])
        }
        # a greedy row's first chunk is short (as the single-sequence runner's): a wrong first draft
        # token stops it there, not after its whole draft
        cuts = {row: greedy_chunks(len(tokens[row - first]), limit) for row in drafts}
        stopped: set[int] = set()
        for chunk in plan_passes(entries, self.seq_ids, limit, options.exact, cuts):
            part = [e for e in chunk if e[0] not in stopped]
            if not part:
                continue
            logits = self._decode(part, tokens, first)
            scored = [(row, i) for row, i, is_scored in part if is_scored]
            for (row, i), row_logits in zip(scored, logits, strict=True):
                out[row].append(row_logits)
                draft = drafts.get(row)
                if draft is not None and i < len(draft) and int(argmax_ids(row_logits)) != int(draft[i]):
                    stopped.add(row)  # the verifier rejects the draft token at i: the rest is wasted
            for row, _, _ in part:
                done[row] += 1
        for row, n in done.items():
            self.rows.lengths[row] += n
        return [torch.stack(out[first + b]) for b in range(B)]

    def _decode(self, entries: list[tuple[int, int, bool]], tokens: list[list[int]], first: int) -> list[torch.Tensor]:
        """One ``llama_decode`` of ``entries`` (row, index into the row's input, scored?) at positions
        ``lengths[row] + index`` (lengths advance once the whole forward is done); the float32 logits
        ``[V]`` of the scored ones, in order."""
        lib = self._lib
        decode_batch(
            lib,
            self._ctx,
            self._batch,
            [tokens[row - first][i] for row, i, _ in entries],
            [self.lengths[row] + i for row, i, _ in entries],
            [self.seq_ids[row] for row, _, _ in entries],
            [scored for _, _, scored in entries],
            self.reference_kernels,
        )
        self.passes += 1
        V = self.vocab_size
        result = []
        for j, (_, _, scored) in enumerate(entries):
            if scored:
                pointer = lib.llama_get_logits_ith(self._ctx, j)
                array = np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(V,))
                result.append(torch.from_numpy(array.copy()))
        return result

    def __del__(self) -> None:
        free_context(self)
