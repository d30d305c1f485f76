"""The runner contract as code (src/specdecode/models/contract.py, docs/design.md §2b): every runner
satisfies its Protocol and declares its capabilities; the row table's bookkeeping; no capability
probing left in src/."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from specdecode.models.backends import backend_of, make_batched_runner, make_runner, runner_capabilities, runner_class
from specdecode.models.contract import BatchedRunner, CapabilityError, RowTable, Runner, RunnerCapabilities
from specdecode.models.llamacpp.batch import LlamaCppBatchedRunner
from specdecode.models.llamacpp.model import LlamaCppModel, LlamaCppOptions, LlamaCppRunner
from specdecode.models.torch.batch import TorchBatchedRunner
from specdecode.models.torch.runner import ModelRunner
from specdecode.proposers import make_proposer
from specdecode.proposers.draft_model import DraftModelConfig, DraftModelProposer

from conftest import load_default_gguf

SRC = Path(__file__).resolve().parents[1] / "src" / "specdecode"
RUNNER_CLASSES = (ModelRunner, TorchBatchedRunner, LlamaCppRunner, LlamaCppBatchedRunner)


# ---------------------------------------------------------------------------------- capabilities
@pytest.mark.parametrize("cls", RUNNER_CLASSES, ids=lambda c: c.__name__)
def test_every_runner_class_declares_its_capabilities(cls: type) -> None:
    caps = cls.capabilities
    assert isinstance(caps, RunnerCapabilities) and caps.backend in ("torch", "llamacpp")
    rows = ("greedy_stop_rows", "greedy_stop_then")
    flags = {k: v for k, v in dataclasses.asdict(caps).items() if k not in ("backend", *rows)}
    assert all(isinstance(v, bool) for v in flags.values())
    for name in rows:
        value = getattr(caps, name)
        assert value is None or (isinstance(value, int) and value >= 1), name
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.trees = False  # type: ignore[misc]


def test_the_declared_capabilities_are_what_each_runner_does() -> None:
    assert ModelRunner.capabilities.trees and ModelRunner.capabilities.reduced_head
    assert ModelRunner.capabilities.returns_hidden and ModelRunner.capabilities.model_insides
    assert TorchBatchedRunner.capabilities.returns_hidden and not TorchBatchedRunner.capabilities.trees
    assert LlamaCppRunner.capabilities.trees and LlamaCppRunner.capabilities.returns_hidden
    assert not LlamaCppRunner.capabilities.reduced_head and not LlamaCppRunner.capabilities.model_insides
    assert not LlamaCppBatchedRunner.capabilities.returns_hidden  # the llamacpp server offers no Medusa / EAGLE


def test_a_missing_capability_is_refused_naming_the_runner_and_the_capability() -> None:
    with pytest.raises(
        CapabilityError,
        match=r"proposer 'eagle' needs a runner with returns_hidden; "
        r"LlamaCppBatchedRunner \(backend llamacpp\)",
    ):
        LlamaCppBatchedRunner.capabilities.require("returns_hidden", LlamaCppBatchedRunner, "proposer 'eagle'")
    assert issubclass(CapabilityError, ValueError)  # callers that catch ValueError still do
    ModelRunner.capabilities.require("trees", ModelRunner, "tree=")  # has it: nothing happens
    with pytest.raises(AttributeError, match="not a runner capability"):
        ModelRunner.capabilities.require("backend", ModelRunner, "x")
    with pytest.raises(AttributeError, match="not a runner capability"):
        ModelRunner.capabilities.require("flying", ModelRunner, "x")


def test_a_model_says_what_its_runner_can_do_before_one_is_made(tiny_target) -> None:
    assert runner_capabilities(tiny_target) == ModelRunner.capabilities and runner_class(tiny_target) is ModelRunner
    assert backend_of(tiny_target) == "torch"
    # a llama.cpp model (not loaded: its capabilities are its class's and its options')
    for exact in (True, False):
        gguf = LlamaCppModel.__new__(LlamaCppModel)
        gguf.options = LlamaCppOptions(exact=exact)
        caps = runner_capabilities(gguf)
        assert backend_of(gguf) == "llamacpp" and runner_class(gguf) is LlamaCppRunner
        assert caps.batch_invariant is exact and caps.greedy_hints is exact and not caps.model_insides


def test_a_gguf_draft_refuses_a_token_map_and_int8_by_capability() -> None:
    gguf = LlamaCppModel.__new__(LlamaCppModel)
    gguf.options = LlamaCppOptions()
    with pytest.raises(CapabilityError, match="token_map .* needs a runner with reduced_head; LlamaCppRunner"):
        DraftModelProposer(gguf, DraftModelConfig(token_map="default"))
    with pytest.raises(CapabilityError, match="draft_quantization 'int8' .* needs a runner with model_insides"):
        DraftModelProposer(gguf, DraftModelConfig(draft_quantization="int8"))


# ---------------------------------------------------------------------------------- protocols
def test_torch_runners_satisfy_their_protocols(tiny_target) -> None:
    single = make_runner(tiny_target)
    batched = make_batched_runner(tiny_target, 2, 64)
    assert isinstance(single, Runner) and not isinstance(single, BatchedRunner)
    assert isinstance(batched, BatchedRunner) and not isinstance(batched, Runner)
    assert single.capabilities is ModelRunner.capabilities and batched.capabilities is TorchBatchedRunner.capabilities
    # the proposers' own runners: a draft model's (with a reduced head) and early exit's
    draft = DraftModelProposer(tiny_target, DraftModelConfig(draft_quantization="none"))
    assert isinstance(draft.runner, Runner)
    early = make_proposer("early_exit", target=tiny_target, exit_layer=1)
    assert isinstance(early.runner, Runner) and early.runner.capabilities.model_insides  # type: ignore[attr-defined]


@pytest.mark.slow
def test_llamacpp_runners_satisfy_their_protocols() -> None:
    model = load_default_gguf("target")  # the session's (conftest)
    single = make_runner(model)
    batched = make_batched_runner(model, 2, 128)
    assert isinstance(single, LlamaCppRunner) and isinstance(single, Runner) and not isinstance(single, BatchedRunner)
    assert isinstance(batched, LlamaCppBatchedRunner) and isinstance(batched, BatchedRunner)
    assert single.capabilities == runner_capabilities(model) and single.capabilities.batch_invariant  # exact default
    assert batched.capabilities.batch_invariant and not batched.capabilities.returns_hidden
    batched.add_row()
    with pytest.raises(CapabilityError, match="returns_hidden; LlamaCppBatchedRunner"):
        batched.forward(0, [torch.tensor([1, 2])], [1], return_hidden=True)


# ---------------------------------------------------------------------------------- row table
def test_row_table_adds_removes_and_truncates_rows() -> None:
    table = RowTable(3)
    assert [table.add() for _ in range(3)] == [0, 1, 2] and table.slots == [0, 1, 2] and table.num_rows == 3
    with pytest.raises(RuntimeError, match="all 3 rows"):
        table.add()
    table.lengths[:] = [10, 20, 30]
    assert table.truncate(1, 15) is True and table.truncate(1, 15) is False and table.lengths == [10, 15, 30]
    with pytest.raises(ValueError, match=r"truncate length of row 1 must be in \[0, 15\], got 16"):
        table.truncate(1, 16)
    assert table.remove(0) == 2  # the last row moves into row 0, with its slot and length
    assert table.lengths == [30, 15] and table.slots == [2, 1]
    assert table.remove(1) is None and table.lengths == [30] and table.slots == [2]
    assert table.add() == 1 and table.slots == [2, 0] and table.lengths == [30, 0]  # the lowest free slot
    with pytest.raises(ValueError, match=r"row must be in \[0, 1\], got 2"):
        table.remove(2)


def test_row_table_checks_a_forwards_rows() -> None:
    table = RowTable(4)
    table.add(), table.add()
    table.check_call(0, 2, 2)
    table.check_call(1, 1, 1)
    for first, inputs, logits in ((0, 0, 0), (0, 2, 1), (1, 2, 2), (-1, 1, 1)):
        with pytest.raises(ValueError, match="num_logits, have 2"):
            table.check_call(first, inputs, logits)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="max_rows must be an integer >= 1"):
            RowTable(bad)  # type: ignore[arg-type]


def test_both_batched_runners_keep_their_rows_in_a_row_table(tiny_target) -> None:
    batched = TorchBatchedRunner(tiny_target, 3, capacity=16)
    assert isinstance(batched.rows, RowTable) and batched.lengths is batched.rows.lengths
    for _ in range(3):
        batched.add_row()
    batched.forward(0, [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])], [1, 1, 1])
    assert batched.lengths == [3, 1, 2]
    batched.truncate(0, 1)
    assert batched.remove_row(0) == 2 and batched.lengths == [2, 1] and batched.num_rows == 2
    assert "self.lengths.append" not in (SRC / "models" / "llamacpp" / "batch.py").read_text()


# ---------------------------------------------------------------------------------- no probes
PROBES = [
    re.compile(r"""(getattr|hasattr)\(\s*[\w.]*runner[\w.]*\s*,"""),  # probing a runner
    re.compile(r"""["']returns_hidden["']\s*,\s*True"""),
    re.compile(r"""(getattr|hasattr)\([^,()]+,\s*["'](make_runner|backend|returns_hidden|capabilities)["']"""),
    re.compile(
        r"""(getattr|hasattr)\(\s*[\w.]*proposer[\w.]*\s*,\s*["'](quantization|drafter|clear_cache|model)["']"""
    ),
    # (proposers/vocabulary.py's vocab_size_of reads a size off a model, runner or proposer alike: a
    # size, not a capability, and so not matched here)
    re.compile(r"""(getattr|hasattr)\(\s*(model|inner)\s*,\s*["'](quantization|drafter)["']"""),
]


def test_src_probes_no_runner_or_proposer_capability() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(p.search(line) for p in PROBES):
                found.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert not found, "capability probes (declare the capability and read it):\n" + "\n".join(found)


def test_the_probe_patterns_catch_the_old_probes() -> None:
    old = [
        'if not getattr(self.runner, "returns_hidden", True):',
        'make = getattr(model, "make_runner", None)',
        'return str(getattr(model, "backend", "torch"))',
        'clear = getattr(generator.proposer, "clear_cache", None)',
        'drafter = getattr(proposer, "drafter", None) if needs_features(proposer) else None',
        'inner = getattr(proposer, "model", None)',
        'if hasattr(model, "drafter"):',
        'backends = {getattr(m, "backend", "torch") for m in (target, draft)}',
    ]
    for line in old:
        assert any(p.search(line) for p in PROBES), line


BACKEND_BRANCH = re.compile(
    r"""(==|!=|\bis\b|\bin\b)\s*[(\[{]?\s*["'](llamacpp|torch)["']|["'](llamacpp|torch)["']\s*(==|!=|\bin\b|\bnot\s+in\b)"""
)
BACKEND_BRANCHES_ALLOWED = ("models/", "load.py")
"""Where a value may be compared to a backend's name: the backends themselves and the one load path
(docs/design.md §2b). Above them a backend is a capability (``runner.capabilities``,
``models.backends.runner_capabilities``) or a load (:mod:`specdecode.load`); the data that maps a
backend to a default (``models.backends.default_proposer``, ``commands.bench.QUICK_PEERS``) and a
method's or proposer's ``backends`` tuple (``bench.methods``, ``proposers``) are tables, not branches."""


def test_no_backend_branch_above_the_models_but_the_load_path() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC).as_posix()
        if relative.startswith(BACKEND_BRANCHES_ALLOWED):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if BACKEND_BRANCH.search(line.split("#")[0]):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "backend branches above models/ (ask a capability or load through specdecode.load):\n" + (
        "\n".join(found)
    )


def test_the_backend_branch_pattern_catches_the_old_branches() -> None:
    old = [
        'if backend == "llamacpp":',
        'if chosen != "torch":',
        'if "llamacpp" in spec.backends:',
        'return "llamacpp" not in backends',
        'if args.backend in ("torch", "llamacpp"):',
    ]
    for line in old:
        assert BACKEND_BRANCH.search(line), line
    assert not BACKEND_BRANCH.search('QUICK_PEERS = {"torch": "hf_assisted", "llamacpp": "llamacpp"}')
