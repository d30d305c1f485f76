"""``specdecode serve`` through real HTTP: servers on free loopback ports (uvicorn in a thread), the
official ``openai`` client and plain ``httpx``, tiny float32 models."""

from __future__ import annotations

import copy
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdecode.commands.main import main
from specdecode.serve.config import ServeSettings
from specdecode.serve.server import BackgroundServer, build_app

from conftest import make_tiny_model
from reference import target_only_greedy

PROMPTS = ["def add(a, b):", "for i in range(10):", "The quick brown fox", "class Stack:", "def is_prime(n):"]


@pytest.fixture(scope="module")
def long_target(chat_models):
    """The target with a long context, so that a generation can outlast a disconnect or a timeout."""
    model = copy.deepcopy(chat_models[0])
    model.config.max_position_embeddings = 8192  # rotary positions: any length works
    return model


class Server:
    def __init__(self, target, tokenizer, draft=None, **options) -> None:
        self.settings = ServeSettings(**{"model_name": "tiny", **options})
        self.app, self.scheduler = build_app(target, tokenizer, self.settings, draft=draft)
        self.background = BackgroundServer(self.app)

    def __enter__(self) -> Server:
        self.background.__enter__()
        self.url = self.background.url
        return self

    def __exit__(self, *exc) -> None:
        self.background.__exit__(*exc)

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return 0.0


@pytest.fixture(scope="module")
def server(chat_models, tiny_tokenizer, tmp_path_factory):
    audit = tmp_path_factory.mktemp("audit") / "main.jsonl"
    target, draft = chat_models
    with Server(target, tiny_tokenizer, draft, speculation="on", max_batch_size=4, audit_log=str(audit)) as s:
        yield s


@pytest.fixture(scope="module")
def adaptive(chat_models, tiny_tokenizer):
    """Adaptive speculation with the cost model measured at start-up."""
    target, draft = chat_models
    with Server(target, tiny_tokenizer, draft, speculation="adaptive", max_batch_size=4) as s:
        yield s


