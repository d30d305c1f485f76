"""The device policy (docs/design.md §2b) on a stand-in accelerator (``fake_device.py``): every
torch path of the engine runs with the models "on cuda:0" (CPU tensors that raise where CUDA
raises), and gives exactly the tokens of the same run on the CPU, greedy and sampled with the same
seed (the randomness lives on the CPU generator, so a seed means the same draws on every device).

The stand-in's own rules are tested first, then a deliberate bug (a verifier without its host
copy) shows that the stand-in catches what a GPU would."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import specdecode.verify as verify_module
from specdecode import SamplingParams
from specdecode.constraints import Regex
from specdecode.models.torch.batch import TorchBatchedRunner
from specdecode.models.torch.runner import ModelRunner
from specdecode.sampling import sample
from specdecode.verify import VerifyResult, greedy_verify, greedy_verify_tree, rejection_sample, rejection_sample_tree

from device_cases import (
    CHAIN_KINDS,
    GREEDY,
    PROMPT,
    SAMPLED,
    TREE_KINDS,
    generate,
    make_generator,
    make_models,
    place,
    tokens,
)
from fake_device import STAND_IN, StandInMode, is_stand_in, stand_in_device, to_stand_in


@pytest.fixture(scope="module")
def models(tiny_tokenizer) -> dict[str, Any]:
    return make_models(tiny_tokenizer)


def both(kind: str, models: dict[str, Any], tokenizer, sampling: SamplingParams, **options: Any) -> tuple:
    """``(cpu tokens, stand-in tokens)`` of one generation with proposer ``kind`` (which must draft)."""
    cpu = generate(make_generator(kind, models, tokenizer), sampling, **options)
    with stand_in_device():
        placed = place(models, STAND_IN)
        generator = make_generator(kind, placed, tokenizer)
        assert generator.target.device == STAND_IN
        device = generate(generator, sampling, **options)
    drafted = cpu.stats.draft_tokens + cpu.stats.cut_draft_tokens  # a constraint may cut every draft
    assert (drafted > 0) == (kind != "none")
    assert device.stats.draft_tokens == cpu.stats.draft_tokens
    return cpu.token_ids, device.token_ids


# ------------------------------------------------------------------ the stand-in itself
def test_the_stand_in_raises_where_cuda_raises() -> None:
    with stand_in_device() as mode:
        x = torch.arange(6.0).to(STAND_IN)  # (6,)
        assert is_stand_in(x) and x.device == STAND_IN and x.is_cuda
        assert is_stand_in(x * 2) and is_stand_in(torch.zeros(3, device=x.device)) and is_stand_in(x.new_ones(2))
        assert is_stand_in(x + torch.tensor(1.0))  # a CPU scalar (0-dim) is fine, as on CUDA
        with pytest.raises(RuntimeError, match="strict"):  # CUDA takes them (an implicit copy); the policy does not
            x[torch.tensor([0, 2])]
        assert is_stand_in(x[torch.tensor([0, 2]).to(STAND_IN)]) and is_stand_in(x[1:3])
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(6)
        with pytest.raises(RuntimeError, match="same device"):
            torch.cat([x, torch.ones(2)])
        with pytest.raises(RuntimeError, match="same device"):
            torch.ones(6)[x.long()]
        with pytest.raises(RuntimeError, match="generator"):
            torch.multinomial(x.softmax(-1), 1, generator=torch.Generator())
        with pytest.raises(RuntimeError, match="generator"):
            torch.rand(3, generator=torch.Generator(), device=STAND_IN)
        with pytest.raises(TypeError, match="numpy"):
            x.numpy()
        reads = mode.host_reads
        assert not is_stand_in(x.cpu()) and x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and int(x[1]) == 1
        assert not is_stand_in(x.to("cpu")) and mode.host_reads == reads + 4
        model = to_stand_in(torch.nn.Linear(6, 2))
        assert all(is_stand_in(p) and isinstance(p, torch.nn.Parameter) for p in model.parameters())
        assert is_stand_in(model(x))
        with pytest.raises(RuntimeError, match="same device"):
            model(torch.ones(6))
    with stand_in_device(strict_getitem=False):
        assert is_stand_in(torch.arange(6.0).to(STAND_IN)[torch.tensor([0, 2])])  # as CUDA does


def test_the_runners_keep_their_outputs_on_the_device(models) -> None:
    with stand_in_device():
        target = to_stand_in(place(models, "cpu")["target"])
        runner = ModelRunner(target)
        assert runner.device == STAND_IN
        logits, hidden = runner.forward(torch.tensor([1, 2, 3]), num_logits=2, return_hidden=True)  # CPU ids in
        assert is_stand_in(logits) and is_stand_in(hidden) and logits.shape[0] == 2
        attend = torch.ones(2, 5, dtype=torch.bool)
        attend[0, 4] = False
        tree = runner.forward_masked(torch.tensor([4, 5]), torch.tensor([3, 3]), attend)  # CPU positions, mask
        assert is_stand_in(tree)
        runner.compact(torch.tensor([0, 1, 2, 4]))
        batched = TorchBatchedRunner(target, max_rows=2)
        batched.add_row(), batched.add_row()
        rows = batched.forward(0, [torch.tensor([1, 2, 3]), torch.tensor([4, 5])], [1, 2])
        assert batched.device == STAND_IN and all(is_stand_in(r) for r in rows)


# ------------------------------------------------------------------ the verifier's host copies
def test_the_verifiers_host_copies_are_few() -> None:
    """Greedy chains: 1 copy (the k + 1 argmax ids); sampled chains: 1 (p(x), q(x), candidates);
    greedy trees: 1; sampled trees: 2 (candidates and row sums, then the final token). The
    results equal the CPU's, with the same seed."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3  # (k + 1, V)
    p = logits.softmax(-1)
    q = torch.randn(3, 50, generator=g).softmax(-1)
    ids = torch.tensor([int(logits[0].argmax()), 7, 9])
    parents = torch.tensor([0, 1, 0])
    cases = [
        (lambda lg, pp, qq: greedy_verify(ids, lg), 1),
        (lambda lg, pp, qq: rejection_sample(ids, qq, pp, torch.Generator().manual_seed(3)), 1),
        (lambda lg, pp, qq: rejection_sample(ids, None, pp, torch.Generator().manual_seed(3)), 1),
        (lambda lg, pp, qq: greedy_verify_tree(ids, parents, lg), 1),
        (lambda lg, pp, qq: rejection_sample_tree(ids, parents, pp, torch.Generator().manual_seed(3)), 2),
    ]
    for fn, copies in cases:
        want: VerifyResult = fn(logits, p, q)
        with stand_in_device() as mode:
            got = fn(logits.to(STAND_IN), p.to(STAND_IN), q.to(STAND_IN))
            assert mode.host_reads == copies
        assert not is_stand_in(got.tokens)
        assert (got.num_accepted, got.tokens.tolist()) == (want.num_accepted, want.tokens.tolist())
    with stand_in_device():
        assert is_stand_in(sample(p.to(STAND_IN), torch.Generator().manual_seed(1)))


