#!/usr/bin/env python
"""Two ``specdecode serve`` processes side by side, in alternating rounds (a script, not a test).

Starts one server per entry of ``--modes`` (the same mode twice is allowed: two identical
servers), then for ``--rounds`` rounds sends each server, in an order that flips every round, the
same ``--requests`` chats at concurrency ``--requests`` (greedy, ``--max-tokens`` tokens,
``ignore_eos``), and prints per server and round: throughput, TPOT p50 and the mean time per decode
step of each phase from ``/metrics`` (``specdecode_step_phase_seconds``). Two identical servers
show how much two processes of the same code differ on this machine; that is the noise floor of
any comparison between servers. Uses the server handling of ``lab/scripts/bench_serve.py``.

Example (what lab/notebook/2026-11-22-serve-load.md quotes)::

    python lab/scripts/serve_side_by_side.py --modes off,off
    python lab/scripts/serve_side_by_side.py --modes off,adaptive
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serve  # noqa: E402  (the sibling script)


def main(argv: list[str] | None = None) -> int:
    import openai

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="off,off", help="comma list of --speculation modes, one server each")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=2, help="requests per round, all at once")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default="bench-results/side-by-side", help="folder for the server logs")
    args, rest = p.parse_known_args(argv)
    serve_args = bench_serve.parse_args(rest)  # --target, --draft, --dtype, --proposer, -k, ...
    modes = [m.strip() for m in args.modes.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chats = bench_serve.load_chats(serve_args, args.requests)
    servers: list[tuple[str, bench_serve.ServerProcess]] = []
    try:
        for i, mode in enumerate(modes):
            server = bench_serve.ServerProcess(serve_args, mode, out / f"server-{i}-{mode}.log")
            server.wait_ready(serve_args.startup_timeout)
            bench_serve.one_request(openai.OpenAI(base_url=server.url + "/v1", api_key="none"), chats[0], 8)
            servers.append((f"{i}:{mode}", server))
        for r in range(args.rounds):
            for name, server in servers if r % 2 == 0 else servers[::-1]:
                level = bench_serve.run_level(server, chats, args.requests, args.max_tokens)
                phases = " ".join(f"{k} {v:.1f}" for k, v in level["phase_ms"].items())
                print(
                    f"round {r} server {name}: {level['tokens_per_s']:.2f} tok/s, TPOT p50 "
                    f"{level['tpot_s']['p50'] * 1e3:.0f} ms; ms per step: {phases}",
                    flush=True,
                )
    finally:
        for _, server in servers:
            server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
