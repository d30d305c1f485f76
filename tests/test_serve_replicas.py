"""Replicas on Ray Serve (``specdecode serve --replicas N``, :mod:`specdecode.serve.replicas`).

The fast tests need no Ray: session keys, the proxy middleware, merged metrics, the command's
checks, the error without Ray, and that nothing imports Ray unless replicas are asked for. The
slow test starts a local Ray cluster (2 CPUs, no dashboard) with two replicas of the tiny models
behind one endpoint: requests are answered by both, a conversation stays on one, each replica's
metrics are reachable, and with one replica killed mid-run the endpoint keeps answering, Ray
Serve starts a new replica, and every request the client was told succeeded is complete, right
and in the audit log. Skipped, with the reason, where Ray Serve is missing or cannot start.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdecode.commands.main import main
from specdecode.errors import MissingDependencyError
from specdecode.serve import replicas
from specdecode.serve.replicas import SessionKeyMiddleware, merge_metrics, session_key

from conftest import make_tiny_model
from reference import target_only_greedy


# ---------------------------------------------------------------------------------- no Ray needed
def test_session_key_follows_the_conversation() -> None:
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    later = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    other = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "bye"}]
    key = session_key(json.dumps({"model": "m", "messages": first}).encode())
    assert key is not None and key.startswith("chat:")
    assert session_key(json.dumps({"messages": later, "max_tokens": 3}).encode()) == key
    assert session_key(json.dumps({"messages": other}).encode()) != key
    assert session_key(json.dumps({"messages": later, "user": "ann"}).encode()) == "user:ann"
    assert session_key(json.dumps({"prompt": "def f():", "user": "bob"}).encode()) == "user:bob"
    for body in (b'{"prompt": "def f():"}', b"not json", b"[1, 2]", b'{"messages": []}', b"\xff"):
        assert session_key(body) is None


def _through(middleware_app, headers: list[tuple[bytes, bytes]], body: bytes, path: str = "/v1/chat/completions"):
    """Run one request through ``SessionKeyMiddleware`` in front of a recording app."""
    seen: dict = {}

    async def app(scope, receive, send) -> None:
        seen["headers"] = scope["headers"]
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        seen["body"] = b"".join(chunks)

    parts = [body[:5], body[5:]]
    messages = [{"type": "http.request", "body": p, "more_body": i == 0} for i, p in enumerate(parts)]

    async def receive():
        return messages.pop(0)

    async def send(message) -> None:
        pass

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    asyncio.run(middleware_app(app)(scope, receive, send))
    return seen


def test_proxy_middleware_adds_the_session_header_and_replays_the_body() -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "user": "ann"}).encode()
    seen = _through(SessionKeyMiddleware, [(b"content-type", b"application/json")], body)
    assert seen["body"] == body
    assert (b"x-session-id", b"user:ann") in seen["headers"]
    seen = _through(SessionKeyMiddleware, [(b"X-Session_ID", b"mine")], body)  # the client's own wins
    assert seen["body"] == body and [h for h in seen["headers"] if b"user:" in h[1]] == []
    seen = _through(lambda app: SessionKeyMiddleware(app, max_bytes=8), [], body)  # too large: no key
    assert seen["body"] == body and seen["headers"] == []
    seen = _through(SessionKeyMiddleware, [], body, path="/v1/models")
    assert seen["headers"] == []


def test_merged_metrics_label_every_sample_with_its_replica() -> None:
    from specdecode.serve.prometheus import ServeMetrics

    a, b = ServeMetrics(), ServeMetrics()
    a.generation_tokens.inc(3)
    b.generation_tokens.inc(5)
    b.requests.labels(endpoint="/v1/completions", status="200").inc()
    a.ttft.observe(0.2)
    text = merge_metrics({"ra": a.render().decode(), "rb": b.render().decode()})
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("specdecode_generation_tokens_total", (("replica", "ra"),))] == 3
    assert samples[("specdecode_generation_tokens_total", (("replica", "rb"),))] == 5
    key = ("specdecode_requests_total", (("endpoint", "/v1/completions"), ("replica", "rb"), ("status", "200")))
    assert samples[key] == 1
    assert samples[("specdecode_time_to_first_token_seconds_count", (("replica", "ra"),))] == 1
    assert text.count("# TYPE specdecode_generation_tokens_total counter") == 1


def test_command_checks_its_replica_flags(capsys) -> None:
    assert main(["serve", "--proposer", "prompt_lookup", "--replicas", "0"]) == 2
    assert "--replicas must be at least 1" in capsys.readouterr().err
    assert main(["serve", "--proposer", "prompt_lookup", "--ray-address", "auto"]) == 2
    assert "--ray-address needs --replicas" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--replica-cpus"):
        replicas.ReplicaConfig(num_cpus=0)


def test_config_file_builder_takes_the_flags_as_args() -> None:
    with pytest.raises(ValueError, match="bogus"):
        replicas.app_builder({"target": "/models/t", "replicas": 2, "bogus": 1})
    with pytest.raises(ValueError, match="--max-batch-size"):
        replicas.app_builder({"max_batch_size": 0})
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'specdecode[ray]')")
    app = replicas.app_builder({"target": "/models/t", "replicas": 3, "speculation": "on", "replica_cpus": 2})
    deployment = app._bound_deployment
    assert deployment.name == replicas.REPLICA_DEPLOYMENT and deployment.num_replicas == 3
    assert deployment.ray_actor_options["num_cpus"] == 2
    config = app._bound_deployment.init_args[0]
    assert config.source.target == "/models/t" and config.settings.speculation == "on"
    assert config.cost_cache_folder is None and not config.remeasure_costs  # every replica measures
    cached = replicas.app_builder({"target": "/models/t", "cost_cache_folder": "/c", "remeasure_costs": True})
    config = cached._bound_deployment.init_args[0]
    assert config.cost_cache_folder == "/c" and config.remeasure_costs


def test_without_ray_the_error_names_the_extra(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'specdecode\[ray\]'"):
        replicas.require_ray()
    assert main(["serve", "--proposer", "prompt_lookup", "--replicas", "2"]) == 2
    assert "pip install 'specdecode[ray]'" in capsys.readouterr().err


def test_a_cancelled_handler_aborts_its_request(tiny_tokenizer) -> None:
    """Ray Serve cancels a replica's handler when the client leaves (no ``http.disconnect``
    message): a non-streaming request then ends at the next step, as a disconnect does."""
    from specdecode.serve.config import ServeSettings
    from specdecode.serve.server import build_app

    target = make_tiny_model(vocab_size=len(tiny_tokenizer), seed=0)
    app, scheduler = build_app(target, tiny_tokenizer, ServeSettings(model_name="tiny", proposer=None))
    scheduler.start(thread=False)  # nothing decodes: the request waits in the queue
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4}).encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "http_version": "1.1",
        "scheme": "http",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 1234),
    }

    async def run() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # the client never says it left

        async def send(message) -> None:
            pass

        task = asyncio.create_task(app(scope, receive, send))
        for _ in range(500):
            await asyncio.sleep(0.01)
            if scheduler._waiting:
                break
        assert scheduler._waiting, "the request never reached the scheduler"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert scheduler._aborts == {scheduler._waiting[0].request_id}


def test_nothing_imports_ray_unless_replicas_are_asked_for() -> None:
    code = (
        "import sys\n"
        "from specdecode.commands.main import build_parser\n"
        "import specdecode.serve.server, specdecode.serve.app, specdecode.load, specdecode.commands.serve\n"
        "build_parser().parse_args(['serve', '--replicas', '2'])\n"
        "assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')], 'ray was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


# ---------------------------------------------------------------------------------- on Ray Serve
PROMPTS = [[5, 17, 33, 2], [40, 41, 42], [100, 7, 7, 7, 9], [60, 61], [250, 12, 99]]
MAX_TOKENS = 24
CLIENT_TIMEOUT = 30.0
REPLACEMENT_S = 180
"""Seconds a killed replica's replacement may take to answer (a fresh clone's run on 2 cores once took over 90)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(model_dirs, tiny_tokenizer, tmp_path_factory):
    """Two replicas of the tiny pair on a local Ray cluster, behind http://127.0.0.1:<port>."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'specdecode[ray]')")
    import ray
    from ray import serve

    from specdecode.load import ModelSource
    from specdecode.serve.config import ServeSettings

    target_dir, draft_dir = model_dirs
    audit = tmp_path_factory.mktemp("audit") / "replicas.jsonl"
    config = replicas.ReplicaConfig(
        source=ModelSource(target=str(target_dir), draft=str(draft_dir), dtype="float32", backend="torch"),
        settings=ServeSettings(
            proposer="draft_model", speculation="on", max_batch_size=4, request_timeout_s=60, audit_log=str(audit)
        ),
        served_model_name="tiny",
        num_cpus=0.5,
    )
    try:
        ray.init(num_cpus=2, include_dashboard=False, runtime_env=replicas.ray_runtime_env(), log_to_driver=False)
    except Exception as error:  # no shared memory, no ports, a sandbox: say why and skip
        pytest.skip(f"Ray cannot start here: {type(error).__name__}: {error}")
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        failure: list[BaseException] = []

        def deploy() -> None:
            try:
                serve.run(replicas.build_replicas_app(config, 2), name=replicas.APP_NAME, route_prefix="/")
            except BaseException as error:  # reported below
                failure.append(error)

        thread = threading.Thread(target=deploy, daemon=True)
        thread.start()
        thread.join(150)
        assert not thread.is_alive(), "the replicas did not start within 150 s"
        assert not failure, f"the replicas did not start: {failure[0]}"
        target = make_tiny_model(vocab_size=len(tiny_tokenizer), seed=0)  # the saved target's weights
        yield {"url": f"http://127.0.0.1:{port}", "audit": audit, "target": target, "ray": ray}
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _reference(target, prompt: list[int]) -> list[int]:
    return target_only_greedy(target, prompt, MAX_TOKENS)


def _complete(url: str, prompt: list[int], **extra) -> tuple[str | None, list[int] | None, str | None]:
    """One non-streaming completion: ``(replica, token ids, request id)``, ids None on any failure."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    body.update(ignore_eos=True, return_token_ids=True, **extra)
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT)
    except httpx.HTTPError:
        return None, None, None
    if r.status_code != 200:
        return r.headers.get(replicas.REPLICA_HEADER), None, None
    out = r.json()
    choice = out["choices"][0]
    if choice["finish_reason"] != "length":
        return r.headers.get(replicas.REPLICA_HEADER), None, None
    return r.headers.get(replicas.REPLICA_HEADER), choice["token_ids"], out["id"]


