"""Tokens/s per method of one ``specdecode bench`` results file, against ``llamacpp`` and ``target``.

Usage: ``python summarize.py code_edit/results.json``
"""

import json
import sys
from pathlib import Path

if __name__ == "__main__":
    results = json.loads(Path(sys.argv[1]).read_text())
    totals: dict[str, list[float]] = {}
    by_turn: dict[tuple, dict[str, dict]] = {}
    for record in results["records"]:
        total = totals.setdefault(record["method"], [0.0, 0.0, 0.0, 0.0])
        stats = record["stats"] or {}
        total[0] += record["new_tokens"]
        total[1] += record["wall_time_s"]
        total[2] += stats.get("draft_tokens") or 0
        total[3] += stats.get("gated_draft_tokens") or 0
        by_turn.setdefault((record["question_id"], record["turn"]), {})[record["method"]] = record
    plain = totals["llamacpp"][0] / totals["llamacpp"][1]
    alone = totals["target"][0] / totals["target"][1]
    for method, (tokens, seconds, drafted, gated) in totals.items():
        rate = tokens / seconds
        print(
            f"{method:45s} {rate:6.2f} tok/s  vs llamacpp {rate / plain:.3f}  vs target {rate / alone:.3f}"
            f"  drafted {drafted:.0f} gated {gated:.0f}"
        )
    ours = sum(
        all(r["token_ids"] == turn["target"]["token_ids"] for m, r in turn.items() if m != "llamacpp")
        for turn in by_turn.values()
    )
    peer = sum(turn["llamacpp"]["token_ids"] == turn["target"]["token_ids"] for turn in by_turn.values())
    print(f"speculative identical to target: {ours}/{len(by_turn)}; llamacpp same text: {peer}/{len(by_turn)}")
