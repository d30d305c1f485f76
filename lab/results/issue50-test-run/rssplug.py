"""Per-test log for pytest (``-p rssplug`` with this folder on PYTHONPATH): one JSON line per test with
its id, wall seconds (set-up, call and teardown), the process's RSS and peak RSS after it (VmRSS,
VmHWM) and the largest child's peak, in GB. Output: ``$RSSLOG`` (default /tmp/prof/rss.jsonl)."""

from __future__ import annotations

import json
import os
import resource
import time

_STARTED: dict[str, float] = {}
_OUT = open(os.environ.get("RSSLOG", "/tmp/prof/rss.jsonl"), "a", buffering=1)  # noqa: SIM115 (open for the run)


def _status() -> dict[str, float]:
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                found[key] = int(value.split()[0]) / 1e6
    return found


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    _STARTED[nodeid] = time.perf_counter()


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    status = _status()
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6
    seconds = time.perf_counter() - _STARTED.pop(nodeid, time.perf_counter())
    row = {"id": nodeid, "s": round(seconds, 2), "rss": round(status.get("VmRSS", 0), 2),
           "hwm": round(status.get("VmHWM", 0), 2), "child": round(child, 2)}  # fmt: skip
    _OUT.write(json.dumps(row) + "\n")
