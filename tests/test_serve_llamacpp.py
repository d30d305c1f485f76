"""``specdecode serve`` on the llamacpp backend: the real default GGUF target in one llama.cpp context
holding every running request (:class:`~specdecode.models.llamacpp.batch.LlamaCppBatchedRunner`),
through real HTTP on loopback with the ``openai`` client.

Exact mode (the default): each ``llama_decode`` carries at most ``invariant_tokens`` tokens, so
concurrent speculative requests give, token for token, what each request gets alone without
speculation on this backend; tested here, with the batched runner itself checked bit for bit
against one sequence alone (rows joining, leaving, rolling back, sharing passes).

Skipped, with the reason, when llama-cpp-python or the model packages are not installed.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from specdecode.serve.server import BackgroundServer, build_app
from test_serve import Server, extra, wait_for

from conftest import load_default_gguf, plain_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "Complete the following Python function:\n```python\ndef running_sum(xs: list[int]) -> list[int]:\n"
    '    """Return the running sums of xs: running_sum([1, 2, 3]) == [1, 3, 6]."""\n```',
    "Write a Python function that checks whether a string is a palindrome.",
    "Rewrite this with a list comprehension:\n```python\nout = []\nfor x in xs:\n    if x > 0:\n"
    "        out.append(x * x)\n```",
    "Translate to French: the cat sleeps on the warm stone.",
]
MODEL = "Qwen2.5-Coder-1.5B-Instruct"


def _load(**options):
    from specdecode.models.backends import load_llamacpp_tokenizer

    model = load_default_gguf("target", **options)
    return model, load_llamacpp_tokenizer(model)


@pytest.fixture(scope="module")
def target():
    return _load(threads=2)


@pytest.fixture(scope="module")
def server(target):
    model, tokenizer = target
    options = dict(model_name=MODEL, proposer="prompt_lookup", proposer_options={"min_ngram": 2})
    with Server(model, tokenizer, speculation="on", max_batch_size=4, kv_budget_tokens=4 * 1024, **options) as s:
        yield s


def alone(model, tokenizer, ids: list[int], n: int) -> list[int]:
    """Greedy tokens of ``ids`` decoded alone without speculation, on the same backend (once per
    prompt: conftest's ``plain_greedy``)."""
    return plain_greedy(model, ids, n, tokenizer)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text)


def test_batched_runner_rows_equal_one_sequence_alone(target) -> None:
    """Rows of one context (prefills, k + 1-token verification passes, one-token steps, a row leaving
    and the last taking its place, rollback) give logits bit-identical to one sequence decoded alone
    with the same passes: exact mode packs at most ``invariant_tokens`` tokens of any rows per pass."""
    from specdecode.models.backends import make_batched_runner

    model, _ = target
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 5000, (n,), generator=g) for n in (30, 300, 700)]  # past 512 cached tokens too
    steps = [torch.randint(0, 5000, (4,), generator=g) for _ in prompts]
    batched = make_batched_runner(model, 3, 1024)
    for _ in prompts:
        batched.add_row()
    first = batched.forward(0, prompts, [1, 1, 1])
    verify = batched.forward(0, steps, [4, 4, 4])
    batched.truncate(1, batched.lengths[1] - 2)  # row 1 rejects its last two drafts
    one = batched.forward(0, [s[:1] for s in steps], [1, 1, 1])
    assert batched.remove_row(0) == 2 and batched.lengths == [705, 303]  # row 2 takes row 0's place
    mixed = batched.forward(0, [steps[0][:2], steps[1][:3]], [2, 3])  # 5 tokens of two rows: passes of 3 + 2
    for i, prompt in enumerate(prompts):
        solo = model.make_runner(1024)
        assert torch.equal(solo.forward(prompt, 1), first[i][0:1].reshape(1, -1)), f"prefill of row {i}"
        assert torch.equal(solo.forward(steps[i], 4), verify[i]), f"verification pass of row {i}"
        if i == 1:
            solo.truncate(solo.length - 2)
        assert torch.equal(solo.forward(steps[i][:1], 1), one[i]), f"one-token pass of row {i}"
        if i == 2:
            assert torch.equal(solo.forward(steps[0][:2], 2), mixed[0])
        if i == 1:
            assert torch.equal(solo.forward(steps[1][:3], 3), mixed[1])
    assert batched.max_length == 1024
    assert batched.add_row() == 2 and batched.seq_ids == [2, 1, 0]  # the lowest free id: ids stay consecutive
    with pytest.raises(ValueError, match="exceed the 1024 a row holds"):
        batched.forward(0, [torch.zeros(400, dtype=torch.int64)], [1])
    with pytest.raises(ValueError, match="return_hidden"):
        batched.forward(0, [steps[0][:1]], [1], return_hidden=True)


