"""Per category of a bench run with repeats: tokens/s from each turn's median wall time over the
repeats (a timing spike in one repeat moves a median little, a sum a lot), and the ratios of a
method to the others. ``python lab/scripts/median_categories.py RESULTS.json [METHOD]``"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def main() -> None:
    data = json.load(open(sys.argv[1]))
    default = sys.argv[2] if len(sys.argv) > 2 else "prompt_lookup(min_ngram=3,max_ngram=8)"
    walls: dict[tuple[str, str, int, str], list[float]] = defaultdict(list)
    tokens: dict[tuple[str, str, int, str], int] = {}
    for r in data["records"]:
        key = (r["group"], str(r["question_id"]), r["turn"], r["method"])
        walls[key].append(r["wall_time_s"])
        tokens[key] = r["new_tokens"]
    methods = list(dict.fromkeys(k[3] for k in walls))
    per_group: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    for key, times in walls.items():
        for group in (key[0], "all"):
            cell = per_group[group][key[3]]
            cell[0] += tokens[key]
            cell[1] += statistics.median(times)
    others = [m for m in methods if m != default]
    print("category".ljust(15), *[m[:14].rjust(15) for m in methods], *[f"/{m[:8]}".rjust(10) for m in others])
    for group, cells in per_group.items():
        rate = {m: cells[m][0] / cells[m][1] for m in methods if cells[m][1]}
        print(
            group.ljust(15),
            *[f"{rate[m]:15.1f}" for m in methods],
            *[f"{rate[default] / rate[m]:10.3f}" for m in others],
        )


if __name__ == "__main__":
    main()
