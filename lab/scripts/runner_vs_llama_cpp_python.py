"""Our llama.cpp runner's passes against llama-cpp-python's on the same GGUF and build: the prefill
of 40 and 200 tokens (median of 3) and one-token passes after 100 cached (mean of 50, twice).
``HF_HUB_OFFLINE=1 .venv/bin/python lab/scripts/runner_vs_llama_cpp_python.py`` (the default target,
exact mode, 2 threads)."""

from __future__ import annotations

import statistics
import time

import llama_cpp
import torch

from specdecode.models.backends import gguf_path, load_llamacpp
from specdecode.models.llamacpp.model import LlamaCppOptions

IDS = list(range(1000, 1200))


def main() -> None:
    path = str(gguf_path(None, "target"))
    runner = load_llamacpp(None, "target", LlamaCppOptions(threads=2)).make_runner(n_ctx=1024)
    peer = llama_cpp.Llama(path, n_threads=2, n_threads_batch=2, n_ctx=1024, n_batch=512, verbose=False)

    def prefill_ours(n: int) -> float:
        runner.truncate(0)
        tic = time.perf_counter()
        runner.forward(torch.tensor(IDS[:n]))
        return time.perf_counter() - tic

    def prefill_peer(n: int) -> float:
        peer.reset()
        tic = time.perf_counter()
        peer.eval(IDS[:n])
        return time.perf_counter() - tic

    def decode_ours(n: int) -> float:
        runner.truncate(0)
        runner.forward(torch.tensor(IDS[:100]))
        tic = time.perf_counter()
        for i in range(n):
            runner.forward(torch.tensor([IDS[100 + i]]))
        return (time.perf_counter() - tic) / n

    def decode_peer(n: int) -> float:
        peer.reset()
        peer.eval(IDS[:100])
        tic = time.perf_counter()
        for i in range(n):
            peer.eval([IDS[100 + i]])
        return (time.perf_counter() - tic) / n

    for n in (40, 200):
        prefill_ours(n), prefill_peer(n)  # warm-up
        ours = statistics.median(prefill_ours(n) for _ in range(3))
        theirs = statistics.median(prefill_peer(n) for _ in range(3))
        print(f"prefill {n} tokens, s: ours {ours:.3f} llama-cpp-python {theirs:.3f}")
    for _ in range(2):
        print(f"decode ms/token: ours {1000 * decode_ours(50):.2f} llama-cpp-python {1000 * decode_peer(50):.2f}")


if __name__ == "__main__":
    main()
