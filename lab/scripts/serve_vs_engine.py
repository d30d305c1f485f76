"""The server's decoding against the engine's on the code edits with a prediction (a probe, not a test).

Three ways of decoding the same edits (the bench's ``code_edit`` prompts, the original file as the
prediction, greedy, at most 384 tokens) with the default target on llama.cpp, alternating turn by
turn so that the machine's drift hits each alike:

- ``engine``: :class:`specdecode.engine.SpeculativeGenerator` with prompt lookup (n-grams 3-8) and
  the prediction, k 16 (what ``specdecode bench``'s ``prediction`` method runs);
- ``scheduler``: the server's :class:`~specdecode.serve.scheduler.Scheduler` in this process
  (``--speculation adaptive``, 8 rows, 32,768 KV tokens), its thread started, one request at a time;
- ``http`` (``--http``): ``specdecode serve`` in a subprocess with the same settings, one request at a
  time through the ``openai`` client, whole responses.

Prints seconds per pass over the edits for each and whether the token ids agree (engine and
scheduler). Written for lab/notebook/2026-11-28-serve-gate.md::

    python lab/scripts/serve_vs_engine.py --edits 6 --rounds 2 --http
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--edits", type=int, default=6, help="the first N code edits")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--http", action="store_true", help="also through specdecode serve in a subprocess")
    p.add_argument("--port", type=int, default=38120)
    args = p.parse_args(argv)

    import httpx
    import openai

    from specdecode import SamplingParams, SpeculativeGenerator
    from specdecode.bench.prompts import load_prompts
    from specdecode.models.backends import load_llamacpp, load_llamacpp_tokenizer
    from specdecode.models.llamacpp.model import LlamaCppOptions
    from specdecode.proposers import make_proposer
    from specdecode.serve.config import ServeSettings
    from specdecode.serve.request import Event, ServeRequest
    from specdecode.serve.scheduler import Scheduler

    model = load_llamacpp(None, "target", LlamaCppOptions(threads=args.threads))
    tokenizer = load_llamacpp_tokenizer(model)
    edits = load_prompts(None, "code_edit", per_category=None)[: args.edits]
    options = {"min_ngram": 3, "max_ngram": 8}
    engine = SpeculativeGenerator(
        model, tokenizer=tokenizer, proposer=make_proposer("prompt_lookup", target=model, **options)
    )
    settings = ServeSettings(
        proposer="prompt_lookup",
        proposer_options=options,
        speculation="adaptive",
        max_batch_size=8,
        kv_budget_tokens=32768,
    )
    scheduler = Scheduler(model, tokenizer, settings)
    scheduler.start(thread=True)
    sampling = SamplingParams(max_new_tokens=384)

    def prompt_ids(edit: Any) -> list[int]:
        messages = [{"role": "user", "content": edit.turns[0]}]
        return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    def by_engine(edit: Any) -> list[int]:
        return engine.generate(
            prompt_ids(edit), sampling, num_speculative_tokens=16, prediction=edit.prediction
        ).token_ids

    def by_scheduler(edit: Any) -> list[int]:
        events: list[Event] = []
        done = threading.Event()

        def on_event(event: Event) -> None:
            events.append(event)
            if event.finish_reason is not None:
                done.set()

        prediction = tokenizer.encode(edit.prediction, add_special_tokens=False)
        request = ServeRequest(
            request_id=f"probe-{time.monotonic_ns()}", prompt_ids=prompt_ids(edit), sampling=sampling,
            speculative=True, proposer="prompt_lookup", num_speculative_tokens=16, on_event=on_event,
            prediction=prediction,
        )  # fmt: skip
        scheduler.submit(request)
        done.wait()
        return [t for e in events for t in e.token_ids]

    ways = {"engine": by_engine, "scheduler": by_scheduler}
    server = None
    if args.http:
        command = [sys.executable, "-m", "specdecode.commands.main", "serve", "--port", str(args.port)]
        command += ["--backend", "llamacpp", "--threads", str(args.threads), "--served-model-name", "probe"]
        command += ["--max-batch-size", "8", "--kv-budget-tokens", "32768"]
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{args.port}"
        for _ in range(1800):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=3600)

        def by_http(edit: Any) -> list[int]:
            client.chat.completions.create(
                model="probe", messages=[{"role": "user", "content": edit.turns[0]}], max_tokens=384, temperature=0,
                extra_body={"prediction": {"type": "content", "content": edit.prediction}},
            )  # fmt: skip
            return []

        ways["http"] = by_http
    try:
        seconds = dict.fromkeys(ways, 0.0)
        names = list(ways)
        for r in range(args.rounds):
            for i, edit in enumerate(edits):
                turn = r * len(edits) + i
                ids = {}
                for name in names[turn % len(names) :] + names[: turn % len(names)]:
                    tic = time.perf_counter()
                    ids[name] = ways[name](edit)
                    seconds[name] += time.perf_counter() - tic
                same = "same" if ids["engine"] == ids["scheduler"] else "DIFFER"
                print(
                    edit.question_id,
                    r,
                    "seconds so far",
                    {k: round(v, 2) for k, v in seconds.items()},
                    same,
                    flush=True,
                )
        print("seconds per pass over the edits:", {k: round(v / args.rounds, 2) for k, v in seconds.items()})
    finally:
        scheduler.stop()
        if server is not None:
            server.terminate()
            server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
