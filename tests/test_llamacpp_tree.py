"""Token trees on the llamacpp backend (issue 31), on the real default GGUF pair.

A tree pass walks the tree depth-first on one sequence (:mod:`specdecode.models.llamacpp.tree`), so
in exact mode every node's logits and hidden state are bit-identical to decoding its branch token by
token; ``compact`` leaves the cache as plain decoding of the kept path would; greedy tree
speculation (static and dynamic trees, prompt lookup and the draft model) equals plain decoding;
sampled tree speculation follows the target's distribution (chi-square, ``stat_checks.P_MIN``).

Skipped, with the reason, when llama-cpp-python or the model packages are not installed.
"""

from __future__ import annotations

import pytest
import torch

from specdecode import SpeculativeGenerator
from specdecode.proposers import DraftModelProposer, PromptLookupConfig, PromptLookupProposer
from specdecode.proposers.base import ProposerBase
from specdecode.sampling import SamplingParams, logits_to_probs
from specdecode.tree import DraftTree, tree_attention
from specdecode.verify import VerifyResult, greedy_verify_tree

from conftest import load_default_gguf, plain_greedy
from stat_checks import P_MIN, chi_square_p

pytestmark = pytest.mark.slow

IDS = torch.tensor([(37 * i + 11) % 20000 + 100 for i in range(64)])
# root 0; 1, 2 children of 0; 3, 4 of 1; 5 of 3; 6 of 2 (three branches, depth 3)
PARENTS = torch.tensor([0, 0, 1, 1, 3, 2])
NODES = torch.tensor([500, 600, 700, 800, 900, 1000, 1100])


@pytest.fixture(scope="module")
def target():
    return load_default_gguf("target")


@pytest.fixture(scope="module")
def draft():
    return load_default_gguf("draft")


def _tree_inputs(cached: int) -> tuple[torch.Tensor, torch.Tensor]:
    depths, mask = tree_attention(PARENTS)
    attend = torch.cat([torch.ones(len(NODES), cached, dtype=torch.bool), mask], dim=1)  # (7, cached + 7)
    return cached + depths, attend


def _root_path(node: int) -> list[int]:
    parents = [-1, *PARENTS.tolist()]
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_tree_pass_equals_each_branch_decoded_token_by_token(target) -> None:
    runner, plain = target.make_runner(n_ctx=256), target.make_runner(n_ctx=256)
    runner.forward(IDS[:20])
    positions, attend = _tree_inputs(20)
    logits, hidden = runner.forward_masked(NODES, positions, attend, return_hidden=True)
    assert logits.shape == (7, target.vocab_size) and hidden.shape == (7, target.hidden_size)
    for node in range(7):
        plain.reset()
        plain.forward(IDS[:20])
        for step in _root_path(node):  # the branch one token per pass, as plain decoding runs it
            row, feature = plain.forward(NODES[step : step + 1], return_hidden=True)
        assert torch.equal(logits[node], row[0]), node  # bit for bit
        assert torch.equal(hidden[node], feature[0]), node


def test_compact_then_decode_equals_plain_decoding_of_the_kept_path(target) -> None:
    runner, plain = target.make_runner(n_ctx=256), target.make_runner(n_ctx=256)
    runner.forward(IDS[:20])
    positions, attend = _tree_inputs(20)
    runner.forward_masked(NODES, positions, attend)
    runner.compact(torch.tensor([20, 22, 26]))  # root, node 2, node 6: not the branch the walk ended on
    assert runner.length == 23
    after = runner.forward(IDS[40:43], num_logits=3)
    plain.forward(IDS[:20])
    plain.forward(NODES[[0, 2, 6]], num_logits=3)  # the kept path as a verification pass
    assert torch.equal(after, plain.forward(IDS[40:43], num_logits=3))
    with pytest.raises(ValueError, match="root path"):  # nodes 1 and 2 are siblings
        runner.forward_masked(NODES, *_tree_inputs(26))
        runner.compact(torch.tensor([26, 27, 28]))


def test_greedy_walk_decodes_what_greedy_verification_reads(target) -> None:
    plain, full, walk = (target.make_runner(n_ctx=256) for _ in range(3))
    nodes = NODES.clone()  # node 1 and its first child node 3: the target's own greedy tokens
    nodes[1] = int(plain.forward(torch.cat([IDS[:20], nodes[:1]]))[0].argmax())
    nodes[3] = int(plain.forward(nodes[1:2])[0].argmax())
    positions, attend = _tree_inputs(20)
    full.forward(IDS[:20])
    reference = full.forward_masked(nodes, positions, attend)
    walk.forward(IDS[:20])
    walked = walk.forward_masked(nodes, positions, attend, greedy=True)
    expected = greedy_verify_tree(nodes[1:], PARENTS, reference)
    assert expected.num_accepted >= 2
    assert torch.equal(greedy_verify_tree(nodes[1:], PARENTS, walked).tokens, expected.tokens)
    reached = [0, *expected.path.tolist()]
    assert all(torch.equal(walked[node], reference[node]) for node in reached)
    assert torch.isnan(walked[2]).all() and torch.isnan(walked[6]).all()  # the other branch: never decoded
    walk.compact(20 + torch.tensor(reached))
    assert walk.length == 20 + len(reached)


