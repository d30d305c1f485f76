"""What a request with a draft model pays before its first token in the server (a probe, not a test).

The server's :class:`~specdecode.serve.scheduler.Scheduler` in this process, on llama.cpp with the
default target and its 0.5B draft (``--speculation on``: every step drafts), one request at a time:
Spec-Bench prompts (the packaged dev half, ``--category``), greedy, ``--tokens`` new tokens. Prints
per request its time to first token (the scheduler's ``ttft_s``: admission, the proposer, the
prefill) and end to end, and the median of each over the requests after the first (the first also
pays the first context's warm-up). From 2026-12-02 the scheduler keeps proposers between requests
(:mod:`specdecode.serve.proposer_pool`); run it from worktrees of a commit before and after to see
what that saves::

    python lab/scripts/serve_proposer_pool.py --requests 8 --tokens 32
"""

from __future__ import annotations

import argparse
import statistics
import threading


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--category", default="qa")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    from specdecode import SamplingParams
    from specdecode.bench.prompts import load_prompts
    from specdecode.models.backends import load_llamacpp, load_llamacpp_tokenizer
    from specdecode.models.llamacpp.model import LlamaCppOptions
    from specdecode.serve.config import ServeSettings
    from specdecode.serve.request import Event, ServeRequest
    from specdecode.serve.scheduler import Scheduler

    options = LlamaCppOptions(threads=args.threads)
    target, draft = load_llamacpp(None, "target", options), load_llamacpp(None, "draft", options)
    tokenizer = load_llamacpp_tokenizer(target)
    settings = ServeSettings(proposer="draft_model", speculation="on", max_batch_size=4, kv_budget_tokens=16384)
    scheduler = Scheduler(target, tokenizer, settings, draft=draft)
    scheduler.start(thread=True)
    prompts = load_prompts(None, args.category, per_category=None)
    sampling = SamplingParams(max_new_tokens=args.tokens)
    rows = []
    for i in range(args.requests):
        turn = prompts[i % len(prompts)].turns[0]
        messages = [{"role": "user", "content": turn}]
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        events: list[Event] = []
        done = threading.Event()

        def on_event(event: Event, events: list[Event] = events, done: threading.Event = done) -> None:
            events.append(event)
            if event.finish_reason is not None:
                done.set()

        request = ServeRequest(
            request_id=f"pool-{i}", prompt_ids=ids, sampling=sampling, speculative=True,
            proposer="draft_model", num_speculative_tokens=4, on_event=on_event,
        )  # fmt: skip
        scheduler.submit(request)
        done.wait()
        timings = events[-1].summary["timings"]
        rows.append((timings["ttft_s"], timings["e2e_s"]))
        print(f"request {i}: prompt {len(ids)} tokens, ttft {timings['ttft_s']:.3f} s, e2e {timings['e2e_s']:.3f} s")
    scheduler.stop()
    pool = getattr(scheduler, "proposer_pool", None)
    later = rows[1:]
    print(
        f"median after the first: ttft {statistics.median(r[0] for r in later):.3f} s, "
        f"e2e {statistics.median(r[1] for r in later):.3f} s; "
        + (f"proposers built {pool.built}, reused {pool.reused}" if pool else "no proposer pool (built per request)")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
