"""Prefix caching: a conversation's next turn prefills only its new tokens, and decodes exactly as
if it had prefilled them all.

- :class:`~specdecode.models.prefix_cache.PrefixCache` (which slot a request takes) on its own;
- the library: ``SpeculativeGenerator`` keeps the longest common prefix of its last sequence
  (llama.cpp's runner ``restart``), greedy and sampled multi-turn outputs equal to a generator that
  prefills every prompt whole, an edited history reusing only the true common prefix;
- the server on the real default GGUF (llama.cpp batched runner): a multi-turn conversation with
  and without the prefix cache gives the same tokens, ``usage.prompt_tokens_details.cached_tokens``
  (streamed too) and the ``/metrics`` counters say what was reused, eviction under few slots,
  concurrent conversations sharing a system prompt, scopes by ``user``.

Exact mode makes a kept cell the cell a fresh prefill writes: on the patched build every pass runs
on the invariant reference kernels (:func:`specdecode.models.llamacpp.model.reuses_prefixes`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specdecode.models.prefix_cache import SIMILARITY, PrefixCache, common_prefix
from test_serve import Server

from conftest import load_default_gguf

MODEL = "Qwen2.5-Coder-1.5B-Instruct"
SYSTEM = "You are a careful Python reviewer. Answer briefly, with code where it helps."
MODULE = """def mean(xs):
    total = 0
    for x in xs:
        total += x
    return total / len(xs)


