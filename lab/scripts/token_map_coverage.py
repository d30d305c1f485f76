"""Coverage of token maps on the target's own outputs, per category.

Reads the ``target`` records of ``specdecode bench`` results (``results.json``: greedy token ids per
prompt) and prints, for each map, the share of output tokens whose id is in the map's first N ids:
the ceiling on a reduced-head draft's acceptance (a draft token outside the map can never be
proposed). The benchmark outputs only evaluate maps here; they are never used to build one.

Usage: python lab/scripts/token_map_coverage.py --maps default,/tmp/new.npy --sizes 16384,32768 \
    lab/results/issue4-all-categories/results.json [more results.json ...]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from specdecode.token_map import load_token_map


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+", help="results.json files of specdecode bench")
    parser.add_argument("--maps", default="default", help="comma list of token map files ('default': the shipped one)")
    parser.add_argument("--sizes", default="32768", help="comma list of N (the first N ids of each map)")
    args = parser.parse_args()

    outputs: dict[str, list[int]] = defaultdict(list)
    seen: set[tuple] = set()
    for path in args.results:
        for record in json.loads(Path(path).read_text())["records"]:
            key = (record["question_id"], record["turn"])
            if record["method"] == "target" and key not in seen:  # one output per prompt and turn
                seen.add(key)
                outputs[record["category"]].append(record["token_ids"])
    categories = sorted(outputs)
    print(
        f"prompts: {len(seen)}; tokens per category: "
        + ", ".join(f"{c} {sum(map(len, outputs[c]))}" for c in categories)
    )
    print("| map | N | " + " | ".join(categories) + " | all |")
    print("|---|---|" + "---|" * (len(categories) + 1))
    for spec in args.maps.split(","):
        full = load_token_map(spec)
        for n in (int(x) for x in args.sizes.split(",")):
            ids = set(full[:n].tolist())
            cells, hit, total = [], 0, 0
            for c in categories:
                tokens = [t for row in outputs[c] for t in row]
                h = sum(t in ids for t in tokens)
                cells.append(f"{h / len(tokens):.3f}")
                hit, total = hit + h, total + len(tokens)
            print(f"| {spec} | {n} | " + " | ".join(cells) + f" | {hit / total:.3f} |")


if __name__ == "__main__":
    main()
