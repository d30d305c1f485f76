"""Compare the token ids of the bench records before and after the issue-32 refactor, per part."""

import json
import sys
from pathlib import Path


def load(path: str) -> dict[tuple, list[int]]:
    """Token ids per (question, turn, repeat, method) of one bench results file."""
    records = json.loads(Path(path).read_text())["records"]
    return {(x["question_id"], x["turn"], x["repeat"], x["method"]): x["token_ids"] for x in records}


if __name__ == "__main__":
    for part in sys.argv[1:]:
        a, b = load(f"before-{part}/results.json"), load(f"after-{part}/results.json")
        same = sum(a[k] == b.get(k) for k in a)
        print(
            part,
            f"{same}/{len(a)} identical",
            "keys equal" if a.keys() == b.keys() else "KEYS DIFFER",
            [k for k in a if a[k] != b.get(k)],
        )