def test_not_a_tree_over_the_cache_is_refused(target) -> None:
    runner = target.make_runner(n_ctx=256)
    runner.forward(IDS[:10])
    positions, attend = _tree_inputs(10)
    partial = attend.clone()
    partial[3, 2] = False  # node 3 does not see cached token 2
    with pytest.raises(ValueError, match="attends to other entries"):
        runner.forward_masked(NODES, positions, partial)
    with pytest.raises(ValueError, match="position"):
        runner.forward_masked(NODES, positions + 1, attend)
    assert runner.length == 10
    runner.forward(IDS[10:11])  # nothing was recorded: the runner goes on as before
    positions, attend = _tree_inputs(11)
    runner.forward_masked(NODES, positions, attend)
    with pytest.raises(RuntimeError, match="compact"):
        runner.forward(IDS[:1])


@pytest.fixture(scope="module")
def tokenizer(target):
    from specdecode.models.backends import load_llamacpp_tokenizer

    return load_llamacpp_tokenizer(target)


PROMPT = (
    "Complete the following Python function:\n```python\ndef running_sum(xs: list[int]) -> list[int]:\n"
    '    """Return the running sums of xs: running_sum([1, 2, 3]) == [1, 3, 6]."""\n```'
)


@pytest.mark.parametrize(
    "proposer, tree",
    [
        ("prompt_lookup", "tree8"),
        ("prompt_lookup", "dynamic:8"),
        ("draft_model", "tree8"),
        ("draft_model", "dynamic:6"),
    ],
)
def test_greedy_tree_speculation_equals_plain_decoding(target, draft, tokenizer, proposer, tree) -> None:
    made = (
        PromptLookupProposer(PromptLookupConfig(min_ngram=2))
        if proposer == "prompt_lookup"
        else DraftModelProposer(draft)
    )
    generator = SpeculativeGenerator(target, tokenizer=tokenizer, proposer=made)
    ids = generator.encode_prompt(PROMPT).tolist()
    plain = plain_greedy(target, ids, 40, tokenizer)  # decoded once for the four cases
    sampling = SamplingParams(max_new_tokens=40)
    speculative = generator.generate(ids, sampling, tree=tree, schedule="ungated")  # every draft sent
    assert speculative.token_ids == plain
    assert speculative.stats.tree != "none" and speculative.stats.accepted_tokens > 0


def test_sampled_tree_speculation_walks_every_node_and_keeps_the_sampled_path(target, tokenizer) -> None:
    """Sampling reads the rows of the nodes its walk reaches, which the randomness picks, so the
    runner decodes every node (no greedy hint): a seeded run repeats itself and leaves the cache
    holding the emitted text (the next token's logits match a fresh runner fed the output). That
    ``compact`` rebuilds a path off the walked one is tested above, bit for bit."""
    generator = SpeculativeGenerator(
        target, tokenizer=tokenizer, proposer=PromptLookupProposer(PromptLookupConfig(min_ngram=1))
    )
    sampling = SamplingParams(temperature=0.8, max_new_tokens=32, seed=3)
    first = generator.generate(PROMPT, sampling, tree="tree8")
    again = generator.generate(PROMPT, sampling, tree="tree8")
    assert first.token_ids == again.token_ids and len(first.token_ids) == 32
    assert first.stats.draft_tokens > 0
    runner = generator.target  # the cache: the prompt and the output, up to the last token or so
    full = torch.cat([generator.encode_prompt(PROMPT), torch.tensor(first.token_ids)])
    cached = runner.length
    assert len(full) - 2 <= cached <= len(full)
    fresh = target.make_runner(n_ctx=512)
    fresh.forward(full[:cached])
    probe = torch.tensor([13])  # any next token: both caches must hold the same context
    mine, theirs = runner.forward(probe)[0], fresh.forward(probe)[0]
    assert int(mine.argmax()) == int(theirs.argmax())
    assert (mine - theirs).abs().max() < 0.05 * (1 + float(theirs.abs().max()))  # prefill rounding only


