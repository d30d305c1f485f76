"""Whether a method's place in its round of methods moves its time (``bench`` rotates the order:
each record keeps its ``position``). Per (turn, method), each repeat's wall time over the median of
that turn's repeats; then the mean of those ratios per method and position, and over all methods.
``python lab/scripts/position_effect.py RESULTS.json``"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def main() -> None:
    data = json.load(open(sys.argv[1]))
    runs: dict[tuple[str, int, str], list[dict]] = defaultdict(list)
    for r in data["records"]:
        runs[(str(r["question_id"]), r["turn"], r["method"])].append(r)
    ratios: dict[tuple[str, int], list[float]] = defaultdict(list)
    for (_, _, method), same in runs.items():
        median = statistics.median(r["wall_time_s"] for r in same)
        for r in same:
            place = r.get("position", data["methods"].index(method))  # before the rotation: the listed order
            ratios[(method, place)].append(r["wall_time_s"] / median)
            ratios[("all", place)].append(r["wall_time_s"] / median)
    positions = sorted({p for _, p in ratios})
    print("method".ljust(40), *[f"place {p}".rjust(16) for p in positions])
    for method in [*dict.fromkeys(m for m, _ in ratios if m != "all"), "all"]:
        cells = []
        for p in positions:
            xs = ratios.get((method, p), [])
            cells.append(f"{statistics.mean(xs):.4f} (n={len(xs)})".rjust(16) if xs else "-".rjust(16))
        print(method[:40].ljust(40), *cells)


if __name__ == "__main__":
    main()
