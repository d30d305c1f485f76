"""Admission (:mod:`specdecode.serve.admission`): one object checks every request, once, with the
messages the server always gave; the proposers a server runs are found once, at start; and the range
of k is written in one module only (:mod:`specdecode.limits`)."""

from __future__ import annotations

import copy
import itertools
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import specdecode.drafters
import specdecode.drafters.heads
import specdecode.serve.admission as admission_module
from specdecode.cost.serve_model import CostModel
from specdecode.limits import MAX_SPECULATIVE_TOKENS, MIN_SPECULATIVE_TOKENS, check_num_speculative_tokens
from specdecode.sampling import SamplingParams
from specdecode.serve.admission import Admission
from specdecode.serve.config import ServeSettings
from specdecode.serve.request import InvalidRequestError, ServeRequest
from specdecode.serve.scheduler import Scheduler
from specdecode.serve.server import build_app

FLAT = CostModel([1, 8], [1, 9], [[1.0, 1.0], [1.0, 1.0]])
SRC = Path(__file__).resolve().parents[1] / "src" / "specdecode"
_ids = itertools.count()


@pytest.fixture
def no_drafters(tmp_path, monkeypatch):
    """An empty cache: no trained drafter is found for the tiny target."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "empty"))


def request(prompt: list[int] | None = None, max_tokens: int = 5, **options) -> ServeRequest:
    speculative = options.pop("speculative", True)
    return ServeRequest(
        request_id=f"adm-{next(_ids)}",
        prompt_ids=[5, 6, 7] if prompt is None else prompt,
        sampling=SamplingParams(max_new_tokens=max_tokens),
        speculative=speculative,
        proposer=options.pop("proposer", "draft_model") if speculative else None,
        num_speculative_tokens=options.pop("k", 3),
        on_event=lambda event: None,
        **options,
    )


def scheduler_for(chat_models, tokenizer, **options) -> Scheduler:
    target, draft = chat_models
    settings = ServeSettings(**{"model_name": "tiny", "max_batch_size": 2, "kv_budget_tokens": 1024, **options})
    return Scheduler(target, tokenizer, settings, draft=draft, cost=copy.deepcopy(FLAT))


def refused(admission: Admission, req: ServeRequest) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        admission.admit(req)
    return info.value


def test_bad_k_logprobs_and_proposers_are_refused_with_the_usual_messages(
    chat_models, tiny_tokenizer, no_drafters
) -> None:
    admission = scheduler_for(chat_models, tiny_tokenizer, speculation="on").admission
    names = list(admission.proposers)
    assert "draft_model" in names and "prompt_lookup" in names and "eagle" not in names
    for k in (0, 65, -1, True, 2.0):
        error = refused(admission, request(k=k))
        assert error.param == "num_speculative_tokens"
        assert str(error) == f"num_speculative_tokens must be an integer in [1, 64], got {k!r}"
    for k in (MIN_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS):
        admission.admit(request(k=k))
    admission.admit(request(k=1000, speculative=False))  # k unused: not checked
    for n in (21, -1, True):
        error = refused(admission, request(logprobs=n))
        assert error.param == "logprobs" and str(error) == f"logprobs must be an integer in [0, 20], got {n!r}"
    admission.admit(request(logprobs=20))
    error = refused(admission, request(proposer="no_such"))
    assert error.param == "proposer"
    assert str(error) == f"proposer must be one of {names} on this server, got 'no_such'"
    error = refused(admission, request(proposer="eagle"))
    assert str(error) == (
        f"proposer must be one of {names} on this server, got 'eagle' "
        "('eagle' needs a drafter trained for this target: specdecode train-drafter --kind eagle)"
    )
    error = refused(admission, request(speculation="adaptive"))
    assert error.param == "speculation" and "needs the cost model measured at start-up" in str(error)
    for req, param in (
        (request([]), "prompt"),
        (request([10_000]), "prompt"),
        (request([1] * 2000), "prompt"),
        (request(max_tokens=1000), "max_tokens"),
    ):
        assert refused(admission, req).param == param
    with pytest.raises(InvalidRequestError, match="train-drafter --kind medusa"):
        scheduler_for(chat_models, tiny_tokenizer, proposer="medusa")  # the server's own proposer: at start


def test_each_request_is_checked_once(chat_models, tiny_tokenizer, no_drafters, monkeypatch) -> None:
    """The HTTP layer admits a request and the scheduler queues it unchecked; a request built in
    code is checked at submit; either way once."""
    calls: list[str] = []
    check = Admission._check

    def counting(self: Admission, req: ServeRequest) -> None:
        calls.append(req.request_id)
        check(self, req)

    monkeypatch.setattr(Admission, "_check", counting)
    settings = ServeSettings(model_name="tiny", speculation="on", max_batch_size=2)
    app, scheduler = build_app(chat_models[0], tiny_tokenizer, settings, draft=chat_models[1])
    with TestClient(app) as client:
        body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 3, "temperature": 0}
        for proposer in ("draft_model", "prompt_lookup", None):
            calls.clear()
            answer = client.post("/v1/completions", json={**body, "proposer": proposer})
            assert answer.status_code == 200, answer.text
            assert len(calls) == 1 and calls[0] == answer.json()["id"]
        calls.clear()
        answer = client.post("/v1/completions", json={**body, "proposer": "no_such"})
        assert answer.status_code == 400 and len(calls) == 1
        error = answer.json()["error"]
        assert error["param"] == "proposer"
        assert error["message"].startswith("proposer must be one of [") and "got 'no_such'" in error["message"]
        answer = client.post("/v1/completions", json={**body, "num_speculative_tokens": 65})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "num_speculative_tokens"
        calls.clear()
        req = request()
        scheduler.submit(req)  # built in code: checked here
        assert calls == [req.request_id] and req.admitted_by is scheduler.admission
        scheduler.abort(req.request_id)


def test_proposers_are_found_once_at_start(chat_models, tiny_tokenizer, no_drafters, monkeypatch) -> None:
    """Drafter folders, the target's identity (weight rows copied to the host) and the draft's
    vocabulary are looked at while the server starts, never per request."""
    counts = dict.fromkeys(("has_drafter", "drafts_as_itself", "target_identity"), 0)

    def counted(name: str, function):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(admission_module, "has_drafter", counted("has_drafter", admission_module.has_drafter))
    monkeypatch.setattr(
        admission_module, "drafts_as_itself", counted("drafts_as_itself", admission_module.drafts_as_itself)
    )
    identity = counted("target_identity", specdecode.drafters.heads.target_identity)
    monkeypatch.setattr(specdecode.drafters, "target_identity", identity)
    monkeypatch.setattr(specdecode.drafters.heads, "target_identity", identity)
    settings = ServeSettings(model_name="tiny", speculation="on", max_batch_size=2)
    app, scheduler = build_app(chat_models[0], tiny_tokenizer, settings, draft=chat_models[1])
    at_start = dict(counts)
    assert at_start["has_drafter"] >= 2 and at_start["drafts_as_itself"] >= 1 and at_start["target_identity"] >= 1
    with TestClient(app) as client:
        body = {"model": "tiny", "prompt": "for i in", "max_tokens": 2, "temperature": 0}
        for proposer in ("draft_model", "prompt_lookup", "eagle", "no_such", None, "draft_model"):
            client.post("/v1/completions", json={**body, "proposer": proposer})
        assert client.get("/v1/models").json()["data"][0]["proposers"] == list(scheduler.admission.proposers)
        scheduler.proposers()
        scheduler.check_proposer("draft_model")
    assert counts == at_start


def test_the_k_range_is_checked_by_one_function() -> None:
    assert check_num_speculative_tokens(4) == 4
    assert check_num_speculative_tokens(None, optional=True) is None
    with pytest.raises(ValueError, match=r"^--num-speculative-tokens must be an integer in \[1, 64\], got 0$"):
        check_num_speculative_tokens(0, "--num-speculative-tokens")
    with pytest.raises(ValueError, match=r"^x must be None or an integer in \[1, 64\], got 'a'$"):
        check_num_speculative_tokens("a", "x", optional=True)
    with pytest.raises(ValueError, match=r"--num-speculative-tokens must be an integer in \[1, 64\]"):
        ServeSettings(num_speculative_tokens=65)


# A bound of k written as a literal: "[1, 64]", "1 .. 64", "<= 64", "min(64, ...)", "le=64", or a
# constant of the range assigned a number; flagged where the line or the one before names k.
_BOUND = re.compile(
    r"\[\s*1\s*,\s*64\s*\]|\b1\s*\.\.\s*64\b|<=?\s*64\b|\b64\s*>=?|\b(?:min|max)\(\s*64\b|\ble\s*=\s*64\b"
    r"|\b(?:MIN|MAX)_SPECULATIVE_TOKENS\s*=\s*\d"
)
_SUBJECT = re.compile(r"speculative|\bks?\b|_k\b|max_k", re.IGNORECASE)


def literal_k_bounds(root: Path) -> list[str]:
    """``path:line: text`` of every line under ``root`` that writes a bound of k as a literal."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if _BOUND.search(line) and _SUBJECT.search(" ".join(lines[max(0, i - 1) : i + 1])):
                found.append(f"{path.relative_to(root)}:{i + 1}: {line.strip()}")
    return found


def test_the_bounds_of_k_are_written_only_in_limits(tmp_path) -> None:
    found = [hit for hit in literal_k_bounds(SRC) if not hit.startswith("limits.py:")]
    assert found == [], "use specdecode.limits (MAX_SPECULATIVE_TOKENS, K_RANGE, check_num_speculative_tokens)"
    assert any(hit.startswith("limits.py:") for hit in literal_k_bounds(SRC))  # the scan sees the real ones
    sample = tmp_path / "sample.py"  # and the forms the code used to write
    sample.write_text(
        "MAX_SPECULATIVE_TOKENS = 64\n"
        "if not 1 <= k <= 64:\n"
        "    raise ValueError(f'num_speculative_tokens must be an integer in [1, 64], got {k!r}')\n"
        "self.max_k = max(start, self.config.max_speculative_tokens or min(64, 4 * start))\n"
        "max_queue: int = 64\n"
    )
    assert [hit.split(":")[1] for hit in literal_k_bounds(tmp_path)] == ["1", "2", "3", "4"]
