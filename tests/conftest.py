"""Tiny, seeded, randomly initialised models and a tiny BPE tokenizer for fast tests (float32);
the real default models, each loaded once per session (``load_default_gguf``, ``real_pair``)."""

from __future__ import annotations

import copy
import gc
import importlib.util
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

TINY_VOCAB = 96

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n    return all(n % d for d in range(2, n))\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens.",
    "for i in range(10):\n    print(i * i)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tiny_model(
    vocab_size: int = TINY_VOCAB, seed: int = 0, layers: int = 2, init: float = 0.2
) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 with random weights, float32, eval mode. ``init`` is the weights' std:
    larger than the usual 0.02 so that logits have clear maxima (no near-ties in the argmax)."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=init,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float().eval()


def perturbed_copy(model: Qwen2ForCausalLM, noise: float, seed: int = 1) -> Qwen2ForCausalLM:
    """The same model with Gaussian noise of std ``noise`` added to every weight: a draft that
    agrees with the target on some tokens and not others."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return draft


def constant_target() -> Qwen2ForCausalLM:
    """A target whose greedy output is always token 0: its final norm is zeroed, so every logit
    is exactly 0 and the argmax is the first index, in any batch shape (a draft that proposes 0s
    agrees fully)."""
    model = make_tiny_model(seed=0)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    return model


def make_tiny_tokenizer(vocab_size: int = TINY_VOCAB) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on a few lines of code and prose, with a chat template and an
    end-of-turn token ``<|end|>`` as EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|end|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine two threads
    per process oversubscribe the cores and slow tests down many times."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def serve_cost_cache_in_tmp(tmp_path_factory, monkeypatch):
    """``specdecode serve`` stores its measured cost model in the user's cache
    (:mod:`specdecode.cost.cache`); tests that run the command, in this process or in a
    subprocess, store theirs in a folder of their own instead (the default models stay in the real
    cache)."""
    monkeypatch.setenv("SPECDECODE_SERVE_COST_CACHE", str(tmp_path_factory.mktemp("serve-cost")))


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    # byte-level BPE needs >= 256 + 3 entries; the models below use the tokenizer's real size
    return make_tiny_tokenizer(vocab_size=300)


@pytest.fixture(scope="session")
def tiny_target() -> Qwen2ForCausalLM:
    return make_tiny_model(seed=0)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_tokenizer):
    """Folders (target, draft) of a tiny target and a perturbed copy as draft, saved with the tiny
    tokenizer, for command-line tests (one pair per test module)."""
    root = tmp_path_factory.mktemp("models")
    target = make_tiny_model(vocab_size=len(tiny_tokenizer), seed=0)
    for name, model in (("target", target), ("draft", perturbed_copy(target, noise=0.01))):
        model.save_pretrained(root / name)
        tiny_tokenizer.save_pretrained(root / name)
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def chat_models(tiny_tokenizer) -> tuple[Qwen2ForCausalLM, Qwen2ForCausalLM]:
    """(target, draft) over the tiny tokenizer's vocabulary, the draft a perturbed copy (part of
    its drafts accepted): the pair the server tests serve (one pair per test module)."""
    target = make_tiny_model(vocab_size=len(tiny_tokenizer), seed=0)
    return target, perturbed_copy(target, noise=0.01)


@pytest.fixture(scope="session")
def tiny_pair(tiny_target: Qwen2ForCausalLM) -> dict[str, Qwen2ForCausalLM]:
    """Target and three drafts: identical (all accepted), unrelated (almost none), perturbed (part)."""
    return {
        "target": tiny_target,
        "identical": copy.deepcopy(tiny_target),
        "unrelated": make_tiny_model(seed=123),
        "perturbed": perturbed_copy(tiny_target, noise=0.01),
    }


# ---------------------------------------------------------------------------- the real models
# Loaded once per session and shared by every test file (a fresh-clone run loaded the float32 pair
# twice and the 1.5B GGUF about a dozen times: 28 min, 18.5 GB). Whether they are installed is
# decided from the files, never by loading one (``require_default_gguf``, ``require_default_pair``).


def require_default_gguf(role: str = "target") -> Path:
    """The default pair's GGUF file for ``role``, without loading it; the test is skipped (with the
    reason) where llama-cpp-python or the default models are not installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (scripts/setup.sh builds it)")
    from specdecode.errors import ModelNotFoundError
    from specdecode.models.backends import gguf_path

    try:
        return gguf_path(None, role)
    except ModelNotFoundError as error:
        pytest.skip(f"default models not installed: {error}")


