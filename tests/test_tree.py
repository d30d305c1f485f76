"""Token trees: compiled shapes, tree verification, tree passes through the KV cache, and lossless
end to end (greedy float32 equality with target-only decoding; sampled distributions)."""

from __future__ import annotations

import json

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.models.torch.compat import cache_kwargs
from specdecode.models.torch.runner import ModelRunner
from specdecode.proposers.base import ProposerBase
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.proposers.prompt_lookup import PromptLookupProposer, find_continuations
from specdecode.tree import (
    TREE_SHAPES,
    DraftTree,
    DynamicTree,
    build_dynamic_tree,
    build_static_tree,
    compile_paths,
    greedy_paths,
    parse_tree,
    tree_attention,
    trie_tree,
)
from specdecode.verify import VerifyResult, greedy_verify_tree, rejection_sample_tree

from conftest import make_tiny_model, perturbed_copy
from reference import exact_marginals, target_only_greedy
from stat_checks import P_MIN, chi_square_p

PROMPTS = [[5, 17, 33, 2, 9, 60, 11], [40, 41, 42], [7]]


# ------------------------------------------------------------------ compiled trees (hand-checked)
def test_compile_small_tree() -> None:
    shape = compile_paths([[0, 0, 0], [1], [0], [0, 1], [1, 0], [0, 0]])
    # nodes: 1=[0] 2=[1] 3=[0,0] 4=[0,1] 5=[1,0] 6=[0,0,0]
    assert shape.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert shape.parents.tolist() == [0, 0, 1, 1, 2, 3]
    assert shape.ranks.tolist() == [0, 1, 0, 1, 0, 0]
    assert shape.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    expected_mask = [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ]
    assert shape.mask.int().tolist() == expected_mask
    assert shape.retrieve.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    assert shape.widths() == [2, 2, 1, 1, 0, 0, 0]
    assert shape.num_nodes == 6 and shape.depth == 3


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        ([], "non-empty"),
        ([[0], [0, 0, 0]], "no parent path"),
        ([[0], [0]], "duplicate"),
        ([[-1]], "ranks must be integers >= 0"),
        ([[0], [0.5]], "ranks must be integers"),
        ([[]], "non-empty list of ranks"),
    ],
)
def test_bad_paths_are_clear_errors(paths, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compile_paths(paths)


def test_parse_tree(tmp_path) -> None:
    assert parse_tree("default").paths == compile_paths(TREE_SHAPES["default"]).paths
    assert parse_tree("dynamic:10") == DynamicTree(budget=10)
    assert parse_tree("dynamic:10:3:2") == DynamicTree(10, 3, 2)
    path = tmp_path / "t.json"
    path.write_text(json.dumps([[0], [1], [0, 0]]))
    assert parse_tree(str(path)).parents.tolist() == [0, 0, 1]
    for bad in ("nonsense", "dynamic:x", "dynamic:0", ""):
        with pytest.raises(ValueError, match="tree"):
            parse_tree(bad)


def test_greedy_paths_prefer_likely_nodes() -> None:
    paths = greedy_paths(5, [0.8, 0.1], max_depth=8)
    assert paths == [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]  # 0.8^5 = 0.33 > 0.1
    assert [1] in greedy_paths(12, [0.6, 0.3], max_depth=8)
    for name, shape in TREE_SHAPES.items():
        compile_paths(shape, name)  # every named shape is a valid tree


def test_tree_attention_rejects_bad_parents() -> None:
    with pytest.raises(ValueError, match="topological"):
        tree_attention(torch.tensor([0, 2]))
    depths, mask = tree_attention(torch.tensor([0, 1, 0]))
    assert depths.tolist() == [0, 1, 2, 1]
    assert mask[2].tolist() == [True, True, True, False]


def test_prune_and_trie() -> None:
    tree = DraftTree(torch.tensor([10, 11, 12, 13]), torch.tensor([0, 1, 2, 0]))
    pruned = tree.prune(1)
    assert pruned.ids.tolist() == [10, 13] and pruned.parents.tolist() == [0, 0]
    trie = trie_tree([[1, 2, 3], [1, 2, 4], [5]], budget=10, max_depth=3)
    assert trie.ids.tolist() == [1, 2, 3, 4, 5] and trie.parents.tolist() == [0, 1, 2, 2, 0]
    assert len(trie_tree([[1, 2, 3], [4, 5]], budget=4, max_depth=2)) == 4


# ------------------------------------------------------------------ building trees from scores
def _scores(V: int, best: list[int]) -> torch.Tensor:
    """Log-probabilities ranking ``best`` first, in order."""
    s = torch.full((V,), -20.0)
    for r, t in enumerate(best):
        s[t] = -float(r)
    return torch.log_softmax(s, -1)


def test_build_static_tree_ranks_candidates() -> None:
    shape = compile_paths([[0], [1], [0, 0], [0, 1], [1, 0]])
    table = {1: [7, 8], 2: [9]}  # node -> ranked next tokens

    def expand(nodes, ids, parents):
        assert nodes == [1, 2] and ids == [3, 4] and parents == [0, 0]
        return torch.stack([_scores(12, table[n]) for n in nodes])

    tree = build_static_tree(shape, _scores(12, [3, 4]), expand)
    assert tree.ids.tolist() == [3, 4, 7, 8, 9] and tree.parents.tolist() == [0, 0, 1, 1, 2]


def test_build_dynamic_tree_keeps_the_most_likely_nodes() -> None:
    V = 10
    root = torch.log(torch.tensor([0.5, 0.3, 0.2] + [0.0] * (V - 3)))

    def expand(nodes, ids, parents):
        # after token 0: 0.9 on token 5; after token 1: 0.5 / 0.5 on 6, 7
        rows = {0: [0.0] * 5 + [0.9, 0.1, 0, 0, 0], 1: [0.0] * 6 + [0.5, 0.5, 0, 0]}
        return torch.log(torch.tensor([rows[ids[n - 1]] for n in nodes]))

    tree = build_dynamic_tree(DynamicTree(budget=4, depth=2, top_k=2), root, expand)
    # cumulative: 0 -> .5, 1 -> .3, 0.5 -> .45, 1.6 -> .15, 1.7 -> .15, 0.6 -> .05
    assert tree.ids.tolist() == [0, 1, 5, 6] and tree.parents.tolist() == [0, 0, 1, 2]


# ------------------------------------------------------------------ verification (pure functions)
def test_greedy_verify_tree_takes_a_later_branch() -> None:
    V = 8
    ids = torch.tensor([3, 4, 5, 6])  # node 1=3 (root), 2=4 (root), 3=5 (under 2), 4=6 (under 2)
    parents = torch.tensor([0, 0, 2, 2])
    logits = torch.zeros(5, V)
    logits[0, 4] = logits[2, 6] = logits[4, 1] = 1.0  # root -> 4, node 2 -> 6, node 4 -> 1
    r = greedy_verify_tree(ids, parents, logits)
    assert r.num_accepted == 2 and r.tokens.tolist() == [4, 6, 1] and r.path.tolist() == [2, 4]
    logits[0] = 0
    logits[0, 7] = 1.0  # no child matches: the target's own token
    r = greedy_verify_tree(ids, parents, logits)
    assert r.num_accepted == 0 and r.tokens.tolist() == [7] and r.path.tolist() == []
    with pytest.raises(ValueError, match="N \\+ 1"):
        greedy_verify_tree(ids, parents, logits[:3])


def test_rejection_sample_tree_is_exact() -> None:
    """Root with three candidates (one repeated) and a second level under the first: the first
    token follows p_root and, after candidate 2, the second follows p_2 (chi-square p > P_MIN,
    20,000 seeded draws)."""
    V = 6
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(5, V, generator=g) * 1.5, -1)  # (N + 1, V)
    ids = torch.tensor([2, 4, 2, 1])  # node 1=2, node 2=4, node 3=2 (repeat), node 4=1 under node 1
    parents = torch.tensor([0, 0, 0, 1])
    firsts, seconds, accepted = [], [], 0
    for seed in range(20_000):
        r = rejection_sample_tree(ids, parents, probs, torch.Generator().manual_seed(seed))
        firsts.append(int(r.tokens[0]))
        accepted += r.num_accepted > 0
        if int(r.tokens[0]) == 2:
            assert r.path[0] == 1  # the first of the two equal candidates
            seconds.append(int(r.tokens[1]))
    assert chi_square_p(firsts, probs[0]) > P_MIN
    assert chi_square_p(seconds, probs[1]) > P_MIN
    expected_accept = float(probs[0, 2] + probs[0, 4])
    assert abs(accepted / 20_000 - expected_accept) < 0.02


