"""How often does the target with some decoder layers skipped agree with the full target?

A feasibility probe for layer-skipping self-speculation (Draft & Verify, Zhang et al. 2023, arXiv
2309.08168; SWIFT, Xia et al. 2024, arXiv 2410.06916): the draft is the target itself with a set of
middle layers skipped. The target first decodes ``--new-tokens`` greedily from each calibration
prompt; then, teacher-forced over those sequences, the top-1 token of the skipping model is compared
with the full model's at the generated positions (the acceptance of draft position 1 in a greedy
chain). Layers are ranked by the agreement lost when each alone is skipped, then skipped cumulatively
in that order, re-ranking greedily when ``--greedy`` is given.

Usage: python lab/scripts/layer_skip_agreement.py [--prompts 3] [--new-tokens 48] [--max-skip 14] [--greedy]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from specdecode.calibrate import load_prompts
from specdecode.models.torch.hf_loading import load_model, load_tokenizer, resolve_model_dir


@torch.inference_mode()
def agreement(
    model: nn.Module, layers: nn.ModuleList, keep: list[int], batch: list[tuple[torch.Tensor, int, torch.Tensor]]
) -> float:
    """Fraction of generated positions where the model with only ``keep`` layers picks the full model's token."""
    model.model.layers = nn.ModuleList([layers[i] for i in keep])
    hits = total = 0
    try:
        for ids, start, reference in batch:
            logits = model(input_ids=ids.view(1, -1), use_cache=False).logits[0, start - 1 : -1]
            hits += int((logits.argmax(-1) == reference).sum())
            total += reference.numel()
    finally:
        model.model.layers = layers
    return hits / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--max-skip", type=int, default=14)
    parser.add_argument("--greedy", action="store_true", help="re-rank the remaining layers after each skip")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = load_model(None, "target", args.dtype)
    tokenizer = load_tokenizer(resolve_model_dir(None, "target"))
    layers = model.model.layers
    n = len(layers)
    batch = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for prompt in load_prompts()[: args.prompts]:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
            )
            ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
            out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)[0]
            start = ids.shape[1]
            full = model(input_ids=out.view(1, -1), use_cache=False).logits[0, start - 1 : -1].argmax(-1)
            batch.append((out, start, full))
    print(f"{len(batch)} sequences decoded in {time.perf_counter() - t0:.0f} s")
    assert abs(agreement(model, layers, list(range(n)), batch) - 1.0) < 1e-9

    singles = {}
    for i in range(1, n):  # layer 0 always kept
        singles[i] = agreement(model, layers, [j for j in range(n) if j != i], batch)
        print(f"skip {{{i}}}: {singles[i]:.3f}", flush=True)
    order = sorted(singles, key=lambda i: -singles[i])
    skipped: list[int] = []
    curve = []
    for step in range(args.max_skip):
        if args.greedy and step > 0:
            remaining = [i for i in range(1, n) if i not in skipped]
            scores = {
                i: agreement(model, layers, [j for j in range(n) if j not in skipped and j != i], batch)
                for i in remaining
            }
            best = max(scores, key=lambda i: scores[i])
        else:
            best = order[step]
        skipped.append(best)
        value = agreement(model, layers, [j for j in range(n) if j not in skipped], batch)
        curve.append({"skipped": sorted(skipped), "agreement": value})
        print(f"skip {len(skipped):2d} layers {sorted(skipped)}: agreement {value:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"singles": singles, "curve": curve, "positions": sum(r.numel() for _, _, r in batch)}, f, indent=1
            )


if __name__ == "__main__":
    main()