_GGUF: dict[tuple[Path, Any, bool], Any] = {}  # (file, options, ...: _gguf_key) -> LlamaCppModel, oldest use first
GGUF_KEPT = 3
"""GGUF models the session keeps loaded (the most recently used): each target load holds ~2 GB
(its mapped file and repacked weights); a model no longer kept is freed once no test holds it, and
loaded again if asked for. (The suite's 10.3 GB peak is not from this cache: it was the same with
every file-and-options pair kept; lab/notebook/2026-11-27-test-run.md.)"""


def _gguf_key(path: Path, options: Any) -> tuple[Path, Any, bool]:
    """What makes two loads of ``path`` the same model: the options, with ``threads`` as the count it
    stands for (None: this process's cores) and ``gpu_layers`` moot on a build without GPU offload,
    and whether ``invariant_tokens`` was given (a default one changes on a GPU)."""
    from dataclasses import replace

    from specdecode.models.llamacpp.model import LlamaCppOptions, _lib

    options = options or LlamaCppOptions()
    same = replace(options, threads=options.n_threads)
    if not _lib().llama_supports_gpu_offload():
        same = replace(same, gpu_layers=0)
    return Path(path).resolve(), same, options.invariant_tokens_given


def _shared_load_llamacpp(original: Any) -> Any:
    """``specdecode.models.backends.load_llamacpp`` answering every load of a file with options it
    has loaded before with that model (see :func:`load_default_gguf`)."""

    def load_llamacpp(spec: Any, role: str, options: Any = None) -> Any:
        from specdecode.models.backends import gguf_path

        key = _gguf_key(gguf_path(spec, role), options)
        model = _GGUF.pop(key, None)
        if model is None:
            while len(_GGUF) >= GGUF_KEPT:  # forget the least recently used
                _GGUF.pop(next(iter(_GGUF)))
            gc.collect()
            model = original(spec, role, options)
        _GGUF[key] = model  # now the most recently used
        return model

    return load_llamacpp


@pytest.fixture(scope="session", autouse=True)
def share_gguf_loads():
    """Every GGUF load in this process (``load_default_gguf``; ``from_pretrained`` and the commands
    run by ``main``, through ``specdecode.load``) goes through one cache: a file loaded with the same
    options is the same :class:`~specdecode.models.llamacpp.LlamaCppModel` (its runners, each a
    context with its own KV cache, are made per use; a test that changes the model puts it back).
    Commands run in a subprocess load their own."""
    from specdecode.models import backends

    original = backends.load_llamacpp
    backends.load_llamacpp = _shared_load_llamacpp(original)
    yield
    backends.load_llamacpp = original
    drop_shared_models()


def load_default_gguf(role: str, **options: Any) -> Any:
    """The default pair's GGUF ``role`` (``"target"`` / ``"draft"``) on llama.cpp with
    :class:`~specdecode.models.llamacpp.LlamaCppOptions` ``options`` (none: the defaults, exact
    mode), loaded once per session for these options; the test is skipped where llama-cpp-python
    or the default models are not installed (decided without loading: :func:`require_default_gguf`)."""
    require_default_gguf(role)
    from specdecode.models import backends
    from specdecode.models.llamacpp.model import LlamaCppOptions

    return backends.load_llamacpp(None, role, LlamaCppOptions(**options))


def drop_shared_models() -> None:
    """Forget the GGUF models loaded so far (they are freed once no test holds them)."""
    _GGUF.clear()
    gc.collect()


