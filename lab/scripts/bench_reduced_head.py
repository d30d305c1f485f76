"""What does a reduced draft LM head (a token map, FR-Spec) save per drafted token on this machine?

For the default draft model: (1) the head alone, ``F.linear`` of one row against the first N rows
of the map (and the full head); (2) a whole one-token draft step (the runner of a
``DraftModelProposer`` built as ``draft_model`` builds it, so with ``--draft-quantization auto`` a
float32 or bfloat16 draft on the CPU drafts int8, its reduced head int8 too) with the full head and with
N-token heads, the arms alternating ``--rounds`` times so that drift of the machine hits all
alike. Prints medians in milliseconds.

Usage: python lab/scripts/bench_reduced_head.py [--sizes 32768,65536] [--rounds 8] [--steps 16] [--reps 50]
       [--dtype auto] [--draft-quantization auto]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_linear_rows import time_linear  # this script's folder is on sys.path

from specdecode.commands.common import add_dtype_arg
from specdecode.models.torch.hf_loading import load_model
from specdecode.models.torch.quant import DRAFT_QUANTIZATIONS
from specdecode.models.torch.runner import ModelRunner
from specdecode.proposers.draft_model import DraftModelConfig, DraftModelProposer
from specdecode.token_map import load_token_map


def step_time(runner: ModelRunner, prompt: torch.Tensor, steps: int) -> float:
    """Median seconds of a one-token forward after ``prompt``, over ``steps`` steps."""
    runner.reset()
    samples = []
    with torch.inference_mode():
        logits = runner.forward(prompt, num_logits=1)
        for _ in range(steps):
            token = logits[-1].argmax().view(1)
            tic = time.perf_counter()
            logits = runner.forward(token, num_logits=1)
            samples.append(time.perf_counter() - tic)
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="32768,65536", help="N of the reduced heads (first N ids of the map)")
    p.add_argument("--token-map", default="default")
    add_dtype_arg(p)
    p.add_argument("--draft-quantization", default="auto", choices=DRAFT_QUANTIZATIONS)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    torch.manual_seed(0)
    model = load_model(None, "draft", args.dtype)
    full_map = load_token_map(args.token_map)
    sizes = [int(n) for n in args.sizes.split(",")]
    weight = model.get_output_embeddings().weight
    print(f"threads {torch.get_num_threads()}, draft head {tuple(weight.shape)} {weight.dtype}")
    for n in [weight.shape[0], *sizes]:
        w = weight if n == weight.shape[0] else weight[full_map[:n]].contiguous()
        print(f"head {n:>6} rows: {1000 * time_linear(w, 1, args.reps):.2f} ms")
    configs = {"full": DraftModelConfig(draft_quantization=args.draft_quantization)}
    for n in sizes:
        configs[str(n)] = DraftModelConfig(
            token_map=args.token_map, draft_vocab_size=n, draft_quantization=args.draft_quantization
        )
    proposers = {name: DraftModelProposer(model, config) for name, config in configs.items()}
    head = proposers[str(sizes[0])].runner.head_module if sizes else None
    print(f"draft quantization: {proposers['full'].quantization}; reduced head {type(head).__name__}")
    prompt = torch.randint(0, 1000, (32,))
    times: dict[str, list[float]] = {name: [] for name in proposers}
    for _ in range(args.rounds):
        for name, proposer in proposers.items():
            times[name].append(step_time(proposer.runner, prompt, args.steps))
    base = statistics.median(times["full"])
    for name, samples in times.items():
        med = statistics.median(samples)
        print(f"draft step, head {name:>6}: {1000 * med:.1f} ms ({med / base:.3f} of the full head)")


if __name__ == "__main__":
    main()