def test_a_wrong_greedy_draft_stops_its_row_early() -> None:
    """With ``greedy_drafts``, a row whose split verification pass already disagrees with its draft
    stops after that pass (the verifier rejects there); the logits computed are the same, the other
    rows go on, and the row caches only the tokens decoded."""
    from specdecode.models.backends import make_batched_runner

    model = load_default_gguf("target", invariant_tokens=3)  # chunks of 3, as a build without the patch
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 5000, (n,), generator=g) for n in (40, 60)]
    steps = [torch.randint(0, 5000, (7,), generator=g) for _ in prompts]
    full, early = make_batched_runner(model, 2, 512), make_batched_runner(model, 2, 512)
    for runner in (full, early):
        runner.add_row(), runner.add_row()
        runner.forward(0, prompts, [1, 1])
    expected = full.forward(0, steps, [7, 7])
    wrong = torch.full((6,), -1, dtype=torch.int64)  # never an argmax: row 0 stops after its first pass
    got = early.forward(0, steps, [7, 7], greedy_drafts=[wrong, None])
    assert got[0].shape[0] == 3 and torch.equal(got[0], expected[0][:3])  # passes of invariant_tokens = 3
    assert torch.equal(got[1], expected[1])
    assert early.lengths == [40 + 3, 60 + 7]


def test_a_wrong_greedy_draft_stops_its_row_after_the_first_chunk_as_one_sequence_does(target) -> None:
    """On the set-up's build (passes of up to 64 tokens invariant) a greedy row's first chunk is as
    short as the single-sequence runner's (``greedy_stop_rows``): a wrong first draft token costs
    that chunk, not the whole draft; a right draft gets every row, bit for bit."""
    from specdecode.models.backends import make_batched_runner
    from specdecode.models.llamacpp.model import greedy_chunks
    from specdecode.sampling import argmax_ids

    model, _ = target
    chunk = model.options.invariant_tokens
    runner_rows = make_batched_runner(model, 2, 512)
    first = greedy_chunks(9, chunk)[0]
    assert runner_rows.capabilities.greedy_stop_rows == model.capabilities.greedy_stop_rows == first
    assert runner_rows.capabilities.greedy_stop_then == chunk
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 5000, (n,), generator=g) for n in (40, 60)]
    steps = [torch.randint(0, 5000, (9,), generator=g) for _ in prompts]
    full, early = make_batched_runner(model, 2, 512), make_batched_runner(model, 2, 512)
    for runner in (full, early):
        runner.add_row(), runner.add_row()
        runner.forward(0, prompts, [1, 1])
    solo = model.make_runner(512)  # row 1's draft: its own greedy continuation, so every row is computed
    solo.forward(prompts[1], 1)
    token, right = steps[1][:1], []
    for _ in range(8):
        token = argmax_ids(solo.forward(token, 1)[-1:]).reshape(1)
        right.append(int(token))
    steps[1] = torch.tensor([int(steps[1][0]), *right])
    expected = full.forward(0, steps, [9, 9])
    wrong = torch.full((8,), -1, dtype=torch.int64)  # never an argmax: row 0 stops after its first chunk
    got = early.forward(0, steps, [9, 9], greedy_drafts=[wrong, steps[1][1:]])
    assert got[0].shape[0] == first < 9 and torch.equal(got[0], expected[0][:first])
    assert torch.equal(got[1], expected[1]) and early.lengths == [40 + first, 60 + 9]