@pytest.fixture(scope="module")
def keyed(long_target, tiny_tokenizer, tmp_path_factory):
    audit = tmp_path_factory.mktemp("audit") / "keyed.jsonl"
    with Server(
        long_target,
        tiny_tokenizer,
        proposer="prompt_lookup",
        api_key="s3cret",
        max_body_bytes=2000,
        request_timeout_s=0.3,
        audit_log=str(audit),
        audit_log_prompts=True,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def small(long_target, tiny_tokenizer):
    """One row, one waiting place."""
    with Server(long_target, tiny_tokenizer, proposer="prompt_lookup", max_batch_size=1, max_queue=1) as s:
        yield s


@pytest.fixture(scope="module")
def plain(chat_models, tiny_tokenizer):
    """No draft and no default proposer: the target alone unless a request names a proposer."""
    with Server(chat_models[0], tiny_tokenizer, proposer=None, speculation="on", max_batch_size=2) as s:
        yield s


def greedy_reference(target, tokenizer, prompt_ids: list[int], n: int) -> list[int]:
    out = target_only_greedy(target, prompt_ids, n)
    eos = tokenizer.eos_token_id
    return out[: out.index(eos) + 1] if eos in out else out


def extra(obj, name: str):
    return (obj.model_extra or {}).get(name)


# ---------------------------------------------------------------------------------- endpoints
def test_models_health_and_metrics(server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert "draft_model" in extra(models.data[0], "proposers")
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    text = httpx.get(server.url + "/metrics").text
    for name in ("specdecode_num_requests_waiting", "specdecode_time_to_first_token_seconds"):
        assert name in text


def test_completion_equals_target_only_greedy(server, chat_models, tiny_tokenizer) -> None:
    ids = tiny_tokenizer.encode(PROMPTS[0])
    out = server.client().completions.create(
        model="tiny",
        prompt=ids,
        max_tokens=24,
        temperature=0,
        extra_body={"return_token_ids": True, "num_speculative_tokens": 3},
    )
    choice = out.choices[0]
    assert extra(choice, "token_ids") == greedy_reference(chat_models[0], tiny_tokenizer, ids, 24)
    assert choice.text == tiny_tokenizer.decode(extra(choice, "token_ids"), skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(extra(choice, "token_ids"))
    spec = extra(out, "speculative")
    assert spec["enabled"] is True and spec["proposer"] == "draft_model" and spec["num_speculative_tokens"] == 3
    assert spec["lossless"] is True and spec["draft_tokens"] > 0
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["drafts"])


def test_speculative_false_and_other_proposers_give_the_same_text(server) -> None:
    client = server.client()
    texts = {}
    for options in ({"speculative": False}, {}, {"proposer": "prompt_lookup"}, {"num_speculative_tokens": 1}):
        out = client.completions.create(
            model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=0, extra_body=options
        )
        spec = extra(out, "speculative")
        texts[json.dumps(options)] = out.choices[0].text
        if options.get("speculative") is False:
            assert spec["enabled"] is False and spec["draft_tokens"] == 0 and spec["proposer"] is None
        else:
            assert spec["proposer"] == options.get("proposer", "draft_model")
            default = 8 if options.get("proposer") == "prompt_lookup" else 4  # the proposer's own default k
            assert spec["num_speculative_tokens"] == options.get("num_speculative_tokens", default)
    assert len(set(texts.values())) == 1


def test_chat_completion_and_its_stream(server) -> None:
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert extra(whole, "speculative")["lossless"] is True
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert extra(chunks[-1], "speculative")["draft_tokens"] == extra(whole, "speculative")["draft_tokens"]


def test_completion_stream_is_openai_sse(server) -> None:
    client = server.client()
    whole = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=16, temperature=0)
    pieces = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == whole.choices[0].text
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_sampling_with_a_seed_is_reproducible(server) -> None:
    client = server.client()
    runs = [
        client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=16, temperature=0.9, top_p=0.95, seed=11)
        for _ in range(2)
    ]
    assert runs[0].choices[0].text == runs[1].choices[0].text


# ---------------------------------------------------------------------------------- batching
def test_concurrent_requests_equal_each_request_alone(adaptive, chat_models, tiny_tokenizer) -> None:
    client = adaptive.client()
    jobs = [(p, 10 + 4 * i, 1 + i % 4) for i, p in enumerate(PROMPTS + PROMPTS[:3])]
    start = threading.Barrier(len(jobs))

    def ask(job, speculative: bool = True, wait: bool = True) -> list[int]:
        prompt, n, k = job
        if wait:
            start.wait()
        out = client.completions.create(
            model="tiny",
            prompt=tiny_tokenizer.encode(prompt),
            max_tokens=n,
            temperature=0,
            extra_body={"return_token_ids": True, "num_speculative_tokens": k, "speculative": speculative},
        )
        return extra(out.choices[0], "token_ids")

    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(ask, jobs))
    for job, tokens in zip(jobs, together, strict=True):
        assert tokens == ask(job, speculative=False, wait=False)
        assert tokens == greedy_reference(chat_models[0], tiny_tokenizer, tiny_tokenizer.encode(job[0]), job[1])
    assert adaptive.metric("specdecode_batch_size_count") > 0
    assert adaptive.scheduler.cost is not None and adaptive.scheduler.cost.target_s[0][0] > 0


def test_per_request_speculation_mode_on_an_adaptive_server(adaptive, chat_models, tiny_tokenizer) -> None:
    ids = tiny_tokenizer.encode(PROMPTS[2])
    want = greedy_reference(chat_models[0], tiny_tokenizer, ids, 16)
    for mode in ("on", "off", "adaptive"):
        out = adaptive.client().completions.create(
            model="tiny",
            prompt=ids,
            max_tokens=16,
            temperature=0,
            extra_body={"return_token_ids": True, "speculation": mode},
        )
        assert extra(out.choices[0], "token_ids") == want
        spec = extra(out, "speculative")
        assert spec["mode"] == mode and spec["enabled"] is (mode != "off")
        if mode == "on":
            assert spec["drafts"] == spec["target_forward_passes"] - 1  # drafted every step after the prefill
        if mode == "off":
            assert spec["draft_tokens"] == 0


