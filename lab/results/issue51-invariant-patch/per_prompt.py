"""Per turn: tokens/s of each method (new tokens / wall time, prefill included) and whether its
tokens equal the target alone's; then all turns together. ``python per_prompt.py results.json``"""

from __future__ import annotations

import collections
import json
import sys

records = json.load(open(sys.argv[1]))["records"]
turns: dict[tuple, dict[str, dict]] = collections.defaultdict(dict)
methods: list[str] = []
for rec in records:
    turns[(rec["question_id"], rec["turn"])][rec["method"]] = rec
    if rec["method"] not in methods:
        methods.append(rec["method"])
tokens, seconds, same = collections.Counter(), collections.Counter(), collections.Counter()
print("turn", *methods, sep="\t")
for key, recs in turns.items():
    cells = []
    for m in methods:
        rec = recs[m]
        tokens[m] += rec["new_tokens"]
        seconds[m] += rec["wall_time_s"]
        same[m] += rec["token_ids"] == recs["target"]["token_ids"]
        mark = "" if rec["token_ids"] == recs["target"]["token_ids"] else "*"
        cells.append(f"{rec['new_tokens'] / rec['wall_time_s']:.1f}{mark}")
    print(f"{key[0]}/{key[1]}", *cells, sep="\t")
print("all", *[f"{tokens[m] / seconds[m]:.1f}" for m in methods], sep="\t")
print("same as target", *[f"{same[m]}/{len(turns)}" for m in methods], sep="\t")
print("(* : tokens differ from the target alone's)")
