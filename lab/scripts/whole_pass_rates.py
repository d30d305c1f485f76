"""Expected decoding rate of a greedy draft verified with the early stop (a call of 2 rows, then the
rest in a second call) or in one whole call, under a linear call cost ``c(n) = fixed + per_row * n``
(the patched llama.cpp build's exact mode on the 2-core EPYC, 2026-11-28: 20.9 + 12.1 n ms), for a
draft whose first token is right with probability a1 and each later one, after a right one, with q.

Prints, per (a1, q), the best d and its rate (expected tokens per ms over plain decoding's, one token
per c(1)) for each scheme, and the best multi-chunk plan (a dynamic programme over chunk ends).
lab/notebook/2026-11-28-rows-and-attention.md, "A whole pass instead of the early stop".

    python lab/scripts/whole_pass_rates.py [--fixed 20.9] [--per-row 12.1]
"""

from __future__ import annotations

import argparse


def accepted_through(m: int, a1: float, q: float) -> float:
    """Probability that drafts 1 .. m are all right (1 for m = 0)."""
    return 1.0 if m == 0 else a1 * q ** (m - 1)


def expected(a1: float, q: float, d: int, ends: list[int], call: list[float]) -> tuple[float, float]:
    """(expected tokens, expected ms) of d drafted tokens verified in calls ending at ``ends``."""
    tokens = 1 + sum(accepted_through(i, a1, q) for i in range(1, d + 1))
    cost, start = 0.0, 0
    for end in ends:
        cost += accepted_through(start, a1, q) * call[end - start]
        start = end
    return tokens, cost


def best_plan(a1: float, q: float, d: int, call: list[float]) -> list[int]:
    """Chunk ends minimizing the expected cost of verifying d drafted tokens."""
    width = d + 1
    best: dict[int, tuple[float, list[int]]] = {width: (0.0, [])}
    for start in range(width - 1, -1, -1):
        options = []
        for end in range(start + 1, width + 1):
            go_on = accepted_through(end, a1, q) / accepted_through(start, a1, q) if end < width else 0.0
            options.append((call[end - start] + go_on * best[end][0], [end, *best[end][1]]))
        best[start] = min(options)
    return best[0][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixed", type=float, default=20.9)
    parser.add_argument("--per-row", type=float, default=12.1)
    args = parser.parse_args()
    call = [0.0] + [args.fixed + args.per_row * n for n in range(1, 66)]
    plain = 1 / call[1]
    for a1, q in ((0.95, 0.9), (0.98, 0.93), (0.8, 0.85), (0.6, 0.8)):
        schemes: dict[str, tuple[float, int]] = {}
        for d in range(1, 33):
            for name, ends in (
                ("early stop", [2, d + 1] if d > 1 else [d + 1]),
                ("whole", [d + 1]),
                ("best plan", best_plan(a1, q, d, call)),
            ):
                tokens, ms = expected(a1, q, d, ends, call)
                rate = tokens / ms / plain
                if rate > schemes.get(name, (0.0, 0))[0]:
                    schemes[name] = (rate, d)
        print(f"a1 {a1}, q {q}: " + "; ".join(f"{n} {r:.2f}x (d {d})" for n, (r, d) in schemes.items()))


if __name__ == "__main__":
    main()