def test_rejection_sample_tree_chain_equals_one_hot_rejection() -> None:
    """On a chain, the tree rule is rejection sampling with a one-hot q: same acceptance law."""
    V = 5
    probs = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(3)), -1)
    chain = DraftTree.chain(torch.tensor([1, 2, 3]))
    counts = torch.zeros(4)
    for seed in range(5_000):
        counts[
            rejection_sample_tree(chain.ids, chain.parents, probs, torch.Generator().manual_seed(seed)).num_accepted
        ] += 1
    p1, p2, p3 = float(probs[0, 1]), float(probs[1, 2]), float(probs[2, 3])
    law = torch.tensor([1 - p1, p1 * (1 - p2), p1 * p2 * (1 - p3), p1 * p2 * p3])
    assert chi_square_p(sum(([i] * int(c) for i, c in enumerate(counts)), []), law) > P_MIN


# ------------------------------------------------------------------ the runner: masks and compaction
def test_tree_pass_then_compact_equals_fresh_prefill(tiny_target) -> None:
    prefix = torch.tensor([3, 14, 15, 92])
    runner = ModelRunner(tiny_target)
    runner.forward(prefix[:3], num_logits=1)
    # tree after root 92: nodes 1=65, 2=35 (siblings), 3=89 under 2, 4=79 under 3
    parents = torch.tensor([0, 0, 2, 3])
    depths, mask = tree_attention(parents)
    inputs = torch.tensor([92, 65, 35, 89, 79])
    attend = torch.cat([torch.ones(5, 3, dtype=torch.bool), mask], dim=1)
    tree_logits = runner.forward_masked(inputs, 3 + depths, attend)
    path = torch.tensor([92, 35, 89, 79])
    fresh = ModelRunner(tiny_target).forward(torch.cat([prefix[:3], path]), num_logits=4)
    torch.testing.assert_close(tree_logits[[0, 2, 3, 4]], fresh, rtol=1e-5, atol=1e-5)
    runner.compact(torch.tensor([3, 5, 6]))  # root, node 2, node 3 accepted
    assert runner.length == 6
    after = runner.forward(torch.tensor([79, 32]), num_logits=2)
    expected = ModelRunner(tiny_target).forward(torch.tensor([3, 14, 15, 92, 35, 89, 79, 32]), num_logits=2)
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="increasing"):
        runner.compact(torch.tensor([5, 4]))


