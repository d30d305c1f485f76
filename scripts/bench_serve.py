#!/usr/bin/env python
"""Load benchmark of ``specdecode serve`` with the official ``openai`` client (a script, not a test).

All modes run in one server process (``--server shared``, the default): a server started with
``--speculation adaptive`` (``on`` if adaptive is not among the modes), every request sent with
its mode as the per-request ``speculation`` extension (``"on"``: draft k every step; ``"off"``:
the target alone, exactly what an ``--speculation off`` server runs; ``"adaptive"``: the cost
model decides). Two server processes of the same code and settings differ by about 10% in speed
on this machine (cause not found; measured with two ``off`` servers side by side,
``scripts/serve_side_by_side.py``), more than the 5% that separates a good schedule from a bad
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

Writes ``results.json`` and ``report.md`` into ``--out``. Example (reduced scale)::

    python scripts/bench_serve.py --concurrency 1,2 --requests 4 --max-tokens 64 --out bench-results/serve
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
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
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--proposer", default="draft_model")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    p.add_argument("--modes", default="on,off,adaptive", help="comma list of speculation modes")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma list of client concurrency levels")
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: 2 x concurrency, >= 4)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--questions", help="Spec-Bench jsonl (default: the packaged dev half, specdecode/data/spec_bench)")
    p.add_argument("--categories", default=None, help="Spec-Bench categories (default: all but humaneval)")
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
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for a server")
    p.add_argument("--out", help="output folder (default bench-results/serve-<timestamp>)")
    p.add_argument("--report", metavar="RESULTS_JSON", help="re-render report.md next to a saved results.json and exit")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_chats(args: argparse.Namespace, count: int) -> list[str]:
    """The first turn of ``count`` Spec-Bench questions, round-robin over categories."""
    from specdecode.bench.prompts import load_prompts

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


class ServerProcess:
    """``specdecode serve`` in a subprocess, on a free port, until closed."""

    def __init__(self, args: argparse.Namespace, mode: str, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "specdecode.commands.main", "serve", "--port", str(self.port)]
        command += ["--speculation", mode]
        command += ["--dtype", args.dtype, "--proposer", args.proposer, "-k", str(args.num_speculative_tokens)]
        command += ["--max-batch-size", str(args.max_batch_size), "--served-model-name", "bench"]
        command += ["--log-level", "info"]  # the cost model measured at start-up is logged
        for flag in ("target", "draft"):
            if getattr(args, flag):
                command += [f"--{flag}", getattr(args, flag)]
        self.command = command
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server did not start in {timeout} s; see {self.log.name}")

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


def one_request(client: Any, chat: str, max_tokens: int, speculation: str | None = None) -> dict[str, Any]:
    """One streamed greedy chat request; returns times (s), tokens and the token ids.
    ``speculation`` (``"on"``, ``"off"``, ``"adaptive"``; None: the server's mode) is sent as the
    per-request ``speculation`` extension."""
    start = time.perf_counter()
    first = None
    ids: list[int] = []
    stream = client.chat.completions.create(
        model="bench",
        messages=[{"role": "user", "content": chat}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={
            "ignore_eos": True,
            "return_token_ids": True,
            **({"speculation": speculation} if speculation else {}),
        },
    )
    for chunk in stream:
        for choice in chunk.choices:
            new = (choice.model_extra or {}).get("token_ids") or []
            if new and first is None:
                first = time.perf_counter()
            ids += new
    end = time.perf_counter()
    first = first or end
    n = len(ids)
    return {
        "ttft_s": first - start,
        "tpot_s": (end - first) / (n - 1) if n > 1 else 0.0,
        "e2e_s": end - start,
        "tokens": n,
        "token_ids": ids,
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
    server: ServerProcess, chats: list[str], concurrency: int, max_tokens: int, speculation: str | None
) -> dict[str, Any]:
    """One round: wall time, every request's result and the ``/metrics`` counters' increase."""
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
            results[index] = one_request(client, chat, max_tokens, speculation)

    tic = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for _ in range(concurrency):
            pool.submit(worker)
    wall = time.perf_counter() - tic
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
    }


def engine_baseline(args: argparse.Namespace, chats: list[str]) -> dict[str, Any]:
    """One request at a time in this process: the library's own single-request speedup."""
    from specdecode.engine import SpeculativeGenerator
    from specdecode.sampling import SamplingParams

    generator = SpeculativeGenerator.from_pretrained(args.target, args.draft, args.dtype, args.proposer)
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


def report(results: dict[str, Any]) -> str:
    modes = list(results["modes"])
    lines = [
        "# specdecode serve: load benchmark",
        "",
        f"{results['date']}, {results['machine']}; dtype {results['args']['dtype']}, proposer "
        f"{results['args']['proposer']}, k = {results['args']['num_speculative_tokens']}, greedy, "
        f"{results['args']['max_tokens']} tokens per request (ignore_eos), --max-batch-size "
        f"{results['args']['max_batch_size']}. Servers: {results.get('server', 'one per mode')}; "
        f"{results['args'].get('rounds', 1)} round(s) per level.",
        "",
        "| concurrency | mode | tok/s | req/s | TTFT p50 / p90 / p99 (s) | TPOT p50 / p90 (ms) | e2e p50 / p99 (s) "
        "| α | MAL | ms per step: plan / draft / target / all |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in results["args"]["concurrency"]:
        for mode in modes:
            r = next(x for x in results["modes"][mode] if x["concurrency"] == c)
            t, o, e, ph = r["ttft_s"], r["tpot_s"], r["e2e_s"], r.get("phase_ms", {})
            lines.append(
                f"| {c} | {mode} | {r['tokens_per_s']:.1f} | {r['requests_per_s']:.2f} "
                f"| {t['p50']:.2f} / {t['p90']:.2f} / {t['p99']:.2f} | {o['p50'] * 1e3:.0f} / {o['p90'] * 1e3:.0f} "
                f"| {e['p50']:.2f} / {e['p99']:.2f} | {r['acceptance_rate']:.2f} | {r['mean_acceptance_length']:.2f} "
                f"| {' / '.join(f'{ph.get(x, 0.0):.1f}' for x in ('plan', 'draft', 'target', 'step'))} |"
            )
    lines += ["", "Throughput relative to `off` (same concurrency):", ""]
    lines += [
        "| concurrency | " + " | ".join(modes) + " | adaptive / best of on, off | per round |",
        "|---" * (len(modes) + 3) + "|",
    ]
    for c in results["args"]["concurrency"]:
        level = {m: next(x for x in results["modes"][m] if x["concurrency"] == c) for m in modes}
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
    lines += ["", f"Identical token ids across modes: {results['identical_across_modes']}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import openai

    args = parse_args(argv)
    if args.report:
        saved = Path(args.report)
        text = report(json.loads(saved.read_text()))
        (saved.parent / "report.md").write_text(text)
        print(text)
        return 0
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    out = Path(args.out or f"bench-results/serve-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    counts = {c: args.requests or max(4, 2 * c) for c in levels}
    chats = load_chats(args, max(counts.values()))
    results: dict[str, Any] = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "args": {**vars(args), "concurrency": levels},
        "modes": {},
    }
    # Shared: one server, the mode per request. Separate: one server per mode, all up at once
    # (started one after another, so that the adaptive one measures its cost model on a quiet
    # machine). Each level runs in rounds, every mode once per round, in an order that rotates from
    # round to round: the machine's drift over the run hits every mode alike.
    shared = args.server == "shared"
    servers: dict[str, ServerProcess] = {}
    try:
        for mode in ["adaptive" if "adaptive" in modes else "on"] if shared else modes:
            servers[mode] = ServerProcess(args, mode, out / f"server-{mode}.log")
            servers[mode].wait_ready(args.startup_timeout)
            one_request(openai.OpenAI(base_url=servers[mode].url + "/v1", api_key="none"), chats[0], 8)  # warm-up
        results["modes"] = {mode: [] for mode in modes}
        results["server"] = (
            f"one server (--speculation {next(iter(servers))}), the mode per request" if shared else "one per mode"
        )
        turn = 0
        for c in levels:
            rounds = max(1, min(args.rounds, counts[c] // c))  # a round keeps at least c requests
            share = -(-counts[c] // rounds)  # requests per round
            parts: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
            for r in range(rounds):
                batch = chats[r * share : min(counts[c], (r + 1) * share)]
                if not batch:
                    break
                for mode in modes[turn % len(modes) :] + modes[: turn % len(modes)]:
                    server = next(iter(servers.values())) if shared else servers[mode]
                    part = send_round(server, batch, c, args.max_tokens, mode if shared else None)
                    parts[mode].append(part)
                    tps = sum(x["tokens"] for x in part["done"]) / part["wall_s"]
                    print(f"{mode:>8} c={c} round {r}: {tps:.2f} tok/s", flush=True)
                turn += 1
            for mode in modes:
                level = summarize(parts[mode], c)
                print(
                    f"{mode:>8} c={c}: {level['tokens_per_s']:.2f} tok/s, α {level['acceptance_rate']:.2f}", flush=True
                )
                results["modes"][mode].append(level)
            (out / "partial.json").write_text(json.dumps(results, indent=1))  # survives an interrupted run
    finally:
        for server in servers.values():
            server.close()
    ids = {m: [lvl["token_ids"] for lvl in results["modes"][m]] for m in modes}
    results["identical_across_modes"] = all(ids[m] == ids[modes[0]] for m in modes)
    if args.engine_baseline:
        results["engine"] = engine_baseline(args, chats[: counts[levels[0]]])
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report(results))
    (out / "partial.json").unlink(missing_ok=True)  # results.json holds all of it now
    print(report(results))
    print(f"written: {out / 'results.json'}, {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
