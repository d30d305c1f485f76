"""One-token passes of our llama.cpp runner, exact and fast mode, against llama-cpp-python's, by
context length (issue 51: our plain decoding ran 2-3% slower per token than llama-cpp-python).

One process, the default target, 2 threads, flash attention on everywhere (as the bench's peer).
For each cached length, every side is filled to that length, then in each round every side runs
``--passes`` one-token passes (the order rotates per round) and the side's mean pass time is
recorded; sides: ``exact`` (our runner, exact mode: reference kernels on for one-token passes),
``exact-decode`` (the same runner's ``llama_decode`` called directly, no tensor in or out: what
our Python costs), ``fast`` (``exact=False``: llama.cpp's own kernels), ``peer``
(``llama_cpp.Llama.eval``). Every pass is cut back to the cached length.

    PYTHONPATH=src HF_HUB_OFFLINE=1 .venv/bin/python lab/scripts/one_token_pass_ab.py --lengths 150,450,800
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import llama_cpp
import torch

from specdecode.models.backends import gguf_path, load_llamacpp
from specdecode.models.llamacpp.model import LlamaCppOptions, decode_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="150,450,800", help="cached tokens before the passes")
    parser.add_argument("--passes", type=int, default=16, help="one-token passes per side per round")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    ids = [1000 + (i * 37) % 5000 for i in range(4096)]
    exact = load_llamacpp(None, "target", LlamaCppOptions(threads=2)).make_runner(n_ctx=2048)
    fast = load_llamacpp(None, "target", LlamaCppOptions(threads=2, exact=False)).make_runner(n_ctx=2048)
    peer = llama_cpp.Llama(str(gguf_path(None, "target")), n_ctx=2048, n_batch=512, n_threads=2, n_threads_batch=2,
                           flash_attn=True, verbose=False)  # fmt: skip

    def runner_side(runner: Any) -> tuple[Callable[[int], None], Callable[[int], None]]:
        def fill(length: int) -> None:
            runner.truncate(0)
            runner.forward(torch.tensor(ids[:length]))

        def step(position: int) -> None:
            runner.forward(torch.tensor([ids[position]]))
            runner.truncate(position)  # the next pass runs at the same length

        return fill, step

    def direct_side(runner: Any) -> tuple[Callable[[int], None], Callable[[int], None]]:
        fill, _ = runner_side(runner)

        def step(position: int) -> None:
            decode_batch(runner._lib, runner._ctx, runner._batch, [ids[position]], [position], [0], [True],
                         runner.reference_kernels, False)  # fmt: skip
            runner.length = position + 1
            runner.truncate(position)

        return fill, step

    def peer_fill(length: int) -> None:
        peer.reset()
        peer.eval(ids[:length])

    def peer_step(position: int) -> None:
        peer.eval([ids[position]])
        peer.n_tokens = position  # Llama.eval appends; cut back as the runner does
        peer._ctx.kv_cache_seq_rm(-1, position, -1)

    sides = {"exact": runner_side(exact), "exact-decode": direct_side(exact), "fast": runner_side(fast),
             "peer": (peer_fill, peer_step)}  # fmt: skip
    names = list(sides)
    for length in [int(x) for x in args.lengths.split(",")]:
        times: dict[str, list[float]] = {name: [] for name in names}
        for name in names:  # fill (once: every pass is cut back to this length) and warm up
            fill, step = sides[name]
            fill(length)
            step(length)
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                _, step = sides[name]
                tic = time.perf_counter()
                for _ in range(args.passes):
                    step(length)
                times[name].append((time.perf_counter() - tic) / args.passes * 1000)
        base = statistics.median(times["peer"])
        cells = [f"{name} {statistics.median(times[name]):.2f} ms ({statistics.median(times[name]) / base:.3f})"
                 for name in names]  # fmt: skip
        paired = {n: statistics.median(a / b for a, b in zip(times[n], times["peer"], strict=True)) for n in names}
        print(f"cached {length}: " + ", ".join(cells))
        print("  paired per round, x of peer: " + ", ".join(f"{n} {v:.3f}" for n, v in paired.items()), flush=True)


if __name__ == "__main__":
    main()
