#!/usr/bin/env python
"""Load benchmark of ``specdecode serve`` with the official ``openai`` client (a script, not a test).

All modes run in one server process (``--server shared``, the default): a server started with
``--speculation adaptive`` (``on`` if adaptive is not among the modes), every request sent with
its mode as the per-request ``speculation`` extension (``"on"``: draft k every step; ``"off"``:
the target alone, exactly what an ``--speculation off`` server runs; ``"adaptive"``: the cost
model decides). Two server processes of the same code and settings differ by about 10% in speed
on this machine (cause not found; measured with two ``off`` servers side by side,
``lab/scripts/serve_side_by_side.py``), more than the 5% that separates a good schedule from a bad
one, so modes are compared within one process; ``--server separate`` starts one server per mode.
Every concurrency level (1, 2, 4, 8) is split into ``--rounds`` rounds (fewer where a round would
get fewer requests than the concurrency); in each round every mode
(in an order that rotates from round to round and level to level, so that the machine's slow
drift hits every mode alike) sends the round's share of the prompts (Spec-Bench dev questions,
first turn, as chats; every mode gets the same ones) from that many client threads: greedy,
``max_tokens`` tokens each with ``ignore_eos`` (every request produces exactly that many tokens,
as vLLM's serving benchmark does). Per (mode, concurrency), pooled over the rounds:

- throughput: output tokens / wall time of the level, and requests / s;
- latency percentiles (p50, p90, p99) of time to first token (first streamed token),
  time per output token ((end - first token) / (tokens - 1)) and end-to-end time;
- speculation counters from ``/metrics`` (vLLM's definitions): drafts, draft tokens, accepted
  tokens, acceptance rate, mean acceptance length;
- every request's token ids, compared across modes (greedy: they must be identical; bf16
  batching may flip near-ties, which is reported, not hidden).

With ``--engine-baseline`` it also decodes the prompts one at a time in this process with
:class:`specdecode.engine.SpeculativeGenerator` (speculation on and off), giving the
single-request speedup the server's concurrency-1 speedup is compared with.

Backends: ``--backend`` (``auto``: llama.cpp for the default pair on a CPU, as ``specdecode
serve``), ``--threads`` and ``--exact/--no-exact`` go to the server; ``--dtype`` only on torch (a
dtype makes ``auto`` torch). ``--proposer auto`` (default) lets the server pick the backend's
proposer (llama.cpp: ``prompt_lookup`` with ``--min-ngram 3``; torch: ``draft_model``); the report
names the one that ran. On llama.cpp the KV budget (``--kv-budget-tokens``, default 4096 per row)
is split evenly over ``--max-batch-size`` rows.

A peer (``--peer llama-server``: plain llama.cpp's server, ``--llama-server-bin``; or ``--peer
llama-cpp-python``: ``python -m llama_cpp.server``) serves the same target GGUF with the same
threads, as many slots as ``--max-batch-size`` and the same KV tokens (``--peer-args``: more
flags); it takes part in every round as one more mode (same prompts as chats, greedy,
``max_tokens`` with ``ignore_eos``, no prompt cache; its tokens are counted from the usage it
reports). The report gives each of our modes' speedup over the peer per concurrency, and how many
of the peer's texts equal our ``off`` mode's (reported, never a failure: the peer runs other
kernels; past 256 cached tokens llama.cpp's own one-token flash attention splits the cells among
the threads, which exact mode's reference kernels do not, and batched passes round by their size).

Writes ``results.json`` and ``report.md`` into ``--out``. Example (reduced scale)::

    python lab/scripts/bench_serve.py --concurrency 1,2 --requests 4 --max-tokens 64 --out bench-results/serve
    python lab/scripts/bench_serve.py --backend llamacpp --threads 2 --peer llama-server \\
        --llama-server-bin /tmp/llama-server-build/bin/llama-server --out bench-results/serve-llamacpp
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model (default: the default pair's)")
    p.add_argument("--draft", help="draft model (default: the default pair's)")
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "torch", "llamacpp"],
        help="the server's backend (default auto: llamacpp for the default pair on a CPU, as specdecode serve)",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="llamacpp (and the peer): CPU threads (default: every core)"
    )
    p.add_argument(
        "--exact",
        default=True,
        action=argparse.BooleanOptionalAction,
        help="llamacpp: batch-invariant verification (default); --no-exact: one pass, equal up to near-ties",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float32"],
        help="torch only (default bfloat16 there); with --backend auto a dtype selects torch",
    )
    p.add_argument(
        "--proposer",
        default="auto",
        help="default auto: the server's pick (llamacpp: prompt_lookup --min-ngram 3; torch: draft_model)",
    )
    p.add_argument(
        "-k", "--num-speculative-tokens", type=int, default=None, help="default: the proposer's own k (serve's -k)"
    )
    p.add_argument("--modes", default="on,off,adaptive", help="comma list of speculation modes")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma list of client concurrency levels")
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: 2 x concurrency, >= 4)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument(
        "--kv-budget-tokens",
        type=int,
        default=None,
        help="the server's KV budget (llamacpp default: 4096 per row x --max-batch-size; torch: the server's)",
    )
    p.add_argument(
        "--peer",
        choices=["none", "llama-server", "llama-cpp-python"],
        default="none",
        help="also measure a plain llama.cpp server on the target GGUF as one more mode (default none)",
    )
    p.add_argument(
        "--peer-args",
        default="",
        metavar="FLAGS",
        help="more flags for the peer, one string (e.g. --peer-args='-fa off': no flash attention)",
    )
    p.add_argument(
        "--llama-server-bin",
        help="the llama-server binary (default: llama-server on PATH, else /tmp/llama-server-build/bin/llama-server)",
    )
    p.add_argument("--questions", help="Spec-Bench jsonl (default: the packaged dev half, specdecode/data/spec_bench)")
    p.add_argument("--categories", default=None, help="Spec-Bench categories (default: all but humaneval)")
    p.add_argument(
        "--edits",
        type=int,
        default=0,
        help="the first N code edits (the bench's code_edit category) instead of Spec-Bench chats: our modes "
        "get the original file as OpenAI's prediction, the peer the prompt alone; answers end at the end "
        "token (no ignore_eos), at most --max-tokens",
    )
    p.add_argument(
        "--server",
        choices=["shared", "separate"],
        default="shared",
        help="shared (default): one server, the mode per request (speculation extension); separate: one per mode",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="rounds per level: the level's requests split over them, at least concurrency requests per round",
    )
    p.add_argument("--engine-baseline", action="store_true", help="also time one-at-a-time engine decoding")
    p.add_argument(
        "--reuse-costs",
        action="store_true",
        help="let our servers load a cost model stored by an earlier start (default: each measures its own)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=1800.0,
        help="seconds to wait for a server (ours measures its cost model first: minutes on a busy machine)",
    )
    p.add_argument("--out", help="output folder (default bench-results/serve-<timestamp>)")
    p.add_argument("--report", metavar="RESULTS_JSON", help="re-render report.md next to a saved results.json and exit")
    return p.parse_args(argv)


def resolve_setup(args: argparse.Namespace) -> dict[str, Any]:
    """What the server will run: the backend (``auto`` resolved as ``specdecode serve`` resolves it),
    the threads, the proposer ``auto`` picks and its options, and the KV budget.

    Raises:
        SystemExit: ``--dtype`` with ``--backend llamacpp``, or a peer without a GGUF target.
    """
    from specdecode.models.backends import default_proposer, resolve_backend, target_gguf

    backend = resolve_backend(args.backend, args.target, args.dtype or "auto")
    if backend == "llamacpp" and args.dtype:
        raise SystemExit("--dtype is a torch setting: leave it out with --backend llamacpp")
    threads = args.threads or len(os.sched_getaffinity(0))
    proposer, options = (args.proposer, {})
    if args.proposer == "auto":
        proposer, options = default_proposer(backend, args.draft)
    kv_budget = args.kv_budget_tokens
    if kv_budget is None and backend == "llamacpp":
        kv_budget = 4096 * args.max_batch_size  # a row holds a Spec-Bench prompt (<= ~1.5k) + max_tokens + k + 1
    gguf = target_gguf(args.target)
    if args.peer != "none" and gguf is None:
        raise SystemExit(f"--peer {args.peer} needs the target as a GGUF file; {args.target!r} is not one")
    return {
        "backend": backend,
        "dtype": (args.dtype or "bfloat16") if backend == "torch" else None,
        "threads": threads,
        "exact": args.exact if backend == "llamacpp" else None,
        "proposer": proposer,
        "proposer_options": options,
        "kv_budget_tokens": kv_budget,
        "target_gguf": str(gguf) if gguf else None,
    }


def end_token_ids(gguf: str | None) -> frozenset[int]:
    """llama.cpp's EOS and EOT of the target GGUF (the tokens our llama.cpp server ends at), read
    from its vocabulary alone; empty where there is no GGUF or llama-cpp-python cannot read it."""
    if not gguf:
        return frozenset()
    try:
        import llama_cpp
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # llama.cpp's model-loading log, errors only
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = llama_cpp.llama_model_load_from_file(gguf.encode(), params)
        if not model:
            return frozenset()
        vocab = llama_cpp.llama_model_get_vocab(model)
        ids = {int(llama_cpp.llama_vocab_eos(vocab)), int(llama_cpp.llama_vocab_eot(vocab))}
        llama_cpp.llama_model_free(model)
        return frozenset(i for i in ids if i >= 0)
    except Exception:  # only the peer comparison uses them
        return frozenset()


def machine_info() -> dict[str, Any]:
    """CPU model, the cores this process may use, the vector flags that matter to llama.cpp
    (AVX2, AVX-512 variants, AMX), and llama.cpp's own system line where it is installed."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    wanted = sorted(f for f in flags if f == "avx2" or f.startswith(("avx512", "amx", "avx_vnni")))
    info: dict[str, Any] = {
        "cpu": model,
        "cores": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "flags": wanted,
        "python": platform.python_version(),
    }
    try:
        import llama_cpp

        info["llama_cpp_python"] = llama_cpp.__version__
        info["llama_cpp_system"] = llama_cpp.llama_print_system_info().decode().strip()
    except Exception:  # not installed, or no native library: the line is informative only
        pass
    return info