_PLAIN: weakref.WeakKeyDictionary[Any, dict[tuple, list[int]]] = weakref.WeakKeyDictionary()


def plain_greedy(model: Any, ids: Sequence[int], max_new_tokens: int, tokenizer: Any = None) -> list[int]:
    """Greedy target-only decoding of the prompt ``ids`` by ``model``, as ``SpeculativeGenerator(model,
    tokenizer=tokenizer).generate(ids, SamplingParams(max_new_tokens=n), speculative=False)`` gives it,
    decoded once per model, prompt and end-of-sequence ids (the tokenizer's count): every run starts
    from a reset cache (one prefill pass, then one token per pass), so the first n tokens of a longer
    run are the run of n tokens."""
    from specdecode import SamplingParams, SpeculativeGenerator
    from specdecode.engine import eos_token_ids

    eos = eos_token_ids(model, tokenizer)
    key = (tuple(int(i) for i in ids), eos)
    known = _PLAIN.setdefault(model, {})
    done = known.get(key)
    if done is None or (len(done) < max_new_tokens and not (done and done[-1] in eos)):
        plain = SpeculativeGenerator(model, tokenizer=tokenizer)
        known[key] = done = plain.generate(list(key[0]), SamplingParams(max_new_tokens=max_new_tokens)).token_ids
    return done[:max_new_tokens]


def require_default_pair() -> None:
    """Skip (with the reason) where the default pair's model packages are not installed, without
    loading either model."""
    from specdecode.errors import ModelNotFoundError
    from specdecode.models.default import DEFAULT_DRAFT, DEFAULT_TARGET, part_paths

    try:
        part_paths(DEFAULT_TARGET), part_paths(DEFAULT_DRAFT)
    except ModelNotFoundError as error:
        pytest.skip(f"default models not installed: {error}")


@pytest.fixture(scope="session")
def real_bf16_pair() -> Any:
    """The default pair on torch in bfloat16 on the CPU, exact passes (the default there), as
    ``load_models(plan_models(None, None, "draft_model", "torch", "bfloat16", device="cpu"))`` gives
    it: :class:`~specdecode.load.LoadedModels` (target, tokenizer, draft, the built proposer), once per
    session, 4 GB. The only real torch pair the suite loads (in float32 the target's weights alone are
    6 GB, and issue 50 asks for a run under 8 GB); float32 paths are tested on tiny models.
    Its tests run last (:func:`pytest_collection_modifyitems`) and the GGUF models are dropped
    before it loads, so the two never take memory at the same time. Torch gets every core while it
    lives (real models use intra-op threads), but for the tests that do not use it
    (:func:`one_thread_elsewhere`)."""
    from specdecode.load import load_models, plan_models

    require_default_pair()
    drop_shared_models()
    before = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    yield load_models(plan_models(None, None, "draft_model", "torch", "bfloat16", device="cpu"))
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def one_thread_elsewhere(request: pytest.FixtureRequest) -> Any:
    """One torch thread (:func:`one_thread`) for a test that does not use :func:`real_bf16_pair`,
    also after that fixture gave torch every core: the real models' worker runs tiny models' tests
    after its own, and with two threads they took 1.6 cores for what one does (299 CPU-s in 186 s
    of wall for 324 tests on the 2-core Zen 4 EPYC, 2026-12-02)."""
    if "real_bf16_pair" in request.fixturenames:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def real_pair(real_bf16_pair: Any) -> Any:
    """:func:`real_bf16_pair` as a :class:`~specdecode.SpeculativeGenerator` with its ``draft_model``
    proposer, as ``SpeculativeGenerator.from_pretrained(backend="torch", dtype="bfloat16", device="cpu")``
    builds it."""
    from specdecode import SpeculativeGenerator

    return SpeculativeGenerator.from_loaded(real_bf16_pair)