class FixedTree(ProposerBase):
    """Drafts one fixed tree once the context is ``length`` tokens long (nodes ``ids``, parents
    ``parents`` as :class:`~specdecode.tree.DraftTree` numbers them), nothing at other lengths: a
    deterministic proposal, as every tree is under sampling."""

    name = "fixed_tree"
    supports_tree = True

    def __init__(self, length: int, ids: list[int], parents: list[int]) -> None:
        self.length = length
        self.tree = DraftTree(torch.tensor(ids), torch.tensor(parents))

    def reset(self) -> None: ...

    def propose(self, context, num_tokens, sampling, generator):  # pragma: no cover - chains unused
        raise AssertionError

    def propose_tree(self, context, tree, sampling, generator) -> DraftTree:
        return self.tree if context.shape[0] == self.length else DraftTree.empty()

    def observe(self, result: VerifyResult) -> None: ...


SAMPLED_TREE_RUNS = 300  # seeds 0-299; the power below is for this many


def test_sampled_tree_speculation_follows_the_target(target) -> None:
    """Temperature 1, top-k 2, a tree over the second and third tokens (both second tokens the
    likeliest first allows, and the likelier third under the first of them), walked node by node on
    llama.cpp: tokens 1-3 follow the target's exact joint distribution from llama.cpp's own logits
    (chi-square over the 4 pairs and the 8 triples, p > P_MIN each, 300 seeded samples), with drafts
    accepted, at both branches, and rejected. Token 3 is read from a branch node's row (a bonus
    token) or recovered, so a branch scored with another node's logits fails here; given its
    sibling's row, whose top-2 law is close to its own on this prompt, it does not.

    Power at 300 samples, simulated from this prompt's laws on llama.cpp (1,000 runs per case,
    the rule of ``rejection_sample_tree``, these two chi-square tests): a bug is caught with
    probability 1.00 when the second branch is scored with the root's row (total variation of the
    triples 0.15), when the first branch's child is (0.66), or when a rejected child stays in the
    residual (0.19; 0.99 at 200 samples); not when the second branch takes its sibling's row
    (0.003). A correct sampler fails with probability 0.001 (5,000 runs; 0.002 at 400 samples, the
    count before, 0.004 at 200)."""
    from specdecode.models.backends import load_llamacpp_tokenizer

    sampling = SamplingParams(temperature=1.0, top_k=2, max_new_tokens=3)  # 2: the last token gets no draft
    prompt = load_llamacpp_tokenizer(target).encode("My favourite fruit is")  # no dominant next token
    runner = target.make_runner(n_ctx=64)

    def probs(continuation: list[int]) -> torch.Tensor:  # the target's law after prompt + continuation
        runner.truncate(len(prompt))
        return logits_to_probs(runner.forward(torch.tensor(continuation))[0].double(), sampling).double()

    p1 = logits_to_probs(runner.forward(torch.tensor(prompt))[0].double(), sampling).double()  # as the engine prefills
    pairs: dict[tuple[int, ...], float] = {}
    triples: dict[tuple[int, ...], float] = {}
    laws: dict[tuple[int, ...], torch.Tensor] = {}
    for t1 in p1.nonzero().flatten().tolist():
        laws[(t1,)] = probs([t1])
        for t2 in laws[(t1,)].nonzero().flatten().tolist():
            pairs[(t1, t2)] = float(p1[t1] * laws[(t1,)][t2])
            laws[(t1, t2)] = probs([t1, t2])
            for t3 in laws[(t1, t2)].nonzero().flatten().tolist():
                triples[(t1, t2, t3)] = pairs[(t1, t2)] * float(laws[(t1, t2)][t3])
    top1 = int(p1.argmax())
    a, b = laws[(top1,)].topk(2).indices.tolist()
    c = int(laws[(top1, a)].argmax())
    spec = SpeculativeGenerator(target, proposer=FixedTree(len(prompt) + 1, [a, b, c], [0, 0, 1]))
    results = [
        spec.generate(prompt, SamplingParams(**{**sampling.__dict__, "seed": seed}), tree=[[0], [1], [0, 0]])
        for seed in range(SAMPLED_TREE_RUNS)
    ]
    for law, n in ((pairs, 2), (triples, 3)):
        keys = sorted(law)
        index = {key: i for i, key in enumerate(keys)}
        samples = [index.get(tuple(r.token_ids[:n]), len(keys)) for r in results]  # impossible: own bin
        expected = torch.tensor([law[k] for k in keys] + [0.0], dtype=torch.float64)
        assert chi_square_p(samples, expected / expected.sum()) > P_MIN, f"tokens 1-{n}"
    accepted = sum(r.stats.accepted_tokens for r in results)
    branches = {r.token_ids[1] for r in results if r.token_ids[0] == top1 and r.stats.accepted_tokens}
    assert 40 < accepted < 2 * len(results)  # drafts accepted on some runs, rejected on others
    assert {a, b} <= branches  # both branches were accepted at some point