def machine_line(info: dict[str, Any] | str) -> str:
    if isinstance(info, str):  # results.json of earlier versions
        return info
    flags = ", ".join(info["flags"]) or "no AVX2/AVX-512/AMX"
    return f"{info['cpu']}, {info['cores']} cores ({flags}), Python {info['python']}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_chats(args: argparse.Namespace, count: int) -> list[str]:
    """The first turn of ``count`` Spec-Bench questions, round-robin over categories (``--edits``:
    the first ``count`` code edits' turns)."""
    from specdecode.bench.prompts import load_prompts

    if args.edits:
        return [p.turns[0] for p in load_edits(args)][:count]
    categories = args.categories or "mt_bench,translation,summarization,qa,math_reasoning,rag"
    prompts = load_prompts(args.questions, categories, per_category=None, shortest=True)
    by_group: dict[str, list[str]] = {}
    for prompt in prompts:
        by_group.setdefault(prompt.group, []).append(prompt.turns[0])
    chats: list[str] = []
    while len(chats) < count:
        for group in sorted(by_group):
            if by_group[group]:
                chats.append(by_group[group].pop(0))
        if not any(by_group.values()):
            break
    return (chats * (count // max(1, len(chats)) + 1))[:count]


def load_edits(args: argparse.Namespace) -> list[Any]:
    """The first ``--edits`` prompts of the code_edit category (:mod:`specdecode.bench.code_edit`),
    each with its ``prediction`` (the original file)."""
    from specdecode.bench.prompts import load_prompts

    return load_prompts(None, "code_edit", per_category=None)[: args.edits]


def wait_http_ready(process: subprocess.Popen, url: str, what: str, log: str, timeout: float) -> None:
    """Poll ``url`` until it answers 200.

    Raises:
        RuntimeError: ``process`` exited, or ``timeout`` seconds passed (naming ``what`` and ``log``).
    """
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}; see {log}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not start in {timeout} s; see {log}")


class ServerProcess:
    """``specdecode serve`` in a subprocess, on a free port, until closed."""

    peer = False  # our server: token ids, the speculation extension and /metrics

    def __init__(
        self, args: argparse.Namespace, mode: str, log_path: Path, setup: dict[str, Any], extra: tuple[str, ...] = ()
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "specdecode.commands.main", "serve", "--port", str(self.port)]
        command += ["--speculation", mode, "--backend", setup["backend"], "--proposer", args.proposer]
        if setup["backend"] == "torch":
            command += ["--dtype", setup["dtype"]]  # on auto / llamacpp a dtype would force torch
        else:
            command += ["--threads", str(setup["threads"]), "--exact" if setup["exact"] else "--no-exact"]
        if args.num_speculative_tokens is not None:
            command += ["-k", str(args.num_speculative_tokens)]
        if setup["kv_budget_tokens"] is not None:
            command += ["--kv-budget-tokens", str(setup["kv_budget_tokens"])]
        command += ["--max-batch-size", str(args.max_batch_size), "--served-model-name", "bench"]
        command += ["--log-level", "info"]  # the cost model measured at start-up is logged
        if mode == "adaptive" and not args.reuse_costs:  # only adaptive measures a cost model
            command += ["--remeasure-costs"]  # each run measures its own table (serve would load a stored one)
        for flag in ("target", "draft"):
            if getattr(args, flag):
                command += [f"--{flag}", getattr(args, flag)]
        self.command = command + list(extra)
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        wait_http_ready(self.process, self.url + "/health", "the server", self.log.name, timeout)

    def metrics(self) -> dict[str, float]:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics").text):
            for sample in family.samples:
                if sample.name.startswith("specdecode_spec_decode") and not sample.labels:
                    out[sample.name] = sample.value
                elif sample.name.startswith("specdecode_step_phase_seconds_") and not sample.name.endswith("bucket"):
                    out[f"{sample.name}:{sample.labels['phase']}"] = sample.value
        return out

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def llama_server_bin(args: argparse.Namespace) -> str:
    """``--llama-server-bin``, else ``llama-server`` on PATH, else the build folder of the docs."""
    for candidate in (args.llama_server_bin, shutil.which("llama-server"), "/tmp/llama-server-build/bin/llama-server"):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise SystemExit(
        "--peer llama-server: no llama-server binary (--llama-server-bin PATH; lab/README.md, "
        "'The server's load benchmark', builds one from the sources llama-cpp-python vendors)"
    )


class PeerProcess(ServerProcess):
    """Plain llama.cpp serving the target GGUF (``llama-server`` or ``python -m llama_cpp.server``)
    with the same threads, one slot per row of our server and the same KV tokens in all; greedy
    chats through its OpenAI endpoint. No token ids, no speculation, no /metrics counters."""

    peer = True

    def __init__(self, args: argparse.Namespace, log_path: Path, setup: dict[str, Any]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        threads, slots = str(setup["threads"]), args.max_batch_size
        ctx = setup["kv_budget_tokens"] or 4096 * slots  # -c is the total over the slots
        if args.peer == "llama-server":
            command = [llama_server_bin(args), "--model", setup["target_gguf"], "--host", "127.0.0.1"]
            command += ["--port", str(self.port), "--threads", threads, "--threads-batch", threads]
            command += ["--parallel", str(slots), "--ctx-size", str(ctx), "--cont-batching", "--no-webui"]
            command += ["--alias", "bench", "--n-gpu-layers", "0"]
        else:  # llama-cpp-python's server: one request at a time, one context
            command = [sys.executable, "-m", "llama_cpp.server", "--model", setup["target_gguf"]]
            command += ["--host", "127.0.0.1", "--port", str(self.port), "--n_threads", threads]
            command += ["--n_threads_batch", threads, "--n_ctx", str(ctx // slots), "--model_alias", "bench"]
        self.command = command + shlex.split(args.peer_args)
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        # llama-server: /health is 503 while loading; llama_cpp.server has no /health
        wait_http_ready(self.process, self.url + "/v1/models", "the peer", self.log.name, timeout)

    def metrics(self) -> dict[str, float]:
        return {}

    def version(self) -> str:
        """``llama-server --version`` (its build and commit), or llama-cpp-python's version."""
        if self.command[0] == sys.executable:
            import llama_cpp

            return f"llama-cpp-python {llama_cpp.__version__}"
        run = subprocess.run([self.command[0], "--version"], capture_output=True, text=True, timeout=60)
        lines = (run.stdout + run.stderr).splitlines()
        return "; ".join(x.strip() for x in lines if x.startswith(("version", "built with"))) or "version unknown"


def one_request(
    client: Any,
    chat: str,
    max_tokens: int,
    speculation: str | None = None,
    peer: bool = False,
    end_ids: frozenset[int] = frozenset(),
    prediction: str | None = None,
    ignore_eos: bool = True,
) -> dict[str, Any]:
    """One streamed greedy chat request; returns times (s), tokens, the token ids and the text.
    ``prediction``: sent as OpenAI's ``prediction`` (our server; ``accepted_prediction_tokens`` from
    the usage is returned); ``ignore_eos`` False: the answer ends at the end token.
    ``speculation`` (``"on"``, ``"off"``, ``"adaptive"``; None: the server's mode) is sent as the
    per-request ``speculation`` extension. ``peer``: a llama.cpp server, which streams no token
    ids: its first token is the first chunk with text, and its tokens are the ``usage`` (or
    ``timings``) it reports at the end, else the text chunks counted; its prompt cache is off
    (``cache_prompt: false``: the levels repeat the prompts, and our server caches none).
    ``end_ids``: for our server, ``text_before_end`` is the text streamed before the first of
    these tokens (None if none came): with ``ignore_eos`` we emit the end token and go on, while
    llama-server bans end tokens and picks another, so the two texts part there."""
    start = time.perf_counter()
    first = None
    ids: list[int] = []
    text: list[str] = []
    chunks, usage_tokens = 0, None
    before_end: str | None = None
    extra: dict[str, Any] = {"ignore_eos": True} if ignore_eos else {}
    if prediction is not None and not peer:
        extra["prediction"] = {"type": "content", "content": prediction}
    accepted_prediction = None
    if peer:  # our server keeps no prompt cache: the peer recomputes every prompt too
        extra["cache_prompt"] = False
    else:
        extra["return_token_ids"] = True
        if speculation:
            extra["speculation"] = speculation
    stream = client.chat.completions.create(
        model="bench",
        messages=[{"role": "user", "content": chat}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body=extra,
        **({"stream_options": {"include_usage": True}} if peer or prediction is not None else {}),
    )
    for chunk in stream:
        if getattr(chunk, "usage", None) is not None and chunk.usage.completion_tokens:
            usage_tokens = chunk.usage.completion_tokens
            details = getattr(chunk.usage, "completion_tokens_details", None)
            if details is not None and getattr(details, "accepted_prediction_tokens", None) is not None:
                accepted_prediction = details.accepted_prediction_tokens
        timings = (chunk.model_extra or {}).get("timings")
        if isinstance(timings, dict) and timings.get("predicted_n") and usage_tokens is None:
            usage_tokens = int(timings["predicted_n"])
        for choice in chunk.choices:
            content = choice.delta.content if choice.delta else None
            new = (choice.model_extra or {}).get("token_ids") or []
            if (new or (peer and content)) and first is None:
                first = time.perf_counter()
            if before_end is None and end_ids & set(new):
                before_end = "".join(text)
            ids += new
            if content:
                text.append(content)
                chunks += 1
    end = time.perf_counter()
    first = first or end
    n = (usage_tokens or chunks) if peer else len(ids)
    return {
        "ttft_s": first - start,
        "tpot_s": (end - first) / (n - 1) if n > 1 else 0.0,
        "e2e_s": end - start,
        "tokens": n,
        "token_ids": ids,
        "text": "".join(text),
        "text_before_end": before_end,
        "accepted_prediction_tokens": accepted_prediction,
    }


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    qs = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50": qs[49], "p90": qs[89], "p99": qs[98], "mean": statistics.fmean(values)}


def run_level(
    server: ServerProcess, chats: list[str], concurrency: int, max_tokens: int, speculation: str | None = None
) -> dict[str, Any]:
    """Send ``chats`` from ``concurrency`` client threads; returns the pooled summary (see
    :func:`summarize`) of this one round."""
    return summarize([send_round(server, chats, concurrency, max_tokens, speculation)], concurrency)


def send_round(
    server: ServerProcess,
    chats: list[str],
    concurrency: int,
    max_tokens: int,
    speculation: str | None,
    end_ids: frozenset[int] = frozenset(),
    predictions: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One round: wall time, every request's result and the ``/metrics`` counters' increase.
    ``predictions``: per chat, the prediction our server gets (``--edits``: then no ``ignore_eos``)."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=3600)
    before = server.metrics()
    lock = threading.Lock()
    results: list[dict[str, Any] | None] = [None] * len(chats)
    queue = list(enumerate(chats))

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                index, chat = queue.pop(0)
            prediction = (predictions or {}).get(chat)
            results[index] = one_request(
                client, chat, max_tokens, speculation, server.peer, end_ids, prediction, ignore_eos=predictions is None
            )

    tic = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(worker) for _ in range(concurrency)]
    wall = time.perf_counter() - tic
    for future in futures:
        future.result()  # a failed request fails the run instead of leaving the round short
    after = server.metrics()
    done = [r for r in results if r is not None]
    counters = {
        name.removeprefix("specdecode_spec_decode_"): after.get(name, 0) - before.get(name, 0) for name in after
    }
    return {"wall_s": wall, "done": done, "counters": counters}


def summarize(rounds: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    """Pool rounds of one (mode, concurrency): throughput = all tokens / all wall time, latency
    percentiles over all requests, counters summed; ``rounds_tokens_per_s`` keeps each round's."""
    spec: dict[str, float] = {}
    for r in rounds:
        for name, value in r["counters"].items():
            spec[name] = spec.get(name, 0.0) + value
    done = [x for r in rounds for x in r["done"]]
    wall = sum(r["wall_s"] for r in rounds)
    phase_ms = {  # mean milliseconds per decode step (per prefill pass) of each phase, from /metrics
        phase: 1e3 * spec.get(f"specdecode_step_phase_seconds_sum:{phase}", 0.0) / count
        for phase in ("plan", "draft", "target", "verify", "step", "prefill")
        if (count := spec.get(f"specdecode_step_phase_seconds_count:{phase}", 0.0))
    }
    drafts, draft_tokens = spec.get("num_drafts_total", 0), spec.get("num_draft_tokens_total", 0)
    accepted = spec.get("num_accepted_tokens_total", 0)
    tokens = sum(r["tokens"] for r in done)
    return {
        "concurrency": concurrency,
        "requests": len(done),
        "rounds": len(rounds),
        "wall_s": wall,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "rounds_tokens_per_s": [sum(x["tokens"] for x in r["done"]) / r["wall_s"] for r in rounds],
        "requests_per_s": len(done) / wall,
        "ttft_s": percentiles([r["ttft_s"] for r in done]),
        "tpot_s": percentiles([r["tpot_s"] for r in done]),
        "e2e_s": percentiles([r["e2e_s"] for r in done]),
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "phase_ms": phase_ms,
        "token_ids": [r["token_ids"] for r in done],
        "accepted_prediction_tokens": sum(r.get("accepted_prediction_tokens") or 0 for r in done),
        "texts": [r.get("text", "") for r in done],
        "texts_before_end": [r.get("text_before_end") for r in done],
    }


def engine_baseline(args: argparse.Namespace, chats: list[str], setup: dict[str, Any]) -> dict[str, Any]:
    """One request at a time in this process: the library's own single-request speedup."""
    from specdecode.engine import SpeculativeGenerator
    from specdecode.sampling import SamplingParams

    generator = SpeculativeGenerator.from_pretrained(
        args.target,
        args.draft,
        setup["dtype"] or "auto",
        setup["proposer"],
        backend=setup["backend"],
        threads=setup["threads"] if setup["backend"] == "llamacpp" else None,
        exact=setup["exact"] if setup["exact"] is not None else True,
        **setup["proposer_options"],
    )
    generator.eos_token_ids = frozenset()  # as the server's ignore_eos: every request gives max_tokens tokens
    sampling = SamplingParams(max_new_tokens=args.max_tokens)
    generator.generate(chats[0], sampling, args.num_speculative_tokens)  # warm-up
    times = {"on": 0.0, "off": 0.0}
    tokens = {"on": 0, "off": 0}
    for chat in chats:
        for mode in ("on", "off"):
            result = generator.generate(chat, sampling, args.num_speculative_tokens, speculative=mode == "on")
            times[mode] += result.stats.wall_time_s
            tokens[mode] += len(result.token_ids)
    return {
        "tokens_per_s": {m: tokens[m] / times[m] for m in times},
        "speedup": times["off"] / times["on"],
        "prompts": len(chats),
    }


def paired_interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of per-round ratios and its interval of ±2 standard errors of the mean log
    ratio (about 95% for roughly normal log ratios): rounds alternate the modes, so each round's
    ratio compares two measurements taken minutes apart and the machine's drift cancels in it."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    se = statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - 2 * se), math.exp(mean + 2 * se)


def peer_agreement(results: dict[str, Any], reference: str, peer: str) -> dict[str, Any]:
    """How many of the peer's texts equal ``reference``'s (request by request, every level), and
    where the others first differ (characters of the common prefix / characters of ours). A text
    of ours that reached an end token counts as equal when the peer's starts with our text before
    it (with ``ignore_eos`` llama-server bans end tokens: it goes on with another token there);
    ``ended`` counts those requests."""
    same, total, ended, prefixes = 0, 0, 0, []
    per_level = {}
    for ours, theirs in zip(results["modes"][reference], results["modes"][peer], strict=True):
        level_same = 0
        befores = ours.get("texts_before_end") or [None] * len(ours.get("texts", []))
        for a, before, b in zip(ours.get("texts", []), befores, theirs.get("texts", []), strict=False):
            total += 1
            if before is not None:
                ended += 1
                a = before
            if a == b or (before is not None and b.startswith(before)):
                level_same += 1
                continue
            common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            prefixes.append(common / max(1, len(a)))
        same += level_same
        per_level[str(ours["concurrency"])] = [
            level_same,
            min(len(ours.get("texts", [])), len(theirs.get("texts", []))),
        ]
    return {
        "reference": reference,
        "identical": same,
        "requests": total,
        "ended": ended,
        "per_level": per_level,
        "mean_common_prefix_of_differing": statistics.fmean(prefixes) if prefixes else None,
    }


def _level(results: dict[str, Any], mode: str, concurrency: int) -> dict[str, Any]:
    return next(x for x in results["modes"][mode] if x["concurrency"] == concurrency)


def _setup_line(results: dict[str, Any]) -> str:
    args, setup = results["args"], results.get("setup")
    k = args.get("num_speculative_tokens")
    k_text = f"k = {k}" if k is not None else "k = the proposer's own"
    if not setup:  # results.json of earlier versions: torch, the flags as given
        return f"dtype {args['dtype']}, proposer {args['proposer']}, {k_text}"
    options = ", ".join(f"{name}={value}" for name, value in setup["proposer_options"].items())
    proposer = setup["proposer"] + (f" ({options})" if options else "")
    if args.get("proposer") == "auto":
        proposer += " (--proposer auto)"
    if setup["backend"] == "llamacpp":
        backend = f"llama.cpp, {setup['threads']} threads, {'exact' if setup['exact'] else 'fast (--no-exact)'} mode"
    else:
        backend = f"torch, dtype {setup['dtype']}"
    budget = f", --kv-budget-tokens {setup['kv_budget_tokens']}" if setup["kv_budget_tokens"] else ""
    return f"backend {backend}; proposer {proposer}, {k_text}{budget}"


def report(results: dict[str, Any]) -> str:
    peer = (results.get("peer") or {}).get("label")
    modes = [m for m in results["modes"] if m != peer]  # ours
    shown = modes + ([peer] if peer else [])
    lines = [
        "# specdecode serve: load benchmark",
        "",
        f"{results['date']}, {machine_line(results['machine'])}; {_setup_line(results)}, greedy, "
        f"{results['args']['max_tokens']} tokens per request "
        f"({'code edits, a prediction, the end token ends' if results['args'].get('edits') else 'ignore_eos'}), "
        "--max-batch-size "
        f"{results['args']['max_batch_size']}. Servers: {results.get('server', 'one per mode')}; "
        f"{results['args'].get('rounds', 1)} round(s) per level.",
    ]
    if isinstance(results["machine"], dict) and results["machine"].get("llama_cpp_system"):
        m = results["machine"]
        lines += ["", f"llama-cpp-python {m.get('llama_cpp_python', '?')}: `{m['llama_cpp_system']}`"]
    if peer:
        p = results["peer"]
        lines += ["", f"Peer `{peer}` ({p.get('version', '?')}), every round as one more mode: `{p['command']}`"]
    if results.get("command"):
        lines += ["", f"Command: `{results['command']}`"]
    lines += [
        "",
        "| concurrency | mode | tok/s | req/s | TTFT p50 / p90 / p99 (s) | TPOT p50 / p90 (ms) | e2e p50 / p99 (s) "
        "| α | MAL | ms per step: plan / draft / target / all |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in results["args"]["concurrency"]:
        for mode in shown:
            r = _level(results, mode, c)
            t, o, e, ph = r["ttft_s"], r["tpot_s"], r["e2e_s"], r.get("phase_ms", {})
            spec = (
                "- | - | -"
                if mode == peer
                else f"{r['acceptance_rate']:.2f} | {r['mean_acceptance_length']:.2f} "
                f"| {' / '.join(f'{ph.get(x, 0.0):.1f}' for x in ('plan', 'draft', 'target', 'step'))}"
            )
            lines.append(
                f"| {c} | {mode} | {r['tokens_per_s']:.1f} | {r['requests_per_s']:.2f} "
                f"| {t['p50']:.2f} / {t['p90']:.2f} / {t['p99']:.2f} | {o['p50'] * 1e3:.0f} / {o['p90'] * 1e3:.0f} "
                f"| {e['p50']:.2f} / {e['p99']:.2f} | {spec} |"
            )
    lines += ["", "Throughput relative to `off` (same concurrency):", ""]
    lines += [
        "| concurrency | " + " | ".join(modes) + " | adaptive / best of on, off | per round |",
        "|---" * (len(modes) + 3) + "|",
    ]
    for c in results["args"]["concurrency"]:
        level = {m: _level(results, m, c) for m in modes}
        tps = {m: level[m]["tokens_per_s"] for m in modes}
        base = tps.get("off") or 1.0
        cells = " | ".join(f"{tps[m] / base:.2f}" for m in modes)
        best = max(tps.get("on", 0.0), tps.get("off", 0.0)) or 1.0
        ratio = f"{tps['adaptive'] / best:.2f}" if "adaptive" in tps else "-"
        per_round = "-"
        if "adaptive" in tps and {"on", "off"} & set(modes):
            rounds = zip(*(level[m].get("rounds_tokens_per_s", [tps[m]]) for m in modes), strict=False)
            ratios = []
            for values in rounds:
                by_mode = dict(zip(modes, values, strict=True))
                ratios.append(by_mode["adaptive"] / (max(by_mode.get("on", 0.0), by_mode.get("off", 0.0)) or 1.0))
            per_round = ", ".join(f"{x:.2f}" for x in ratios)
            if len(ratios) > 1:
                mean, low, high = paired_interval(ratios)
                per_round += f" (geometric mean {mean:.3f}, ±2 s.e. {low:.3f}–{high:.3f})"
        lines.append(f"| {c} | {cells} | {ratio} | {per_round} |")
    if peer:
        lines += [
            "",
            f"Speedup over `{peer}` (our tok/s / its tok/s, same concurrency, pooled; in parentheses the "
            "geometric mean of the per-round ratios and its ±2 s.e. interval):",
            "",
            f"| concurrency | {peer} tok/s | " + " | ".join(f"{m} / {peer}" for m in modes) + " |",
            "|---" * (len(modes) + 2) + "|",
        ]
        for c in results["args"]["concurrency"]:
            theirs = _level(results, peer, c)
            cells = []
            for m in modes:
                ours = _level(results, m, c)
                cell = f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}"
                pairs = list(
                    zip(ours.get("rounds_tokens_per_s", []), theirs.get("rounds_tokens_per_s", []), strict=False)
                )
                if len(pairs) > 1:
                    mean, low, high = paired_interval([a / b for a, b in pairs])
                    cell += f" ({mean:.3f}, {low:.3f}–{high:.3f})"
                cells.append(cell)
            lines.append(f"| {c} | {theirs['tokens_per_s']:.1f} | " + " | ".join(cells) + " |")
        agreement = results.get("peer_agreement")
        if agreement:
            prefix = agreement["mean_common_prefix_of_differing"]
            lines += [
                "",
                f"`{peer}`'s texts equal to `{agreement['reference']}`'s: {agreement['identical']} of "
                f"{agreement['requests']} requests ({agreement.get('ended', 0)} of ours reached an end token "
                f"and are compared up to it: {peer} bans end tokens under ignore_eos; per concurrency: "
                + ", ".join(f"c={c} {s}/{n}" for c, (s, n) in agreement["per_level"].items())
                + ")"
                + (
                    f"; the others agree on their first {prefix:.0%} of characters on average"
                    if prefix is not None
                    else ""
                )
                + " (reported, not a check: the peer runs other kernels; past 256 cached tokens its one-token "
                "flash attention splits the cells among the threads, and batched passes round by their size).",
            ]
        if not results["args"].get("edits") and any(
            lvl["output_tokens"] != lvl["requests"] * results["args"]["max_tokens"] for lvl in results["modes"][peer]
        ):
            lines += [
                "",
                f"`{peer}` produced other than max_tokens tokens on some requests (ignore_eos not honoured?); "
                "its throughput counts the tokens it reported.",
            ]
    if "engine" in results:
        eng = results["engine"]
        lines += [
            "",
            f"Engine, one request at a time ({eng['prompts']} prompts): speedup {eng['speedup']:.2f} "
            f"({eng['tokens_per_s']['on']:.1f} vs {eng['tokens_per_s']['off']:.1f} tok/s).",
        ]
        c1 = {m: x["tokens_per_s"] for m in modes for x in results["modes"][m] if x["concurrency"] == 1}
        if "on" in c1 and "off" in c1:
            kept = (c1["on"] / c1["off"]) / eng["speedup"]
            lines.append(f"The server's speedup at concurrency 1 (on / off) keeps {kept:.0%} of it.")
    if results["args"].get("edits"):  # OpenAI's usage.completion_tokens_details of our modes
        accepted = ", ".join(
            f"{m} c={x['concurrency']}: {x.get('accepted_prediction_tokens', 0)} of {x['output_tokens']}"
            for m in modes
            for x in results["modes"][m]
        )
        lines += ["", f"Accepted prediction tokens (`usage.completion_tokens_details`): {accepted}."]
    lines += ["", f"Identical token ids across our modes: {results['identical_across_modes']}.", ""]
    return "\n".join(lines)


def _terminated(*_: Any) -> None:
    """SIGTERM: leave through ``main``'s ``finally`` (which closes the servers), once; a second
    SIGTERM (``timeout`` forwards one) must not interrupt the closing."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(143)


def main(argv: list[str] | None = None) -> int:
    import openai

    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)  # a terminated run still closes its servers
    if args.report:
        saved = Path(args.report)
        text = report(json.loads(saved.read_text()))
        (saved.parent / "report.md").write_text(text)
        print(text)
        return 0
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    peer = args.peer if args.peer != "none" else None
    every = modes + ([peer] if peer else [])  # the peer takes part in every round as one more mode
    setup = resolve_setup(args)
    out = Path(args.out or f"bench-results/serve-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    counts = {c: args.requests or max(4, 2 * c) for c in levels}
    chats = load_chats(args, max(counts.values()))
    predictions = {p.turns[0]: p.prediction for p in load_edits(args)} if args.edits else None
    given = sys.argv[1:] if argv is None else argv
    end_ids = end_token_ids(setup["target_gguf"]) if peer else frozenset()
    results: dict[str, Any] = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "command": shlex.join(["python", "lab/scripts/bench_serve.py", *given]),
        "args": {**vars(args), "concurrency": levels},
        "setup": setup,
        "modes": {},
    }
    print(f"machine: {machine_line(results['machine'])}", flush=True)
    print(f"server: {_setup_line(results)}", flush=True)
    # Shared: one server, the mode per request. Separate: one server per mode, all up at once
    # (started one after another, so that the adaptive one measures its cost model on a quiet
    # machine). Each level runs in rounds, every mode once per round, in an order that rotates from
    # round to round: the machine's drift over the run hits every mode alike. The peer starts last
    # (after our cost model is measured) and is one more mode of every round.
    shared = args.server == "shared"
    servers: dict[str, ServerProcess] = {}
    peer_server: PeerProcess | None = None
    try:
        for mode in ["adaptive" if "adaptive" in modes else "on"] if shared else modes:
            servers[mode] = ServerProcess(args, mode, out / f"server-{mode}.log", setup)
            servers[mode].wait_ready(args.startup_timeout)
            one_request(openai.OpenAI(base_url=servers[mode].url + "/v1", api_key="none"), chats[0], 8)  # warm-up
        results["server_commands"] = {mode: shlex.join(server.command) for mode, server in servers.items()}
        if peer:
            peer_server = PeerProcess(args, out / f"peer-{peer}.log", setup)
            results["peer"] = {
                "label": peer,
                "command": shlex.join(peer_server.command),
                "version": peer_server.version(),
            }
            print(f"peer: {results['peer']['version']}: {results['peer']['command']}", flush=True)
            peer_server.wait_ready(args.startup_timeout)
            one_request(openai.OpenAI(base_url=peer_server.url + "/v1", api_key="none"), chats[0], 8, peer=True)
        results["modes"] = {mode: [] for mode in every}
        results["server"] = (
            f"one server (--speculation {next(iter(servers))}), the mode per request" if shared else "one per mode"
        )
        turn = 0
        for c in levels:
            rounds = max(1, min(args.rounds, counts[c] // c))  # a round keeps at least c requests
            share = -(-counts[c] // rounds)  # requests per round
            parts: dict[str, list[dict[str, Any]]] = {mode: [] for mode in every}
            for r in range(rounds):
                batch = chats[r * share : min(counts[c], (r + 1) * share)]
                if not batch:
                    break
                for mode in every[turn % len(every) :] + every[: turn % len(every)]:
                    if mode == peer and peer_server is not None:
                        server, speculation = peer_server, None
                    else:
                        server = next(iter(servers.values())) if shared else servers[mode]
                        speculation = mode if shared else None
                    part = send_round(server, batch, c, args.max_tokens, speculation, end_ids, predictions)
                    parts[mode].append(part)
                    tps = sum(x["tokens"] for x in part["done"]) / part["wall_s"]
                    print(f"{mode:>8} c={c} round {r}: {tps:.2f} tok/s", flush=True)
                turn += 1
            for mode in every:
                level = summarize(parts[mode], c)
                alpha = "" if mode == peer else f", α {level['acceptance_rate']:.2f}"
                print(f"{mode:>8} c={c}: {level['tokens_per_s']:.2f} tok/s{alpha}", flush=True)
                results["modes"][mode].append(level)
            (out / "partial.json").write_text(json.dumps(results, indent=1))  # survives an interrupted run
    finally:
        for server in servers.values():
            server.close()
        if peer_server is not None:
            peer_server.close()
    ids = {m: [lvl["token_ids"] for lvl in results["modes"][m]] for m in modes}
    results["identical_across_modes"] = all(ids[m] == ids[modes[0]] for m in modes)
    if peer:
        results["peer_agreement"] = peer_agreement(results, "off" if "off" in modes else modes[0], peer)
    if args.engine_baseline:
        results["engine"] = engine_baseline(args, chats[: counts[levels[0]]], setup)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report(results))
    (out / "partial.json").unlink(missing_ok=True)  # results.json holds all of it now
    print(report(results))
    print(f"written: {out / 'results.json'}, {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
