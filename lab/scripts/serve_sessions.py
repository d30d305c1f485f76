"""Multi-turn coding sessions through ``specdecode serve`` and llama-server, the history re-sent every turn.

What chat clients, editors and agents do: each request carries the whole conversation again (a
system prompt, a public 166-line module, the earlier questions and answers). Per turn: time to first
token, end to end, prompt and cached prompt tokens, completion tokens, accepted draft tokens; per
session the total. Greedy, streamed, answers end at the end token (or ``--max-tokens``). Each
server answers from its own history (its own earlier answers), as a user would see it; the turns
whose texts agree are counted.

The servers run one after the other, never together (2 cores): ours (``bench_serve.py``'s
``ServerProcess``, the default ``--speculation adaptive``, prefix cache on), then the peer
(llama-server with its defaults, ``cache_prompt`` on), then ours again with ``--no-prefix-cache``
when ``--uncached`` is given. ``--sessions N`` runs N conversations at once (each its own history).

    python lab/scripts/serve_sessions.py --sessions 1 --peer llama-server --out lab/results/multi-turn/s1

Writes ``results.json`` and ``report.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import colorsys
import hashlib
import json
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import bench_serve  # noqa: E402

from specdecode.bench.prompts import CODING_SESSION  # noqa: E402

SYSTEM = "You are a helpful coding assistant. Answer concisely."
QUESTIONS = CODING_SESSION  # the bench's multi_turn coding session: "{module}" is colorsys.py


def module_text() -> tuple[str, str]:
    """The standard library's ``colorsys.py`` (166 lines in CPython 3.11) and its SHA-256."""
    text = Path(colorsys.__file__).read_text()
    return text, hashlib.sha256(text.encode()).hexdigest()


