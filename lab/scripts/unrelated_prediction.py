"""Time the default generator with a prediction unrelated to the answer against none, side by side.

Issue 51's "a prediction unrelated to the answer: no slower than without one beyond noise". Each
first turn of a ``specdecode bench`` run's questions is decoded greedily twice on the same
generator (the order alternating per turn): without a prediction, and with another turn's recorded
answer as the prediction. Prints tokens/s per turn and overall, and whether the outputs are the
same; ``--out`` keeps the records.

Usage::

    python lab/scripts/unrelated_prediction.py lab/results/issue51-rows-attention/heldout-2fc0c17/results.json \
        --threads 2 --out /tmp/unrelated.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.bench.prompts import encode_chat, load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", help="a bench run's results.json with `target` token ids")
    parser.add_argument("--questions", help="its questions file (default: the run's own)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out")
    args = parser.parse_args()
    data = json.loads(Path(args.results).read_text())
    settings = data.get("settings", {})
    answers = {
        (str(r["question_id"]), r["turn"]): r["token_ids"]
        for r in data["records"]
        if r["method"] == "target" and r.get("repeat", 0) == 0
    }
    keys = sorted(answers)
    prompts = load_prompts(
        args.questions or settings.get("questions"), settings.get("categories"), settings.get("prompts_per_category")
    )
    gen = SpeculativeGenerator.from_pretrained(backend="llamacpp", threads=args.threads)
    gen.reuse_prompt = False  # both runs of a turn prefill: the second must not skip it
    tokenizer = gen.tokenizer
    sampling = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    gen.generate("Warm up.", sampling=SamplingParams(max_new_tokens=8))
    records, totals = [], {"none": [0, 0.0], "unrelated": [0, 0.0]}
    for i, prompt in enumerate(prompts):
        key = (str(prompt.question_id), 0)
        if key not in answers:
            continue
        other = keys[(keys.index(key) + 7) % len(keys)]
        prediction = tokenizer.decode(answers[other], skip_special_tokens=True)
        ids = encode_chat(tokenizer, [{"role": "user", "content": prompt.turns[0]}])
        runs = {}
        for kind in ("none", "unrelated") if i % 2 == 0 else ("unrelated", "none"):
            start = time.perf_counter()
            result = gen.generate(ids, sampling=sampling, prediction=prediction if kind == "unrelated" else None)
            seconds = time.perf_counter() - start
            runs[kind] = (result.token_ids, seconds)
            totals[kind][0] += len(result.token_ids)
            totals[kind][1] += seconds
        same = runs["none"][0] == runs["unrelated"][0]
        rate = {k: len(t) / s for k, (t, s) in runs.items()}
        records.append({"turn": f"{key[0]}/0", "group": prompt.group, "tokens_per_s": rate, "same": same})
        print(
            f"{key[0]:>14}/0 {prompt.group:15s} none {rate['none']:6.1f}  unrelated {rate['unrelated']:6.1f}"
            f"  {rate['unrelated'] / rate['none']:.3f}  same {same}",
            flush=True,
        )
    overall = {k: n / s for k, (n, s) in totals.items()}
    print(
        f"all: none {overall['none']:.1f} tok/s, unrelated {overall['unrelated']:.1f} tok/s, "
        f"{overall['unrelated'] / overall['none']:.3f}; same {sum(r['same'] for r in records)}/{len(records)}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps({"records": records, "overall": overall}, indent=1))


if __name__ == "__main__":
    main()