def _stream(url: str, prompt: list[int]) -> tuple[str | None, list[int] | None, str | None]:
    """One streamed completion, successful only if it ends with a finish_reason and ``[DONE]``."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    body.update(ignore_eos=True, return_token_ids=True)
    ids: list[int] = []
    finish, done, replica, request_id = None, False, None, None
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT) as r:
            replica = r.headers.get(replicas.REPLICA_HEADER)
            if r.status_code != 200:
                return replica, None, None
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return replica, None, None
                    request_id = chunk["id"]
                    for choice in chunk["choices"]:
                        ids += choice.get("token_ids") or []
                        finish = choice.get("finish_reason") or finish
    except (httpx.HTTPError, json.JSONDecodeError):
        return replica, None, None
    if not done or finish != "length":
        return replica, None, None
    return replica, ids, request_id


@pytest.mark.slow
def test_two_replicas_behind_one_endpoint(cluster) -> None:
    url, target = cluster["url"], cluster["target"]
    expected = {tuple(p): _reference(target, p) for p in PROMPTS}
    answered: dict[str, int] = {}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: _complete(url, PROMPTS[i % len(PROMPTS)]), range(24)))
    for i, (replica, ids, _) in enumerate(results):
        assert ids == expected[tuple(PROMPTS[i % len(PROMPTS)])], f"request {i} on {replica}"
        answered[replica] = answered.get(replica, 0) + 1
    assert len(answered) == 2, f"24 requests without a session key went to {answered}"
    replica, ids, _ = _stream(url, PROMPTS[0])
    assert replica in answered and ids == expected[tuple(PROMPTS[0])]

    # a conversation stays on one replica: by user, by X-Session-Id, by its first messages
    assert len({_complete(url, PROMPTS[i % 5], user="ann")[0] for i in range(6)}) == 1
    by_header = set()
    for i in range(6):
        body = {"model": "tiny", "prompt": PROMPTS[i % 5], "max_tokens": 2, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, headers={"X-Session-Id": "s-42"}, timeout=CLIENT_TIMEOUT)
        assert r.status_code == 200
        by_header.add(r.headers[replicas.REPLICA_HEADER])
    assert len(by_header) == 1
    turns = [{"role": "system", "content": "short answers"}, {"role": "user", "content": "def add(a, b):"}]
    chat_replicas = set()
    for turn in range(3):
        body = {"model": "tiny", "messages": turns, "max_tokens": 4, "temperature": 0}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT)
        assert r.status_code == 200, r.text
        chat_replicas.add(r.headers[replicas.REPLICA_HEADER])
        turns += [r.json()["choices"][0]["message"], {"role": "user", "content": f"and then {turn}?"}]
    assert len(chat_replicas) == 1

    # each replica's metrics: listed, merged with a replica label, and one by one
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        listed = {r["replica"] for r in httpx.get(url + "/replicas", timeout=CLIENT_TIMEOUT).json()["data"]}
        if listed >= set(answered):
            break
        time.sleep(0.5)
    assert listed >= set(answered)
    time.sleep(replicas.METRICS_PUSH_INTERVAL_S * 2)  # the last requests' counts reach the board
    merged = httpx.get(url + "/replicas/metrics", timeout=CLIENT_TIMEOUT).text
    generated = {
        s.labels["replica"]: s.value
        for family in text_string_to_metric_families(merged)
        for s in family.samples
        if s.name == "specdecode_generation_tokens_total"
    }
    assert set(generated) >= set(answered) and all(generated[r] >= MAX_TOKENS for r in answered)
    for replica in answered:
        r = httpx.get(f"{url}/replicas/{replica}/metrics", timeout=CLIENT_TIMEOUT)
        assert r.status_code == 200 and "specdecode_num_requests_running" in r.text
    assert httpx.get(f"{url}/replicas/nobody/metrics", timeout=CLIENT_TIMEOUT).status_code == 404


@pytest.mark.slow
def test_a_killed_replica_is_replaced_and_nothing_told_succeeded_is_lost(cluster) -> None:
    url, target, ray = cluster["url"], cluster["target"], cluster["ray"]
    expected = {tuple(p): _reference(target, p) for p in PROMPTS}
    before = {r["replica"]: r for r in httpx.get(url + "/replicas", timeout=CLIENT_TIMEOUT).json()["data"]}
    assert len(before) == 2
    results: list[tuple[float, str | None, list[int] | None, str | None, list[int]]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(worker: int) -> None:
        i = worker
        while not stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            replica, ids, request_id = (_stream if i % 2 else _complete)(url, prompt)
            with lock:
                results.append((time.monotonic(), replica, ids, request_id, prompt))
            i += 4

    workers = [threading.Thread(target=client, args=(w,), daemon=True) for w in range(4)]
    for w in workers:
        w.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len({r[1] for r in results if r[2] is not None}) < 2:
            time.sleep(0.2)
        victim = sorted(before)[0]
        ray.kill(ray.get_actor(before[victim]["actor_name"], namespace="serve"), no_restart=True)
        killed_at = time.monotonic()
        # the new replica is a new process (torch, the models) started from this worker at nice 10,
        # beside the real-model worker's llama.cpp passes at full priority on 2 cores: give it time
        deadline = killed_at + REPLACEMENT_S
        new: set[str] = set()
        while time.monotonic() < deadline:
            with lock:
                after = [r for r in results if r[0] > killed_at and r[2] is not None]
            new = {r[1] for r in after} - set(before)
            if new and len(after) >= 20:
                break
            time.sleep(0.5)
    finally:
        stop.set()
        for w in workers:
            w.join(CLIENT_TIMEOUT + 5)
    succeeded = [r for r in results if r[2] is not None]
    failed = [r for r in results if r[2] is None]
    after = [r for r in succeeded if r[0] > killed_at]
    print(f"{len(succeeded)} succeeded ({len(after)} after the kill), {len(failed)} failed; new replica {new}")
    assert new, f"no new replica answered within {REPLACEMENT_S} s of the kill ({len(after)} answers after it)"
    assert len(after) >= 20, "the endpoint stopped answering after the kill"
    assert victim not in {r[1] for r in after if r[0] > killed_at + 15}
    for _, replica, ids, _, prompt in succeeded:  # what the client was told succeeded is whole and right
        assert ids == expected[tuple(prompt)], f"a success from {replica} differs from greedy decoding"
    audited = {json.loads(line)["request_id"] for line in cluster["audit"].read_text().splitlines()}
    missing = [r[3] for r in succeeded if r[3] not in audited]
    assert missing == [], f"{len(missing)} successful requests are not in the audit log"
    assert os.path.getsize(cluster["audit"]) > 0
