"""Structured output under speculation (issue 33): speedup of each proposer with a JSON-schema
constraint against constrained target-only decoding, share of valid outputs, and the target passes
grammar-aware drafting saves.

For each prompt of ``specdecode/data/structured/prompts.jsonl`` (extraction and tool calls, each
with its schema), greedy, on the default pair (the llama.cpp backend on a CPU):

- ``target-only``: constrained decoding by the target alone (the reference);
- per proposer, ``aware``: grammar-aware drafting (drafts cut at a forbidden token, forced tokens
  drafted for free) and ``masks-only``: the proposer's drafts sent as they are, only the masks apply.

Every output must be identical to the target-only one (greedy, exact) and parse and validate against
its schema. Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python lab/scripts/bench_structured.py [--proposers prompt_lookup,draft_model]
        [--max-new-tokens 160] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from importlib import resources

import jsonschema

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.constraints import JsonSchema


def load_prompts() -> list[dict]:
    text = resources.files("specdecode.data").joinpath("structured/prompts.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags")), [])
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{model}; flags: {' '.join(wanted) or 'none of avx2/avx512/amx'}"


def run_mode(gen: SpeculativeGenerator, prompts: list[dict], sampling: SamplingParams, speculative: bool) -> dict:
    rows = []
    for item in prompts:
        try:
            result = gen.generate(
                item["prompt"], sampling, speculative=speculative, constraint=JsonSchema(item["schema"])
            )
        except ValueError as error:  # reported as an invalid, non-identical output
            print(f"{item['id']}: {str(error)[:300]}", file=sys.stderr)
            rows.append(
                {
                    "id": item["id"],
                    "token_ids": None,
                    "text": "",
                    "valid": False,
                    "error": str(error)[:300],
                    **dict.fromkeys(
                        (
                            "wall_time_s",
                            "new_tokens",
                            "target_forward_passes",
                            "draft_tokens",
                            "accepted_tokens",
                            "forced_draft_tokens",
                            "forced_accepted_tokens",
                            "cut_draft_tokens",
                        ),
                        0,
                    ),
                }
            )
            continue
        s = result.stats
        rows.append(
            {
                "id": item["id"],
                "token_ids": result.token_ids,
                "text": result.text,
                "valid": valid(result.text, item["schema"]),
                "wall_time_s": s.wall_time_s,
                "new_tokens": s.new_tokens,
                "target_forward_passes": s.target_forward_passes,
                "draft_tokens": s.draft_tokens,
                "accepted_tokens": s.accepted_tokens,
                "forced_draft_tokens": s.forced_draft_tokens,
                "forced_accepted_tokens": s.forced_accepted_tokens,
                "cut_draft_tokens": s.cut_draft_tokens,
            }
        )
    keys = ("wall_time_s", "new_tokens", "target_forward_passes", "draft_tokens", "accepted_tokens")
    keys += ("forced_draft_tokens", "forced_accepted_tokens", "cut_draft_tokens")
    total = {k: sum(r[k] for r in rows) for k in keys}
    total["valid"] = sum(r["valid"] for r in rows)
    return {"rows": rows, "total": total}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proposers", default="prompt_lookup,draft_model")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--json", default=None, metavar="OUT", help="write every row here")
    args = parser.parse_args()
    prompts = load_prompts()
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens)
    report: dict = {"machine": machine(), "command": " ".join(sys.argv), "modes": {}}
    warm = {"prompt": "Say {}", "schema": {"type": "object"}, "id": "warmup"}
    for name in args.proposers.split(","):
        gen = SpeculativeGenerator.from_pretrained(proposer=name)
        run_mode(gen, [warm], SamplingParams(max_new_tokens=8), True)  # warm-up (and llguidance's tokenizer)
        if "target-only" not in report["modes"]:
            report["backend"] = gen.backend
            report["modes"]["target-only"] = run_mode(gen, prompts, sampling, speculative=False)
        for aware in (True, False):
            gen.grammar_aware_drafting = aware
            report["modes"][f"{name} {'aware' if aware else 'masks-only'}"] = run_mode(gen, prompts, sampling, True)
        del gen
    base = report["modes"]["target-only"]
    print(f"machine: {report['machine']}  backend: {report['backend']}  prompts: {len(prompts)}")
    print(f"command: {report['command']}\n")
    print("| mode | speedup | valid | identical | tokens | target passes | forced drafted/accepted | cut |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, res in report["modes"].items():
        t, b = res["total"], base["total"]
        same = sum(r["token_ids"] == q["token_ids"] for r, q in zip(res["rows"], base["rows"], strict=True))
        res["speedup"] = b["wall_time_s"] / t["wall_time_s"]
        res["identical"] = same
        print(
            f"| {mode} | {res['speedup']:.2f}x | {t['valid']}/{len(prompts)} | {same}/{len(prompts)} | "
            f"{t['new_tokens']} | {t['target_forward_passes']} | {t['forced_draft_tokens']}/"
            f"{t['forced_accepted_tokens']} | {t['cut_draft_tokens']} |"
        )
    for name in args.proposers.split(","):
        on, off = report["modes"][f"{name} aware"]["total"], report["modes"][f"{name} masks-only"]["total"]
        saved = off["target_forward_passes"] - on["target_forward_passes"]
        print(
            f"\n{name}: grammar-aware drafting saved {saved} of {off['target_forward_passes']} target passes "
            f"({saved / off['target_forward_passes']:.0%}); "
            f"wall time {off['wall_time_s']:.1f}s -> {on['wall_time_s']:.1f}s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    bad = [
        m for m, r in report["modes"].items() if r["total"]["valid"] != len(prompts) or r["identical"] != len(prompts)
    ]
    if bad:
        print(f"\nFAILED: invalid or non-identical outputs in {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