def chat_turn(url: str, messages: list[dict[str, str]], max_tokens: int, peer: bool) -> dict[str, Any]:
    """One streamed greedy chat request; times (s) and the usage the server reports."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1800)
    start = time.perf_counter()
    first = None
    text, usage, speculative = [], None, None
    stream = client.chat.completions.create(
        model="bench",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        extra = chunk.model_extra or {}
        speculative = extra.get("speculative", speculative)
        for choice in chunk.choices:
            content = choice.delta.content if choice.delta else None
            if content:
                if first is None:
                    first = time.perf_counter()
                text.append(content)
    end = time.perf_counter()
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    return {
        "ttft_s": (first or end) - start,
        "e2e_s": end - start,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "cached_tokens": cached,
        "completion_tokens": usage.completion_tokens if usage else None,
        "accepted_tokens": (speculative or {}).get("accepted_tokens"),
        "text": "".join(text),
    }


def session(url: str, module: str, max_tokens: int, peer: bool) -> dict[str, Any]:
    """The six turns, the history re-sent each turn."""
    messages = [{"role": "system", "content": SYSTEM}]
    turns = []
    start = time.perf_counter()
    for i, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question.format(module=module) if i == 0 else question})
        turn = chat_turn(url, messages, max_tokens, peer)
        turns.append(turn)
        messages.append({"role": "assistant", "content": turn["text"]})
        print(
            f"  turn {i + 1}: prompt {turn['prompt_tokens']}, cached {turn['cached_tokens']}, "
            f"ttft {turn['ttft_s']:.2f} s, e2e {turn['e2e_s']:.2f} s, {turn['completion_tokens']} tokens",
            flush=True,
        )
    return {"turns": turns, "session_s": time.perf_counter() - start}


def run_server(server: Any, label: str, args: argparse.Namespace, module: str) -> dict[str, Any]:
    """Warm ``server`` up, then ``--sessions`` conversations at once."""
    try:
        server.wait_ready(args.startup_timeout)
        chat_turn(server.url, [{"role": "user", "content": "Say hi."}], 4, server.peer)  # warm-up
        print(f"{label}: {args.sessions} session(s)", flush=True)
        start = time.perf_counter()
        with ThreadPoolExecutor(args.sessions) as pool:
            sessions = list(
                pool.map(lambda _: session(server.url, module, args.max_tokens, server.peer), range(args.sessions))
            )
        return {"command": shlex.join(server.command), "sessions": sessions, "wall_s": time.perf_counter() - start}
    finally:
        server.close()


def report(results: dict[str, Any]) -> str:
    """The per-turn table (first session of each server) and the totals side by side."""
    labels = list(results["servers"])
    lines = [
        f"# Multi-turn sessions, {results['date']}",
        "",
        f"machine: {bench_serve.machine_line(results['machine'])}; commit {results['commit']}",
        f"command: `{results['command']}`",
        f"module: colorsys.py (sha256 {results['module_sha256'][:12]}), {len(QUESTIONS)} turns, "
        f"{results['sessions']} session(s) at once, max_tokens {results['max_tokens']}",
        "",
        "| turn | " + " | ".join(f"{x}: prompt / cached / ttft s / e2e s / tokens" for x in labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for i in range(len(QUESTIONS)):
        cells = []
        for x in labels:
            t = results["servers"][x]["sessions"][0]["turns"][i]
            cells.append(
                f"{t['prompt_tokens']} / {t['cached_tokens']} / {t['ttft_s']:.2f} / {t['e2e_s']:.2f} / "
                f"{t['completion_tokens']}"
            )
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| server | wall s | session s (mean) | follow-up ttft s (median) | tokens | tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for x in labels:
        r = results["servers"][x]
        sessions = r["sessions"]
        follow = sorted(t["ttft_s"] for s in sessions for t in s["turns"][1:])
        tokens = sum(t["completion_tokens"] or 0 for s in sessions for t in s["turns"])
        mean = sum(s["session_s"] for s in sessions) / len(sessions)
        lines.append(
            f"| {x} | {r['wall_s']:.1f} | {mean:.1f} | {follow[len(follow) // 2]:.2f} | {tokens} | "
            f"{tokens / r['wall_s']:.2f} |"
        )
    if "peer" in results["servers"] and "specdecode" in results["servers"]:
        ours, peer = results["servers"]["specdecode"], results["servers"]["peer"]
        same = sum(
            a["text"] == b["text"]
            for a, b in zip(ours["sessions"][0]["turns"], peer["sessions"][0]["turns"], strict=True)
        )
        lines += [
            "",
            f"specdecode vs peer, wall: **{peer['wall_s'] / ours['wall_s']:.2f}x**; "
            f"turns with equal text: {same}/{len(QUESTIONS)}",
        ]
    if "uncached" in results["servers"]:
        a = results["servers"]["specdecode"]["sessions"][0]["turns"]
        b = results["servers"]["uncached"]["sessions"][0]["turns"]
        same = sum(x["text"] == y["text"] for x, y in zip(a, b, strict=True))
        lines.append(f"with vs without the prefix cache: turns with equal text {same}/{len(QUESTIONS)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=1, help="conversations at once")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--speculation", default="adaptive")
    p.add_argument("--peer", default="llama-server", choices=["llama-server", "none"])
    p.add_argument("--uncached", action="store_true", help="also our server with --no-prefix-cache")
    p.add_argument("--reuse-costs", action="store_true", help="our server loads a stored cost model")
    p.add_argument("--out", required=True)
    ours = p.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    # bench_serve's own options for its server classes: its defaults, our threads and slots
    args = bench_serve.parse_args(["--peer", ours.peer, "--max-batch-size", str(max(2, ours.sessions))])
    args.reuse_costs = ours.reuse_costs
    args.sessions, args.max_tokens = ours.sessions, ours.max_tokens
    setup = bench_serve.resolve_setup(args)
    setup["kv_budget_tokens"] = 8192 * args.max_batch_size  # a row holds the whole conversation
    out = Path(ours.out)
    out.mkdir(parents=True, exist_ok=True)
    module, digest = module_text()
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    results: dict[str, Any] = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "machine": bench_serve.machine_info(),
        "commit": commit,
        "command": shlex.join(["python", "lab/scripts/serve_sessions.py", *given]),
        "module_sha256": digest,
        "sessions": ours.sessions,
        "max_tokens": ours.max_tokens,
        "setup": setup,
        "servers": {},
    }
    print(f"machine: {bench_serve.machine_line(results['machine'])}; commit {commit}", flush=True)
    runs: list[tuple[str, Any]] = [
        ("specdecode", lambda: bench_serve.ServerProcess(args, ours.speculation, out / "server.log", setup))
    ]
    if ours.peer != "none":
        runs.append(("peer", lambda: bench_serve.PeerProcess(args, out / "peer.log", setup)))
    if ours.uncached:
        log = out / "server-uncached.log"
        runs.append(
            ("uncached", lambda: bench_serve.ServerProcess(args, ours.speculation, log, setup, ("--no-prefix-cache",)))
        )
    for label, make in runs:
        server = make()
        results["servers"][label] = run_server(server, label, args, module)
        if label == "peer":
            results["servers"][label]["version"] = server.version()
        (out / "partial.json").write_text(json.dumps(results, indent=1))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "partial.json").unlink(missing_ok=True)
    text = report(results)
    (out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