def median(xs):
    s = sorted(xs)
    n = len(s)
    if n % 2:
        return s[n // 2]
    return (s[n // 2 - 1] + s[n // 2]) / 2
"""
QUESTIONS = [
    f"Here is a module:\n```python\n{MODULE}```\nWhat does mean() do with an empty list?",
    "Fix it so it raises a ValueError with a clear message.",
    "Now write one pytest test for median().",
]


# ------------------------------------------------------------------ the slot picker alone
def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_a_continuation_takes_its_slot_and_a_stranger_an_empty_one() -> None:
    cache = PrefixCache()
    cache.leave(3, [1, 2, 3, 4, 5, 6])
    assert cache.pick([9, 9], free=[0, 3]).slot == 0  # nothing in common: the empty slot
    pick = cache.pick([1, 2, 3, 4, 5, 6, 7, 8], free=[0, 3])
    assert (pick.slot, pick.reused, pick.evicted) == (3, 6, None) and 3 not in cache.idle
    # a short shared prefix (a system prompt) does not take another conversation's slot while one is empty
    cache.leave(3, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.pick([1, 2, 9], free=[0, 3]).slot == 0 and 3 in cache.idle
    # ... but is used when no empty slot is left
    pick = cache.pick([1, 2, 9], free=[3])
    assert (pick.slot, pick.reused, pick.evicted) == (3, 2, (1, 2, 3, 4, 5, 6, 7, 8))
    assert 2 < SIMILARITY * 8


def test_the_prompts_last_token_is_always_fed() -> None:
    cache = PrefixCache()
    cache.leave(0, [1, 2, 3])
    assert cache.pick([1, 2, 3], free=[0]).reused == 2  # its logits come from a pass
    cache.leave(0, [1, 2, 3])
    assert cache.pick([1, 2], free=[0]).reused == 1


def test_eviction_is_least_recently_used_and_scopes_do_not_mix() -> None:
    cache = PrefixCache()
    cache.leave(0, [1, 1, 1], scope="user:a")
    cache.leave(1, [2, 2, 2], scope="user:b")
    pick = cache.pick([1, 1, 1, 5], free=[0, 1], scope="user:b")  # a's prefix is not offered to b
    assert (pick.slot, pick.reused, pick.evicted) == (0, 0, (1, 1, 1))  # the oldest goes
    assert list(cache.idle) == [1]
    pick = cache.pick([2, 2, 2, 7], free=[0, 1], scope="user:b")
    assert (pick.slot, pick.reused) == (1, 3)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt"):
        PrefixCache().pick([], free=[0])
    with pytest.raises(RuntimeError, match="no free slot"):
        PrefixCache().pick([1], free=[])


# ------------------------------------------------------------------ the library, real GGUF
def _conversation(gen, sampling, turns: list[str], edit: dict[int, str] | None = None) -> list[tuple[list[int], int]]:
    """Each turn's ``(token ids, cached prompt tokens)``; the history re-sent every turn, with the
    answers of earlier turns (``edit``: turn index -> the answer the client re-sends instead)."""
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for i, question in enumerate(turns):
        messages.append({"role": "user", "content": question})
        text = gen.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        result = gen.generate(gen.tokenizer.encode(text), sampling=sampling)
        out.append((result.token_ids, result.stats.cached_tokens))
        answer = (edit or {}).get(i, result.text)
        messages.append({"role": "assistant", "content": answer})
    return out


@pytest.fixture(scope="module")
def pair():
    from specdecode import SpeculativeGenerator
    from specdecode.models.backends import load_llamacpp_tokenizer
    from specdecode.proposers.prompt_lookup import PromptLookupProposer

    model = load_default_gguf("target", threads=2)
    tokenizer = load_llamacpp_tokenizer(model)
    cached = SpeculativeGenerator(model, tokenizer=tokenizer, proposer=PromptLookupProposer())
    fresh = SpeculativeGenerator(model, tokenizer=tokenizer, proposer=PromptLookupProposer())
    fresh.reuse_prompt = False
    return model, tokenizer, cached, fresh


@pytest.mark.slow
def test_the_generators_next_turn_reuses_its_prefix_and_decodes_the_same(pair) -> None:
    """Greedy, three turns, prompt lookup drafting: each turn's tokens equal a generator's that
    prefills every prompt whole; turns 2 and 3 reuse most of their prompt."""
    from specdecode import SamplingParams

    model, _, cached, fresh = pair
    assert cached.target.reuses_prefixes, "the set-up's build runs every exact pass on the invariant kernels"
    sampling = SamplingParams(temperature=0, max_new_tokens=24)
    with_cache = _conversation(cached, sampling, QUESTIONS)
    without = _conversation(fresh, sampling, QUESTIONS)
    assert [ids for ids, _ in with_cache] == [ids for ids, _ in without]
    assert all(n == 0 for _, n in without)
    assert with_cache[0][1] == 0 and with_cache[1][1] > 100 and with_cache[2][1] > with_cache[1][1]


@pytest.mark.slow
def test_an_edited_history_reuses_only_the_true_common_prefix(pair) -> None:
    """A client that rewrites the first answer: the second turn reuses the cells up to where the
    history changed, no further, and decodes as a fresh prefill would; sampled, with a seed."""
    from specdecode import SamplingParams

    _, tokenizer, cached, fresh = pair
    sampling = SamplingParams(temperature=0.8, seed=7, max_new_tokens=24)
    edit = {0: "It divides by zero."}
    with_cache = _conversation(cached, sampling, QUESTIONS[:2], edit)
    without = _conversation(fresh, sampling, QUESTIONS[:2], edit)
    assert [ids for ids, _ in with_cache] == [ids for ids, _ in without]
    head = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    # the kept cells stop inside the first answer (at most where the rewritten text departs from it)
    prompt_head = len(tokenizer.encode(head))
    assert prompt_head <= with_cache[1][1] < prompt_head + len(with_cache[0][0])


@pytest.mark.slow
def test_a_reused_prefix_gives_the_fresh_prefills_logits_bit_for_bit(pair) -> None:
    """The runner level: a prompt prefilled after a kept prefix (written by a prefill and by
    one-token passes) returns the logits of the same prompt prefilled whole, bit for bit."""
    model, tokenizer, _, _ = pair
    ids = tokenizer.encode(MODULE * 8)[:400]
    assert len(ids) == 400
    runner, fresh = model.make_runner(n_ctx=512), model.make_runner(n_ctx=512)
    runner.restart(torch.tensor(ids[:250]))
    for i in range(250, 258):  # decoded answer tokens
        runner.forward(torch.tensor(ids[i : i + 1]))
    again = runner.restart(torch.tensor(ids))
    assert runner.cached_tokens == 258
    assert torch.equal(again, fresh.restart(torch.tensor(ids)))
    assert torch.equal(
        runner.forward(torch.tensor(ids[:5]), num_logits=5), fresh.forward(torch.tensor(ids[:5]), num_logits=5)
    )


# ------------------------------------------------------------------ the server, real GGUF
@pytest.fixture(scope="module")
def servers(pair):
    model, tokenizer, _, _ = pair
    options = dict(
        model_name=MODEL, proposer="prompt_lookup", speculation="on", max_batch_size=2, kv_budget_tokens=2 * 2048
    )
    with (
        Server(model, tokenizer, **options) as cached,
        Server(model, tokenizer, prefix_cache=False, **options) as plain,
    ):
        yield cached, plain


@pytest.fixture(scope="module")
def scoped(pair):
    model, tokenizer, _, _ = pair
    options = dict(model_name=MODEL, proposer="prompt_lookup", max_batch_size=2, kv_budget_tokens=2 * 2048)
    with Server(model, tokenizer, prefix_cache_scope="user", **options) as s:
        yield s


def _chat(server, turns: list[str], user: str | None = None, stream: bool = False) -> list[tuple[str, int]]:
    """Each turn's ``(answer, cached prompt tokens)`` through the server, the history re-sent."""
    client = server.client()
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for question in turns:
        messages.append({"role": "user", "content": question})
        kwargs = dict(model=MODEL, messages=messages, max_tokens=20, temperature=0)
        if user is not None:
            kwargs["user"] = user
        if stream:
            text, usage = "", None
            for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                if chunk.usage is not None:
                    usage = chunk.usage
        else:
            response = client.chat.completions.create(**kwargs)
            text, usage = response.choices[0].message.content, response.usage
        out.append((text, usage.prompt_tokens_details.cached_tokens))
        messages.append({"role": "assistant", "content": text})
    return out


@pytest.mark.slow
def test_the_servers_conversation_is_the_same_with_and_without_the_prefix_cache(servers) -> None:
    cached, plain = servers
    queries, hits = (
        cached.metric("specdecode_prefix_cache_queries_total"),
        cached.metric("specdecode_prefix_cache_hits_total"),
    )
    with_cache = _chat(cached, QUESTIONS, stream=True)
    without = _chat(plain, QUESTIONS)
    assert [t for t, _ in with_cache] == [t for t, _ in without]
    assert [n for _, n in without] == [0, 0, 0] and plain.metric("specdecode_prefix_cache_queries_total") == 0
    assert with_cache[1][1] > 100 and with_cache[2][1] > with_cache[1][1]
    assert cached.metric("specdecode_prefix_cache_hits_total") - hits == sum(n for _, n in with_cache)
    assert cached.metric("specdecode_prefix_cache_queries_total") > queries


@pytest.mark.slow
def test_scoped_by_user_a_prefix_is_offered_to_its_own_user_only(scoped) -> None:
    first = _chat(scoped, QUESTIONS[:2], user="alice")
    history = [QUESTIONS[0], QUESTIONS[1]]
    assert first[1][1] > 100
    assert _chat(scoped, history[:1], user="bob")[0][1] == 0  # the same prompt as alice's first turn
    assert _chat(scoped, history[:1], user="alice")[0][1] > 0
    assert _chat(scoped, history[:1])[0][1] == 0  # no user: shares with nobody


@pytest.mark.slow
def test_concurrent_conversations_on_fewer_slots_decode_as_alone(servers) -> None:
    """Three conversations at once on two slots: every one decodes as alone (the plain server's
    answers), none fails, and cached prefixes were evicted to make room."""
    cached, plain = servers
    openers = [QUESTIONS[0], "Write a Python function that reverses a string.", "What is a Python generator?"]
    evictions = cached.metric("specdecode_prefix_cache_evictions_total")
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda q: _chat(cached, [q, "Shorter, please."]), openers))
    want = [_chat(plain, [q, "Shorter, please."]) for q in openers]
    assert [[t for t, _ in c] for c in got] == [[t for t, _ in c] for c in want]
    assert cached.metric("specdecode_prefix_cache_evictions_total") > evictions  # 3 conversations, 2 slots
    assert cached.metric("specdecode_request_success_total", finished_reason="error") == 0


@pytest.mark.slow
def test_a_continued_conversation_keeps_its_suffix_proposers_store(pair) -> None:
    """An agent loop re-sending its request: the second request continues the first's slot, so it
    gets the suffix proposer that decoded the first, its store of that answer kept (not cleared as
    for a stranger): the answer is drafted from it and accepted in long runs."""
    model, tokenizer, _, _ = pair
    options = dict(model_name=MODEL, proposer="suffix", speculation="on", max_batch_size=2, kv_budget_tokens=2 * 2048)
    with Server(model, tokenizer, **options) as server:
        client = server.client()
        messages = [{"role": "user", "content": QUESTIONS[0]}]
        runs = [
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0) for _ in "ab"
        ]
    first, second = ((r.model_extra or {})["speculative"] for r in runs)
    assert runs[0].choices[0].message.content == runs[1].choices[0].message.content
    assert runs[1].usage.prompt_tokens_details.cached_tokens == runs[1].usage.prompt_tokens - 1
    # a cleared store would draft as for the first request (the same greedy steps): equal counts
    assert second["accepted_tokens"] > first["accepted_tokens"] and second["mean_acceptance_length"] > 2.5