class _MaskBlind(torch.nn.Module):
    """A model that drops custom masks and positions: trees must refuse it."""

    def __init__(self, model) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, input_ids, past_key_values=None, use_cache=False, logits_to_keep=0, **ignored):
        cache = cache_kwargs(self.inner, past_key_values)  # an old-style forward in front of today's model
        return self.inner(input_ids=input_ids, **cache, use_cache=use_cache, logits_to_keep=logits_to_keep)


def test_models_that_ignore_tree_masks_fail_clearly(tiny_target) -> None:
    runner = ModelRunner(_MaskBlind(tiny_target))  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="does not honour"):
        runner.check_masking()
    other = make_tiny_model(seed=3)
    other.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa or eager"):
        ModelRunner(other).check_masking()


# ------------------------------------------------------------------ lossless, end to end
@pytest.mark.parametrize("draft_name", ["identical", "unrelated", "perturbed"])
@pytest.mark.parametrize("tree", ["tree8", "dynamic:10:4:3", [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]]])
def test_greedy_tree_equals_target_only(tiny_pair, draft_name: str, tree) -> None:
    target = tiny_pair["target"]
    spec = SpeculativeGenerator(target, tiny_pair[draft_name])
    sampling = SamplingParams(max_new_tokens=40)
    lengths = []
    for prompt in PROMPTS:
        result = spec.generate(prompt, sampling, tree=tree)
        assert result.token_ids == target_only_greedy(target, prompt, 40)
        lengths.append(result.stats.mean_acceptance_length)
        assert result.stats.tree != "none"
    depth = parse_tree(tree).depth
    mean = sum(lengths) / len(lengths)
    if draft_name == "identical" and isinstance(tree, str) and tree.startswith("dynamic"):
        assert mean > 2.5  # the kept nodes are the likeliest, not always the whole top-1 path
    elif draft_name == "identical":
        assert mean == pytest.approx(depth + 1, rel=0.1)  # whole root paths accepted (less at the end)
    elif draft_name == "unrelated":
        assert mean < 1.3
    else:
        assert 1.3 < mean < depth + 1


class OracleTree(ProposerBase):
    """Knows target-only greedy output; every step offers a wrong first child and the right token
    as the second, at every depth: only non-first branches are ever correct."""

    name = "oracle_tree"
    supports_tree = True

    def __init__(self, prompt: list[int], answer: list[int], V: int) -> None:
        self.full = prompt + answer
        self.V = V

    def reset(self) -> None: ...

    def propose(self, context, num_tokens, sampling, generator):  # pragma: no cover - chains unused
        raise AssertionError

    def propose_tree(self, context, tree, sampling, generator) -> DraftTree:
        T = context.shape[0]
        right = self.full[T : T + 3]
        ids, parents, node = [], [], 0
        for token in right:
            ids += [(token + 1) % self.V, token]
            parents += [node, node]
            node = len(ids)
        return DraftTree(torch.tensor(ids, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64))

    def observe(self, result: VerifyResult) -> None: ...


