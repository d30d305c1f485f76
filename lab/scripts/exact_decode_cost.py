"""What exact mode costs in plain decoding on llama.cpp, by context length (issue 51).

Greedy plain decoding (``speculative=False``, every prefill run) of the default target on llama.cpp
in exact mode and in fast mode (``exact=False``), and llama-cpp-python's own ``Llama.generate`` on the
same GGUF file, one process, alternating, after a warm-up: prefill seconds and decode tokens/s
(after the first token) for a prompt of about ``--functions`` x 22 tokens. Prints one line per run.

    PYTHONPATH=src HF_HUB_OFFLINE=1 .venv/bin/python lab/scripts/exact_decode_cost.py --functions 40
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--functions", type=int, default=40, help="functions in the prompt (~22 tokens each)")
    parser.add_argument("--tokens", type=int, default=96, help="new tokens per run")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    import llama_cpp

    from specdecode import SamplingParams, SpeculativeGenerator
    from specdecode.models.backends import load_llamacpp_tokenizer

    from conftest import load_default_gguf

    exact, fast = load_default_gguf("target"), load_default_gguf("target", exact=False)
    tokenizer = load_llamacpp_tokenizer(exact)
    code = "".join(f"def f{i}(x: int) -> int:\n    return x * {i} + {i % 7}\n\n" for i in range(args.functions))
    llm = llama_cpp.Llama(model_path=str(exact.path), n_ctx=4096, n_threads=2, n_batch=512, verbose=False)
    prompt: list[int] = []
    for _ in range(args.repeats):
        for name, model in [("exact", exact), ("fast", fast)]:
            gen = SpeculativeGenerator(model, tokenizer=tokenizer)
            gen.reuse_prompt = False
            prompt = gen.encode_prompt("Explain what this code does, function by function:\n" + code).tolist()
            gen.generate(prompt, SamplingParams(max_new_tokens=4), speculative=False)
            r = gen.generate(prompt, SamplingParams(max_new_tokens=args.tokens), speculative=False)
            decode = (r.stats.new_tokens - 1) / (r.stats.wall_time_s - r.stats.prefill_time_s)
            print(f"{name:16s} prompt {len(prompt)}  prefill {r.stats.prefill_time_s:.2f} s  decode {decode:.2f} tok/s")
        llm.reset()
        tic, first, n = time.perf_counter(), 0.0, 0
        for _token in llm.generate(prompt, temp=0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            n += 1
            if n == 1:
                first = time.perf_counter()
            if n >= args.tokens:
                break
        decode = (n - 1) / (time.perf_counter() - first)
        print(f"llama-cpp-python prompt {len(prompt)}  prefill {first - tic:.2f} s  decode {decode:.2f} tok/s")


if __name__ == "__main__":
    main()
