"""How the llama.cpp batched runner cuts a step's tokens into ``llama_decode`` calls (no model).

With ``kv_unified`` off llama.cpp splits a batch into micro-batches over runs of consecutive
sequence ids, each one more pass over the weights; exact mode therefore fills a call with one row's
tokens or with single tokens of rows whose ids follow each other (models/llamacpp/batch.py).
"""

from __future__ import annotations

from specdecode.models.llamacpp.batch import plan_passes


def entries(counts: dict[int, int], seq_ids: list[int]) -> list[tuple[int, int, bool]]:
    """Tokens of rows ``counts`` (row -> tokens), rows in sequence-id order, last token scored."""
    rows = sorted(counts, key=lambda r: seq_ids[r])
    return [(r, i, i == counts[r] - 1) for r in rows for i in range(counts[r])]


def rows_of(passes: list[list[tuple[int, int, bool]]]) -> list[list[tuple[int, int]]]:
    return [[(r, i) for r, i, _ in p] for p in passes]


def test_one_token_rows_with_consecutive_ids_share_calls_of_at_most_limit() -> None:
    seq_ids = list(range(8))
    got = rows_of(plan_passes(entries(dict.fromkeys(range(8), 1), seq_ids), seq_ids, 3, exact=True))
    assert got == [[(0, 0), (1, 0), (2, 0)], [(3, 0), (4, 0), (5, 0)], [(6, 0), (7, 0)]]


def test_a_gap_in_sequence_ids_starts_a_new_call() -> None:
    seq_ids = [0, 1, 3, 4]  # sequence 2 left
    got = rows_of(plan_passes(entries(dict.fromkeys(range(4), 1), seq_ids), seq_ids, 3, exact=True))
    assert got == [[(0, 0), (1, 0)], [(2, 0), (3, 0)]]


def test_runs_go_alone_in_pieces_and_their_last_single_token_joins_the_singles() -> None:
    seq_ids = [0, 1, 2]
    counts = {0: 4, 1: 1, 2: 2}  # row 0: 4 tokens -> 3 + 1; row 1: one; row 2: two
    got = rows_of(plan_passes(entries(counts, seq_ids), seq_ids, 3, exact=True))
    assert got == [[(0, 0), (0, 1), (0, 2)], [(2, 0), (2, 1)], [(0, 3), (1, 0)]]
    # every token exactly once, each row's tokens in order, no call over the limit
    flat = [t for p in got for t in p]
    assert sorted(flat) == sorted((r, i) for r, n in counts.items() for i in range(n))
    for r in counts:
        assert [i for rr, i in flat if rr == r] == list(range(counts[r]))
    assert max(len(p) for p in got) <= 3


def test_rows_are_taken_in_sequence_id_order_and_fast_mode_cuts_plainly() -> None:
    seq_ids = [2, 0, 1]  # row 0 holds sequence 2
    e = entries({0: 1, 1: 1, 2: 1}, seq_ids)
    assert [r for r, _, _ in e] == [1, 2, 0]
    assert rows_of(plan_passes(e, seq_ids, 3, exact=True)) == [[(1, 0), (2, 0), (0, 0)]]
    many = entries({0: 5, 1: 2}, [0, 1])
    assert [len(p) for p in plan_passes(many, [0, 1], 4, exact=False)] == [4, 3]


def test_a_greedy_rows_cuts_end_its_pieces_and_a_last_single_token_still_joins_the_singles() -> None:
    seq_ids = [0, 1, 2]
    counts = {0: 6, 1: 1, 2: 3}  # row 0: a greedy draft of 5 (cuts 2, 6); row 2: cuts 2, 3
    got = rows_of(plan_passes(entries(counts, seq_ids), seq_ids, 64, exact=True, cuts={0: [2, 6], 2: [2, 3]}))
    assert got == [[(0, 0), (0, 1)], [(0, 2), (0, 3), (0, 4), (0, 5)], [(2, 0), (2, 1)], [(1, 0), (2, 2)]]
    # without cuts each run is one call of up to the limit
    assert rows_of(plan_passes(entries(counts, seq_ids), seq_ids, 64, exact=True))[0] == [(0, i) for i in range(6)]