def test_non_first_branches_are_accepted(tiny_target) -> None:
    prompt = PROMPTS[0]
    answer = target_only_greedy(tiny_target, prompt, 60)
    spec = SpeculativeGenerator(tiny_target, proposer=OracleTree(prompt, answer, tiny_target.config.vocab_size))
    result = spec.generate(prompt, SamplingParams(max_new_tokens=41), tree="dynamic:6:3:2")
    assert result.token_ids == answer[:41]
    assert result.stats.accepted_tokens == 30  # 10 steps of 3 accepted + 1, after the prefill's token


def test_prompt_lookup_tree_equals_target_only(tiny_target) -> None:
    prompt = [5, 6, 7, 8, 5, 6, 9, 9, 5, 6, 7, 1, 5, 6]
    spec = SpeculativeGenerator(tiny_target, proposer=PromptLookupProposer())
    result = spec.generate(prompt, SamplingParams(max_new_tokens=30), tree="tree8")
    assert result.token_ids == target_only_greedy(tiny_target, prompt, 30)
    assert find_continuations(torch.tensor(prompt), 2, 2, 1, 3) == [[7, 1], [9, 9], [7, 8]]


def test_tree_with_a_reduced_draft_head(tiny_pair, tmp_path) -> None:
    from specdecode.proposers.draft_model import DraftModelConfig

    path = tmp_path / "map.npy"
    import numpy as np

    np.save(path, np.arange(0, 96, 2, dtype=np.int64))  # even ids only
    proposer = DraftModelProposer(tiny_pair["perturbed"], DraftModelConfig(token_map=str(path)))
    spec = SpeculativeGenerator(tiny_pair["target"], proposer=proposer)
    for prompt in PROMPTS:
        result = spec.generate(prompt, SamplingParams(max_new_tokens=30), tree="dynamic:8:4:2")
        assert result.token_ids == target_only_greedy(tiny_pair["target"], prompt, 30)
        drafted = result.stats.draft_tokens
        assert drafted > 0


def test_tree_errors(tiny_pair) -> None:
    from specdecode.proposers.suffix import SuffixProposer

    spec = SpeculativeGenerator(tiny_pair["target"], tiny_pair["perturbed"])
    with pytest.raises(ValueError, match="schedule must be 'constant'"):
        spec.generate([1, 2], SamplingParams(max_new_tokens=4), tree="tree8", schedule="heuristic")
    with pytest.raises(ValueError, match="tree must be"):
        spec.generate([1, 2], SamplingParams(max_new_tokens=4), tree="bogus")
    chains_only = SpeculativeGenerator(tiny_pair["target"], proposer=SuffixProposer())
    assert not SuffixProposer.supports_tree
    with pytest.raises(ValueError, match="drafts chains only"):
        chains_only.generate([1, 2], SamplingParams(max_new_tokens=4), tree="tree8")


# ------------------------------------------------------------------ sampled distribution
V_SMALL = 12
SAMPLING = SamplingParams(temperature=0.8, top_k=9, top_p=0.95, max_new_tokens=3)


@pytest.mark.parametrize("tree", [[[0], [1], [2], [0, 0], [0, 1], [1, 0]], "dynamic:6:3:2"])
def test_sampled_tokens_follow_the_target_with_trees(tree) -> None:
    """Trees of width 3 and 2: the first three tokens follow the exact target-only marginals
    (chi-square p > P_MIN, 1,500 seeded samples); positions 2 and 3 are accepted, recovered or
    bonus tokens depending on the step."""
    target = make_tiny_model(vocab_size=V_SMALL, seed=5, init=0.3)
    draft = perturbed_copy(target, noise=0.1, seed=6)
    prompt = [3, 1, 4]
    exact = exact_marginals(target, prompt, 3, SAMPLING)
    spec = SpeculativeGenerator(target, draft)
    samples = [
        spec.generate(prompt, SamplingParams(**{**SAMPLING.__dict__, "seed": s}), tree=tree) for s in range(1_500)
    ]
    mean = sum(r.stats.mean_acceptance_length for r in samples) / len(samples)
    assert 1.2 < mean < 3.0, f"the tree should be accepted only partly, mean length {mean:.2f}"
    for pos in range(3):
        tokens = [r.token_ids[pos] for r in samples]
        assert chi_square_p(tokens, exact[pos]) > P_MIN, f"position {pos} differs from the target's"