FIRST_FILES = frozenset({"test_serve_replicas.py"})
"""Test files that run first in the real models' worker, before any real model loads, as part of its
unit: a module-scoped fixture dear to build (a local Ray cluster, 20-37 s to start on 2 cores) is
built once, and its processes (which inherit the worker's CPU priority) start at normal priority
while the other worker runs the tiny models' tests at ``nice`` 10. In the other worker, first at
normal priority beside the real models' loads, Ray Serve's proxy did not start in time on the
2-core AMD EPYC (Zen 4); at ``nice`` 10 there its replacement replica did not answer within 180 s
(2026-12-02)."""

REAL_MODEL_FILES = frozenset({
    "test_contract.py", "test_exact_bf16.py", "test_llamacpp.py", "test_llamacpp_check.py",
    "test_llamacpp_gpu_rules.py", "test_llamacpp_proposers.py", "test_llamacpp_tree.py", "test_logprobs_llamacpp.py",
    "test_prefix_cache.py", "test_readme_tour.py", "test_real_models.py", "test_serve_llamacpp.py",
    "test_structured_llamacpp.py",
})  # fmt: skip
"""The test files that load the real default models (tests/test_suite_layout.py checks the list)."""


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (``scripts/test.sh`` runs two workers), every test of
    :data:`REAL_MODEL_FILES` runs in one worker, in collection order, and it starts first (the
    longest unit of work); every other test is a unit of its own, spread over the workers. So two
    workers never hold the real models at once (memory) nor run two llama.cpp thread pools on the
    same cores, while the tiny models' tests, single-threaded, fill the other core; the tests of the
    files in :data:`FIRST_FILES` run in that unit, first (their module fixture is built once). (A scheduler of
    our own rather than ``--dist loadgroup``: pytest 9.2 drops xdist's group suffix, pytest-xdist#1386.)"""
    from xdist.scheduler import LoadScopeScheduling

    class RealModelsInOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            name = Path(nodeid.split("::", 1)[0]).name
            return "real_models" if name in REAL_MODEL_FILES or name in FIRST_FILES else nodeid

    return RealModelsInOneWorker(config, log)


_WORKER_PRIORITY_SET = False


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under pytest-xdist, the worker whose first test is not a real-model test (the one that runs
    the tiny models' tests: :func:`pytest_xdist_make_scheduler` gives the real models' tests to the
    other, first) lowers its CPU priority (``nice`` 10) for the rest of the run: on 2 cores the
    real models' llama.cpp thread pool then keeps both cores when it computes, and the tiny tests
    take the time it leaves (a contended thread pool waits at every barrier)."""
    global _WORKER_PRIORITY_SET
    if _WORKER_PRIORITY_SET or "PYTEST_XDIST_WORKER" not in os.environ:
        return
    _WORKER_PRIORITY_SET = True
    if item.path.name not in REAL_MODEL_FILES and item.path.name not in FIRST_FILES:
        os.nice(10)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests of :data:`FIRST_FILES` run first and those of the real torch pair
    (``real_bf16_pair``, the largest models in memory) last, each in their order; every other test
    keeps its place."""
    first = [item for item in items if item.path.name in FIRST_FILES]
    last = [item for item in items if "real_bf16_pair" in getattr(item, "fixturenames", ())]
    if first or last:
        chosen = set(first) | set(last)
        items[:] = first + [item for item in items if item not in chosen] + last


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """With ``SPECDECODE_TEST_CPU_TIMES=FILE``, append a line per test to FILE: its node id, the
    CPU seconds this process and its waited-for children spent on it (setup, call and teardown:
    every thread counts), its wall seconds, and this process's peak resident memory so far (GiB: the
    test that raises it is the one that sets the suite's peak), tab-separated. The suite is
    CPU-bound on 2 cores, so CPU time, not a test's duration under a busy neighbour, says what a
    test costs."""
    out = os.environ.get("SPECDECODE_TEST_CPU_TIMES")
    if not out:
        yield
        return
    import resource
    import time

    def cpu() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    cpu_0, wall_0 = cpu(), time.perf_counter()
    yield
    with open(out, "a") as f:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # KiB on Linux
        f.write(f"{item.nodeid}\t{cpu() - cpu_0:.2f}\t{time.perf_counter() - wall_0:.2f}\t{peak:.2f}\n")