@pytest.mark.parametrize(("kind", "per_pass"), [("none", 1), ("draft_model", 2), ("prompt_lookup", 1)])
def test_the_loop_copies_little_to_the_host(models, tiny_tokenizer, kind: str, per_pass: int) -> None:
    """Host copies (each a wait for the device) per target pass of a whole greedy generation, the
    prefill included: the target alone and prompt lookup 1 (the argmax ids); a draft model 2 (its
    drafted ids, once per draft, and the argmax ids). The model's own forward copies nothing, and
    no copy moves logits (each pass copies fewer numbers than one row of V)."""
    with stand_in_device() as mode:
        generator = make_generator(kind, place(models, STAND_IN), tiny_tokenizer)
        generate(generator, GREEDY)  # first use: one-off checks
        mode.host_reads = mode.host_elements = 0
        result = generate(generator, GREEDY)
    passes = result.stats.target_forward_passes
    assert mode.host_reads <= per_pass * passes
    assert mode.host_elements < passes * len(tiny_tokenizer) // 10 and mode.largest_read < len(tiny_tokenizer)


# ------------------------------------------------------------------ every path: stand-in == CPU
@pytest.mark.parametrize("kind", CHAIN_KINDS)
def test_greedy_chains_equal_the_cpu_and_target_only(models, tiny_tokenizer, kind: str) -> None:
    cpu, device = both(kind, models, tiny_tokenizer, GREEDY, num_speculative_tokens=3)
    assert device == cpu
    assert cpu == tokens(make_generator("none", models, tiny_tokenizer), GREEDY)


