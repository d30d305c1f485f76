"""Measure how often the draft's candidate of each rank is the target's greedy token.

Used to derive the static tree shapes in :mod:`specdecode.tree` (``greedy_paths``): the target
decodes each calibration prompt greedily; the draft is then run teacher-forced over the same
sequence and, at every generated position, we record the rank of the target's token in the
draft's distribution. Prints the fraction at ranks 0..3 (and beyond).

    python lab/scripts/rank_acceptance.py --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
from importlib.resources import files

import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.models.torch.hf_loading import load_model, resolve_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args()
    target_gen = SpeculativeGenerator.from_pretrained(proposer=None)
    draft = load_model(resolve_model_dir(None, "draft"), "draft", "bfloat16")
    lines = files("specdecode.data").joinpath("calibration_prompts.jsonl").read_text().splitlines()
    counts = torch.zeros(5)
    for line in lines[: args.prompts]:
        prompt_ids = target_gen.encode_prompt(json.loads(line)["prompt"])
        out = target_gen.generate(prompt_ids.tolist(), SamplingParams(max_new_tokens=args.max_new_tokens))
        seq = torch.cat([prompt_ids, torch.tensor(out.token_ids)])
        with torch.inference_mode():
            logits = draft(input_ids=seq.view(1, -1)).logits[0].float()  # (T, V)
        T0 = prompt_ids.shape[0]
        for i in range(T0, seq.shape[0]):
            rank = int((logits[i - 1] > logits[i - 1, seq[i]]).sum())
            counts[min(rank, 4)] += 1
        fractions = [round(x, 3) for x in (counts / counts.sum()).tolist()]
        print(f"{len(out.token_ids)} tokens; running rank fractions {fractions}")
    print("rank 0, 1, 2, 3, >=4:", [round(x, 3) for x in (counts / counts.sum()).tolist()])


if __name__ == "__main__":
    main()
