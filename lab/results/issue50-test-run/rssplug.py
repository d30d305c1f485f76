"""Per-test log: nodeid, wall seconds (setup+call+teardown), own RSS now, own peak, children's peak (GB)."""
import os, resource, time, json
_T = {}
_OUT = open(os.environ.get("RSSLOG", "/tmp/prof/rss.jsonl"), "a", buffering=1)
def _status():
    d = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                d[k] = int(v.split()[0]) / 1e6
    return d
def pytest_runtest_logstart(nodeid, location):
    _T[nodeid] = time.perf_counter()
def pytest_runtest_logfinish(nodeid, location):
    s = _status()
    ch = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6
    _OUT.write(json.dumps({"id": nodeid, "s": round(time.perf_counter() - _T.pop(nodeid, time.perf_counter()), 2),
                           "rss": round(s.get("VmRSS", 0), 2), "hwm": round(s.get("VmHWM", 0), 2), "child": round(ch, 2)}) + "\n")