@pytest.mark.parametrize("kind", CHAIN_KINDS)
def test_sampled_chains_equal_the_cpu_with_the_same_seed(models, tiny_tokenizer, kind: str) -> None:
    cpu, device = both(kind, models, tiny_tokenizer, SAMPLED, num_speculative_tokens=3)
    assert device == cpu


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", TREE_KINDS)
def test_trees_equal_the_cpu(models, tiny_tokenizer, kind: str, sampling: SamplingParams) -> None:
    cpu, device = both(kind, models, tiny_tokenizer, sampling, tree="default")
    assert device == cpu
    if sampling.greedy:
        assert cpu == tokens(make_generator("none", models, tiny_tokenizer), GREEDY)


@pytest.mark.parametrize("tree", [None, "default"])
def test_logprobs_equal_the_cpu(models, tiny_tokenizer, tree: str | None) -> None:
    def run(placed: dict[str, Any]) -> list:
        return (
            make_generator("draft_model", placed, tiny_tokenizer)
            .generate(PROMPT, SAMPLED, raw=True, tree=tree, logprobs=3)
            .logprobs
        )

    cpu = run(models)
    with stand_in_device():
        device = run(place(models, STAND_IN))
    assert [(e.token_id, [t for t, _ in e.top]) for e in device] == [(e.token_id, [t for t, _ in e.top]) for e in cpu]
    for a, b in zip(device, cpu, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("tree", [None, "default"])
def test_a_constraint_equals_the_cpu(models, tiny_tokenizer, sampling: SamplingParams, tree: str | None) -> None:
    constraint = Regex(r"(def|class) [a-z]{1,8}\(\):")
    options = {"constraint": constraint, "tree": tree}
    cpu, device = both("draft_model", models, tiny_tokenizer, sampling, **options)
    assert device == cpu
    text = tiny_tokenizer.decode(cpu, skip_special_tokens=True)
    assert text.startswith(("def ", "class "))


def test_the_scheduler_equals_the_cpu(models, tiny_tokenizer) -> None:
    """The server's batched path: greedy and sampled rows, draft model, prompt lookup and no
    proposer in one batch, joins mid-run; the same events as on the CPU."""
    from test_serve_scheduler import Client, make, run

    ps = [tiny_tokenizer.encode(t) for t in ("def add(a, b):", "for i in range(10):", "class Stack:", PROMPT)]

    def serve(placed: dict[str, Any], mode: StandInMode | None = None) -> list[list[int]]:
        scheduler = make((placed["target"], placed["draft"]), tiny_tokenizer, speculation="on")
        assert scheduler.runner.device == placed["target"].device
        if mode is not None:  # count the serving, not the start (it hashes a few rows of the weights)
            mode.largest_read = 0
        clients = [
            Client(ps[0], 16),
            Client(ps[1], 12, temperature=0.9, seed=5),
            Client(ps[2], 14, speculative=False, temperature=0.8, seed=2),
            Client(ps[3], 16, proposer="prompt_lookup", temperature=0.7, seed=3, logprobs=2),
        ]
        for c in clients[:2]:
            scheduler.submit(c.req)
        scheduler.run_once()
        for c in clients[2:]:
            scheduler.submit(c.req)
        run(scheduler)
        assert all(c.final is not None for c in clients)
        return [c.tokens for c in clients]

    cpu = serve(models)
    with stand_in_device() as mode:
        device = serve(place(models, STAND_IN), mode)
    assert device == cpu
    assert mode.largest_read < len(tiny_tokenizer)  # ids, a few probabilities, never a row of logits


# ------------------------------------------------------------------ the stand-in catches a device mix
def greedy_verify_without_the_copy(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """greedy_verify as it was before the device policy: the argmax stays on the logits' device."""
    target_ids = target_logits.argmax(dim=-1)  # (k + 1,)
    k = draft_ids.shape[0]
    mismatch = (draft_ids != target_ids[:k]).nonzero()
    n = int(mismatch[0, 0]) if mismatch.numel() else k
    return VerifyResult(n, target_ids[: n + 1].clone())


def test_the_stand_in_catches_a_missing_move(models, tiny_tokenizer, monkeypatch) -> None:
    """The crash the GPU showed ("Expected all tensors to be on the same device" in greedy_verify,
    even with speculative=False) happens on the stand-in too; the same run passes on the CPU."""
    monkeypatch.setattr(verify_module, "greedy_verify", greedy_verify_without_the_copy)
    assert tokens(make_generator("none", models, tiny_tokenizer), GREEDY)  # the CPU does not see it
    with stand_in_device():
        generator = make_generator("none", place(models, STAND_IN), tiny_tokenizer)
        with pytest.raises(RuntimeError, match="same device"):
            tokens(generator, GREEDY)