def test_a_server_without_a_proposer(plain, chat_models, tiny_tokenizer) -> None:
    ids = tiny_tokenizer.encode(PROMPTS[3])
    want = greedy_reference(chat_models[0], tiny_tokenizer, ids, 8)
    body = {"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    out = httpx.post(plain.url + "/v1/completions", json=body).json()
    assert out["choices"][0]["token_ids"] == want
    assert out["speculative"]["enabled"] is False and out["speculative"]["mode"] == "off"
    for ask, field in (({"speculative": True}, "speculative"), ({"speculation": "on"}, "speculation")):
        r = httpx.post(plain.url + "/v1/completions", json={**body, **ask})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field and "no proposer" in error["message"], error
    r = httpx.post(plain.url + "/v1/completions", json={**body, "proposer": "draft_model"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "proposer"  # needs a draft: none loaded
    named = httpx.post(plain.url + "/v1/completions", json={**body, "proposer": "prompt_lookup"}).json()
    assert named["choices"][0]["token_ids"] == want  # a proposer without a model still works
    assert named["speculative"]["enabled"] is True and named["speculative"]["proposer"] == "prompt_lookup"
    assert httpx.post(plain.url + "/v1/completions", json=body).json()["choices"][0]["token_ids"] == want


# ---------------------------------------------------------------------------------- robustness
BAD = [
    ({"model": "gpt-4", "prompt": "hi"}, "model"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"model": "tiny", "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": "tiny", "prompt": [5] * 600}, "prompt"),
    ({"model": "tiny", "prompt": "hi", "n": 2}, "n"),
    ({"model": "tiny", "prompt": "hi", "proposer": "nope"}, "proposer"),
    ({"model": "tiny", "prompt": "hi", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"model": "tiny", "prompt": "hi", "stop": [""]}, "stop"),
    ({"model": "tiny", "prompt": "hi", "logprobs": 21}, "logprobs"),  # 0 .. 20 (test_serve_logprobs.py)
    ({"model": "tiny", "prompt": "hi", "max_tokens": 100_000}, "max_tokens"),
    ({"model": "tiny"}, "prompt"),
    ({"model": "tiny", "prompt": ""}, "prompt"),
    ({"model": "tiny", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "tiny", "prompt": "hi", "speculation": "always"}, "speculation"),
    ({"model": "tiny", "prompt": "hi", "speculation": "on", "speculative": False}, "speculation"),
    ({"model": "tiny", "prompt": "hi", "speculation": "adaptive"}, "speculation"),  # the server runs "on"
]


def test_bad_input_gets_400_naming_the_field_and_the_server_keeps_serving(server) -> None:
    for body, field in BAD:
        r = httpx.post(server.url + "/v1/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert field in error["message"], (body, error)
        assert error["type"] == "invalid_request_error"
    chat = {"model": "tiny", "messages": [], "max_tokens": 3}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={**chat, "messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and "messages.0.role" in r.json()["error"]["message"]
    for raw in (b"{not json", b"[1, 2]", b""):
        r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, raw
    assert (
        "JSON"
        in httpx.post(
            server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        ).json()["error"]["message"]
    )
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client().completions.create(model="tiny", prompt="hi", temperature=-1)
    ok = server.client().completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_api_key_body_limit_and_timeout(keyed) -> None:
    body = {"model": "tiny", "prompt": "def", "max_tokens": 3, "temperature": 0}
    assert httpx.post(keyed.url + "/v1/completions", json=body).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.post(keyed.url + "/v1/completions", json=body, headers=wrong).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        keyed.client("wrong").models.list()
    assert keyed.client("s3cret").completions.create(**body).choices[0].text is not None
    assert httpx.get(keyed.url + "/health").status_code == 200  # open without a key
    assert httpx.get(keyed.url + "/metrics").status_code == 200
    key = {"Authorization": "Bearer s3cret"}
    big = {**body, "prompt": "x" * 5000}
    r = httpx.post(keyed.url + "/v1/completions", json=big, headers=key)
    assert r.status_code == 413 and "2000 bytes" in r.json()["error"]["message"]
    long = {**body, "max_tokens": 7000, "ignore_eos": True}
    r = httpx.post(keyed.url + "/v1/completions", json=long, headers=key, timeout=60)
    assert r.status_code == 504 and "timeout" in r.json()["error"]["message"]
    assert httpx.post(keyed.url + "/v1/completions", json=body, headers=key).status_code == 200
    record = [json.loads(line) for line in open(keyed.settings.audit_log)]
    assert {r["finish_reason"] for r in record} >= {"timeout", "length"}
    assert all(r["prompt"] == "def" for r in record)  # --audit-log-prompts


def wait_for(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_queue_full_gets_429_and_a_disconnect_frees_the_slot(small) -> None:
    client = small.client()
    stream = client.completions.create(
        model="tiny", prompt="def", max_tokens=7000, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    next(chunks), next(chunks)  # the only row is busy
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.completions.create, model="tiny", prompt="for", max_tokens=3, temperature=0)
        wait_for(lambda: small.metric("specdecode_num_requests_waiting") == 1)
        with pytest.raises(openai.RateLimitError, match="max-queue"):
            client.completions.create(model="tiny", prompt="class", max_tokens=3, temperature=0)
        stream.close()  # the client goes away mid-stream
        assert waiting.result(timeout=60).choices[0].finish_reason in ("stop", "length")
    wait_for(lambda: small.metric("specdecode_request_success_total", finished_reason="abort") == 1)
    assert small.metric("specdecode_num_requests_running") == 0
    assert small.metric("specdecode_generation_tokens_total") < 7000


# ---------------------------------------------------------------------------------- records
def test_audit_log_records_each_request_without_its_prompt(server) -> None:
    out = server.client().completions.create(
        model="tiny",
        prompt="class Stack:",
        max_tokens=5,
        temperature=0,
        seed=3,
        extra_body={"proposer": "prompt_lookup"},
    )
    lines = open(server.settings.audit_log).read().splitlines()
    records = [json.loads(line) for line in lines]
    mine = [r for r in records if r["request_id"] == out.id]
    assert len(mine) == 1
    r = mine[0]
    assert r["status"] == "finished" and r["endpoint"] == "/v1/completions"
    assert r["created"] <= r["started"] <= r["first_token"] <= r["finished"]
    assert (
        r["settings"]["seed"] == 3 and r["settings"]["max_tokens"] == 5 and r["settings"]["proposer"] == "prompt_lookup"
    )
    assert r["settings"]["speculation_mode"] == "on" and r["created_iso"].endswith("Z")
    assert r["speculative"] == extra(out, "speculative")
    assert r["usage"]["completion_tokens"] == out.usage.completion_tokens
    assert all("prompt" not in r for r in records)
    assert "class Stack" not in "".join(lines)


def test_metrics_count_requests_tokens_and_speculation(server) -> None:
    names = [
        "specdecode_spec_decode_num_drafts_total",
        "specdecode_spec_decode_num_draft_tokens_total",
        "specdecode_spec_decode_num_accepted_tokens_total",
        "specdecode_generation_tokens_total",
        "specdecode_time_to_first_token_seconds_count",
        "specdecode_e2e_request_latency_seconds_count",
        "specdecode_time_per_output_token_seconds_count",
    ]
    phases = ("plan", "draft", "target", "verify", "step", "prefill")
    phase_names = ("specdecode_step_phase_seconds_count", "specdecode_step_phase_seconds_sum")
    phases_before = {(n, p): server.metric(n, phase=p) for n in phase_names for p in phases}
    steps_before = server.metric("specdecode_decode_steps_total")
    before = {n: server.metric(n) for n in names}
    per_pos = [
        server.metric("specdecode_spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(4)
    ]
    ok = {"endpoint": "/v1/completions", "status": "200"}
    requests_before = server.metric("specdecode_requests_total", **ok)
    out = server.client().completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=30, temperature=0)
    spec = extra(out, "speculative")
    delta = {n: server.metric(n) - before[n] for n in names}
    assert delta["specdecode_spec_decode_num_drafts_total"] == spec["drafts"] > 0
    assert delta["specdecode_spec_decode_num_draft_tokens_total"] == spec["draft_tokens"]
    assert delta["specdecode_spec_decode_num_accepted_tokens_total"] == spec["accepted_tokens"]
    assert delta["specdecode_generation_tokens_total"] == out.usage.completion_tokens
    assert delta["specdecode_time_to_first_token_seconds_count"] == 1
    assert delta["specdecode_e2e_request_latency_seconds_count"] == 1
    assert delta["specdecode_time_per_output_token_seconds_count"] == 1
    per_pos_after = [
        server.metric("specdecode_spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(4)
    ]
    assert sum(per_pos_after) - sum(per_pos) == spec["accepted_tokens"]
    assert server.metric("specdecode_requests_total", **ok) == requests_before + 1
    # every decode step is timed once per phase; one prefill pass; the phases add up to the step
    steps = server.metric("specdecode_decode_steps_total") - steps_before
    count, total = ({p: server.metric(n, phase=p) - phases_before[n, p] for p in phases} for n in phase_names)
    assert steps > 0 and all(count[p] == steps for p in phases if p != "prefill") and count["prefill"] == 1
    parts = sum(total[p] for p in ("plan", "draft", "target", "verify"))
    assert total["draft"] > 0 and total["target"] > 0 and parts == pytest.approx(total["step"], rel=1e-6)


# ---------------------------------------------------------------------------------- CLI
def test_serve_cli_checks_flags_before_loading_models(capsys) -> None:
    assert main(["serve", "--max-batch-size", "0", "--target", "/no/such/model"]) == 2
    assert "--max-batch-size" in capsys.readouterr().err
    assert main(["serve", "--request-timeout", "0", "--target", "/no/such/model"]) == 2
    assert "--request-timeout" in capsys.readouterr().err
    assert main(["serve", "--target", "/no/such/model"]) == 2
    assert "--target" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--speculation", "sometimes"])


def test_serve_cli_with_a_draft_of_another_vocabulary_answers_a_chat(tiny_tokenizer, tmp_path, monkeypatch, capsys):
    """``specdecode serve --draft smollm2`` (README) through the real entry point, with a tiny target
    and a tiny draft of another tokenizer in its place: the command switches to ``cross_tokenizer``,
    builds the app and answers a chat request (the same text as the target alone)."""
    import uvicorn
    from fastapi.testclient import TestClient

    from conftest import make_tiny_tokenizer

    draft_tokenizer = make_tiny_tokenizer(vocab_size=len(tiny_tokenizer) + 24)  # more merges: another vocabulary
    target_dir, draft_dir = tmp_path / "target", tmp_path / "draft"
    for folder, tokenizer, seed in ((target_dir, tiny_tokenizer, 0), (draft_dir, draft_tokenizer, 3)):
        make_tiny_model(vocab_size=len(tokenizer), seed=seed).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    from specdecode.serve.scheduler import Scheduler

    served: dict = {}
    events: list[str] = []
    calibrate = Scheduler.calibrate
    monkeypatch.setattr(Scheduler, "calibrate", lambda self: events.append("cost model") or calibrate(self))
    monkeypatch.setattr(
        uvicorn, "run", lambda app, **options: events.append("uvicorn") or served.update(app=app, **options)
    )
    assert main(["serve", "--target", str(target_dir), "--draft", str(draft_dir), "--dtype", "float32"]) == 0
    assert events == ["cost model", "uvicorn"]  # measured before uvicorn installs its SIGTERM handler
    assert "using --proposer cross_tokenizer" in capsys.readouterr().err
    assert served["port"] == 8000
    with TestClient(served["app"]) as client:
        card = client.get("/v1/models").json()["data"][0]
        assert card["id"] == "target" and card["default_proposer"] == "cross_tokenizer"
        assert "cross_tokenizer" in card["proposers"] and "draft_model" not in card["proposers"]
        answers = {}
        for mode in ("on", "off", None):  # None: the server's own (adaptive), as a client that asks nothing
            body = {"model": "target", "messages": [{"role": "user", "content": "def add(a, b):"}],
                    "max_tokens": 12, "temperature": 0, **({"speculation": mode} if mode else {})}  # fmt: skip
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            answers[mode] = response.json()
        assert answers["on"]["speculative"]["proposer"] == "cross_tokenizer"
        assert answers["on"]["speculative"]["draft_tokens"] > 0
        texts = {mode: a["choices"][0]["message"]["content"] for mode, a in answers.items()}
        assert texts["on"] == texts["off"] == texts[None]  # lossless: the target's own greedy text


def test_the_k_of_a_request() -> None:
    """The request's k, else the server's -k, else the proposer's own default (with the server's
    options for its own proposer: prompt lookup first drafts 8)."""
    plain = ServeSettings(model_name="tiny")
    assert plain.k_for("draft_model") == plain.k_for("suffix") == plain.k_for(None) == 4
    assert plain.k_for("prompt_lookup") == 8  # its draft length follows the match (max_spec_factor)
    assert plain.k_for("eagle") == plain.k_for("medusa") == 2 and plain.k_for("eagle", 5) == 5
    assert ServeSettings(model_name="tiny", num_speculative_tokens=3).k_for("eagle") == 3
    hybrid = ServeSettings(model_name="tiny", proposer="eagle", proposer_options={"prompt_lookup_min": 2})
    assert hybrid.k_for("eagle") == 8 and hybrid.k_for("medusa") == 2
    with pytest.raises(ValueError, match="--num-speculative-tokens must be an integer in"):
        ServeSettings(model_name="tiny", num_speculative_tokens=0)


def test_a_closed_server_frees_its_models(chat_models, tiny_tokenizer) -> None:
    """After a server has answered and closed, nothing keeps its models alive once the caller lets
    go: FastAPI keeps every endpoint it has called in module-level caches, so routes reach the
    scheduler weakly (``create_app``); before, each closed server held its models for good (the
    test run kept three GGUF models, ~3.5 GB, past their tests this way)."""
    import gc
    import weakref

    target = copy.deepcopy(chat_models[0])
    gone = weakref.ref(target)
    with Server(target, tiny_tokenizer, proposer="prompt_lookup", max_batch_size=1) as server:
        client = server.client()
        out = client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=4, temperature=0)
        assert out.choices[0].text is not None
        assert httpx.get(server.url + "/health").status_code == 200
        client.close()
    del server, client, target
    gc.collect()
    assert gone() is None


def test_a_lone_surrogate_gets_a_400_naming_the_field(server) -> None:
    """Valid JSON, no UTF-8: a clear 400 naming ``messages`` / ``prompt``, and the server goes on."""
    body = '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    json_type = {"content-type": "application/json"}
    response = httpx.post(server.url + "/v1/chat/completions", content=body, headers=json_type)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages", response.text
    body = '{"model": "tiny", "max_tokens": 2, "prompt": "\\udfff"}'
    response = httpx.post(server.url + "/v1/completions", content=body, headers=json_type)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    assert server.client().completions.create(model="tiny", prompt="def", max_tokens=2).choices[0].text is not None


def test_an_unexpected_error_answers_openais_error_json(server, monkeypatch) -> None:
    """A bug in a route: 500 with OpenAI's error JSON and an id that the logged traceback carries."""
    from specdecode.serve import app as app_module

    def broken(*args, **kwargs):
        raise TypeError("a bug")

    monkeypatch.setattr(app_module, "chat_template_messages", broken)
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(server.url + "/v1/chat/completions", json=body)
    error = response.json()["error"]
    assert response.status_code == 500 and error["type"] == "server_error" and error["code"].startswith("err-")
    assert "TypeError: a bug" in error["message"]
