"""Per category of a bench report: tokens/s of the target alone, the default and llama-cpp-python's
plain generation, and the ratios. ``python per_category.py report.md [default method]``"""

from __future__ import annotations

import sys

default = sys.argv[2] if len(sys.argv) > 2 else "prompt_lookup(min_ngram=3,max_ngram=8)"
tps: dict[tuple[str, str], float] = {}
for line in open(sys.argv[1]):
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) > 8 and cells[2].isdigit():
        tps[(cells[0], cells[1])] = float(cells[7])
for cat in dict.fromkeys(k[0] for k in tps):
    t, d, ll = tps[(cat, "target")], tps[(cat, default)], tps[(cat, "llamacpp")]
    print(f"{cat:15s} target {t:5.1f}  default {d:5.1f}  llama {ll:5.1f}  "
          f"default/target {d / t:.2f}  default/llama {d / ll:.2f}  target/llama {t / ll:.2f}")