def test_concurrent_requests_equal_each_request_alone(server, target) -> None:
    """Four requests at once, speculating (prompt lookup) in one llama.cpp context, each give the
    greedy tokens of the request decoded alone without speculation on this backend."""
    model, tokenizer = target
    client = server.client()
    jobs = [(chat_ids(tokenizer, p), 48 + 8 * i) for i, p in enumerate(PROMPTS)]
    start = threading.Barrier(len(jobs))

    def ask(job) -> tuple[list[int], dict]:
        ids, n = job
        start.wait()
        out = client.completions.create(
            model=MODEL, prompt=ids, max_tokens=n, temperature=0, extra_body={"return_token_ids": True}
        )
        return extra(out.choices[0], "token_ids"), extra(out, "speculative")

    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(ask, jobs))
    for (ids, n), (tokens, spec) in zip(jobs, together, strict=True):
        assert tokens == alone(model, tokenizer, ids, n)
        assert spec["enabled"] and spec["proposer"] == "prompt_lookup" and spec["lossless"]
    assert sum(spec["accepted_tokens"] for _, spec in together) > 0  # speculation did happen
    shared = server.metric("specdecode_batch_size_sum") > server.metric("specdecode_batch_size_count")
    assert shared  # some steps carried several rows


def test_chat_stream_equals_the_whole_answer(server) -> None:
    client = server.client()
    messages = [{"role": "user", "content": PROMPTS[2]}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    pieces = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in pieces if chunk.choices)
    assert text == whole.choices[0].message.content and text


BAD = [
    ({"model": "gpt-4", "prompt": "hi"}, "model"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"model": MODEL, "prompt": [5] * 1100}, "prompt"),  # a row holds 1024 tokens
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2000}, "max_tokens"),  # prompt + max_tokens over a row
    ({"model": MODEL, "prompt": "hi", "proposer": "eagle"}, "proposer"),  # needs hidden states: not on this server
    ({"model": MODEL, "prompt": "hi", "proposer": "draft_model"}, "proposer"),  # no draft loaded
    ({"model": MODEL, "prompt": "hi", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"model": MODEL, "prompt": [10**7]}, "prompt"),  # outside the vocabulary
]


def test_bad_input_gets_400_naming_the_field_and_the_server_keeps_serving(server) -> None:
    for body, field in BAD:
        r = httpx.post(server.url + "/v1/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        assert field in r.json()["error"]["message"], (body, r.text)
    ok = server.client().completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_queue_full_gets_429_and_a_disconnect_frees_the_row(target) -> None:
    model, tokenizer = target
    options = dict(model_name=MODEL, proposer="prompt_lookup", max_batch_size=1, max_queue=1)
    with Server(model, tokenizer, speculation="on", kv_budget_tokens=2048, **options) as small:
        client = small.client()
        stream = client.completions.create(
            model=MODEL, prompt="def", max_tokens=1500, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = iter(stream)
        next(chunks), next(chunks)  # the only row is busy
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.completions.create, model=MODEL, prompt="for", max_tokens=3, temperature=0)
            wait_for(lambda: small.metric("specdecode_num_requests_waiting") == 1)
            with pytest.raises(openai.RateLimitError, match="max-queue"):
                client.completions.create(model=MODEL, prompt="class", max_tokens=3, temperature=0)
            stream.close()  # the client goes away mid-stream
            assert waiting.result(timeout=120).choices[0].finish_reason in ("stop", "length")
        wait_for(lambda: small.metric("specdecode_request_success_total", finished_reason="abort") == 1)
        assert small.metric("specdecode_num_requests_running") == 0
        assert small.metric("specdecode_generation_tokens_total") < 1500
        assert small.scheduler.runner.num_rows == 0 and small.scheduler.reserved == 0


def test_adaptive_server_measures_llamacpp_costs_and_stays_exact(target) -> None:
    """``--speculation adaptive`` measures the cost model on this backend's batched passes at
    start-up; its output stays that of the request alone."""
    model, tokenizer = target
    options = dict(model_name=MODEL, proposer="prompt_lookup", max_batch_size=2, kv_budget_tokens=2048)
    app, scheduler = build_app(model, tokenizer, _settings(speculation="adaptive", **options))
    with BackgroundServer(app, startup_timeout_s=600) as background:
        client = openai.OpenAI(base_url=background.url + "/v1", api_key="none", max_retries=0, timeout=300)
        ids = chat_ids(tokenizer, PROMPTS[0])
        out = client.completions.create(
            model=MODEL, prompt=ids, max_tokens=40, temperature=0, extra_body={"return_token_ids": True}
        )
    assert scheduler.cost is not None and scheduler.cost.target_s[0][0] > 0
    assert extra(out.choices[0], "token_ids") == alone(model, tokenizer, ids, 40)


def _settings(**options):
    from specdecode.serve.config import ServeSettings

    return ServeSettings(**options)
