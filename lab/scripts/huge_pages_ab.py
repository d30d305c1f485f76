"""One-token passes of our runner with the weights in huge pages, without, and llama-cpp-python's
(issue 51: our plain decoding against llama-cpp-python's; specdecode.models.llamacpp.huge_pages).

One process, the default target, 2 threads, flash attention on everywhere, ``--length`` cached
tokens. Sides: ``huge`` (``LlamaCppOptions(huge_pages=True)``, the default), ``4k``
(``huge_pages=False``), ``peer`` (``llama_cpp.Llama.eval``); each round every side runs
``--passes`` one-token passes cut back to the same length, the order rotating per round. The
load order is given (``--order``): a memory-bound pass moves by 1-2% with where its weights land,
so the first-loaded model tends to be the slower one; swap the order to see the page size's effect
apart from it.

    PYTHONPATH=src HF_HUB_OFFLINE=1 .venv/bin/python lab/scripts/huge_pages_ab.py --order huge,4k,peer
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import llama_cpp
import torch

from specdecode.models.backends import gguf_path
from specdecode.models.llamacpp.model import LlamaCppModel, LlamaCppOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--order", default="huge,4k,peer", help="the sides, in the order they load")
    parser.add_argument("--length", type=int, default=120, help="cached tokens before each pass")
    parser.add_argument("--passes", type=int, default=16, help="one-token passes per side per round")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    ids = [1000 + (i * 37) % 5000 for i in range(4096)]
    path = gguf_path(None, "target")
    steps: dict[str, Callable[[], Callable[[int], None]]] = {}
    for name in args.order.split(","):
        if name == "peer":
            peer = llama_cpp.Llama(str(path), n_ctx=2048, n_batch=512, n_threads=2, n_threads_batch=2,
                                   flash_attn=True, verbose=False)  # fmt: skip

            def peer_side(peer: Any = peer) -> Callable[[int], None]:
                peer.reset()
                peer.eval(ids[: args.length])

                def step(position: int) -> None:
                    peer.eval([ids[position]])
                    peer.n_tokens = position

                return step

            steps[name] = peer_side
            continue
        model = LlamaCppModel(path, LlamaCppOptions(threads=2, huge_pages=name == "huge"))
        print(f"{name}: {model.huge_page_bytes >> 20} MiB in huge pages")
        runner = model.make_runner(n_ctx=2048)

        def runner_side(runner: Any = runner) -> Callable[[int], None]:
            runner.truncate(0)
            runner.forward(torch.tensor(ids[: args.length]))

            def step(position: int) -> None:
                runner.forward(torch.tensor([ids[position]]))
                runner.truncate(position)

            return step

        steps[name] = runner_side
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            step = steps[name]()
            tic = time.perf_counter()
            for _ in range(args.passes):
                step(args.length)
            times[name].append((time.perf_counter() - tic) / args.passes * 1000)
    base = names[-1]
    for name in names:
        paired = statistics.median(a / b for a, b in zip(times[name], times[base], strict=True))
        print(f"{name}: {statistics.median(times[name]):.2f} ms, paired x of {base}: {paired:.3f}")


if __name__ == "__main__":
    main()
