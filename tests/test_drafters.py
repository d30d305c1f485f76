"""Trained drafters as proposers (Medusa heads, an EAGLE head): the target's features reach them at the
right positions (also after rejections and tree steps), their drafts equal a cache-less reference,
and decoding stays lossless: greedy float32 equality with target-only decoding (chains, static and
dynamic trees) for drafters that agree fully, never, partly, and random ones; the sampled
distribution of the first tokens (chi-square, the tolerance of ``stat_checks``). Plus save / load,
the target-identity check, the missing-drafter message and the registry (the server: test_serve_scheduler)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.drafters import DrafterConfig, build_drafter, default_drafter_dir, load_drafter, save_drafter
from specdecode.drafters.heads import EagleHead, MedusaHeads
from specdecode.errors import IncompatibleModelsError
from specdecode.models.torch.runner import ModelRunner
from specdecode.proposers import (
    PROPOSERS,
    DraftModelProposer,
    EagleConfig,
    EagleProposer,
    MedusaConfig,
    MedusaProposer,
    make_proposer,
)
from specdecode.proposers.base import DEFAULT_NUM_SPECULATIVE_TOKENS, ProposerBase, default_num_speculative_tokens
from specdecode.proposers.hybrid import with_prompt_lookup
from specdecode.tree import children_lists, parse_tree

from conftest import make_tiny_model
from reference import exact_marginals, target_only_greedy
from stat_checks import P_MIN, chi_square_p

PROMPTS = [[5, 17, 33, 2, 9, 60, 11], [40, 41, 42], [7]]
NEW = 40
K = 4  # Medusa heads


# ------------------------------------------------------------------ drafters for the tests
def make_drafter(kind: str, target, head_ids: torch.Tensor | None = None, seed: int = 0) -> MedusaHeads | EagleHead:
    """A randomly initialised drafter attached to ``target`` (Medusa heads get random weights, not
    their identity initialisation, so that they differ from each other)."""
    V = target.config.vocab_size
    ids = torch.arange(V) if head_ids is None else head_ids
    torch.manual_seed(seed)
    drafter = build_drafter(DrafterConfig.for_target(kind, target, len(ids), num_heads=K), ids)
    if kind == "medusa":
        for block in drafter.blocks:
            torch.nn.init.normal_(block.weight, std=0.2)
    return drafter.attach(target).eval()


def self_generated(target, batch: int = 16, length: int = 24, prefix: int = 4, seed: int = 0) -> torch.Tensor:
    """Training text: random ``prefix``-token prompts and the target's greedy continuations, int64 ``[B, L]``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.config.vocab_size, (batch, prefix), generator=g)
    with torch.no_grad():
        while tokens.shape[1] < length:
            tokens = torch.cat([tokens, target(tokens).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


def distill(drafter, target, steps: int, seed: int = 0):
    """Brief self-distillation (a few Adam steps, teacher forcing) on :func:`self_generated` text:
    Medusa head i on f_p learns the target's choice of token p + 1 + i; EAGLE learns f_{p+1} and the
    target's choice of token p + 2 from the pair (f_p, x_{p+1}). Choices outside the map are left out."""
    V = target.config.vocab_size
    column = torch.full((V,), -100).index_copy_(0, drafter.head_ids, torch.arange(len(drafter.head_ids)))
    tokens = self_generated(target, seed=seed)  # (B, L)
    batch, length = tokens.shape
    with torch.no_grad():
        feats = target.model(tokens).last_hidden_state  # (B, L, H)
        labels = column[target.lm_head(feats).argmax(-1)]  # (B, L): map column of the target's token p + 1
    optimizer = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    positions = torch.arange(1, length).expand(batch, -1)  # (B, L - 1)
    drafter.train()
    for _ in range(steps):
        if isinstance(drafter, MedusaHeads):
            logits = drafter.logits(drafter(feats[:, : length - K]))  # (B, L - K, K, N)
            want = torch.stack([labels[:, 1 + i : length - K + 1 + i] for i in range(K)], dim=-1)  # (B, L - K, K)
            loss = F.cross_entropy(logits.flatten(0, 2), want.flatten())
        else:
            out = drafter(feats[:, :-1], tokens[:, 1:], positions)  # (B, L - 1, H): predicted f_{p+1}
            loss = F.cross_entropy(drafter.logits(out).flatten(0, 1), labels[:, 1:].flatten())
            loss = loss + F.smooth_l1_loss(out, feats[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


def proposer(drafter) -> MedusaProposer | EagleProposer:
    return MedusaProposer(drafter) if isinstance(drafter, MedusaHeads) else EagleProposer(drafter)


def bigram_target():
    """A one-layer target whose attention output is zeroed: its feature f_p depends on token x_p only,
    so its greedy output is a fixed function of the last token (prompts run into a 10-cycle)."""
    target = make_tiny_model(layers=1, seed=3)
    with torch.no_grad():
        target.model.layers[0].self_attn.o_proj.weight.zero_()
    return target


def oracle(kind: str, target):
    """Drafters that agree with :func:`bigram_target` by construction (EAGLE) or by fitting (Medusa).

    EAGLE: ``fc`` passes the token embedding on ([I | 0]) and the head's decoder layer and final norm
    are copies of the target's, so the head computes the target's own next feature, exactly.
    Medusa: the target maps token x to g(x); head i on f_p must score g^(i+1)(x_p); with one feature
    per token this is a 96-row lookup, fitted by 300 full-batch steps (100% on the tokens the test
    prompts visit)."""
    drafter = make_drafter(kind, target)
    V = target.config.vocab_size
    with torch.no_grad():
        if kind == "eagle":
            H = target.config.hidden_size
            drafter.fc.weight.zero_()
            drafter.fc.bias.zero_()
            drafter.fc.weight[:, :H] = torch.eye(H)
            drafter.decoder.layers[0].load_state_dict(target.model.layers[0].state_dict())
            drafter.decoder.norm.load_state_dict(target.model.norm.state_dict())
            return drafter
        feats = target.model(torch.arange(V)[:, None]).last_hidden_state[:, 0]  # (V, H): f of each token
        g = target.lm_head(feats).argmax(-1)  # (V,)
    powers = [g[g]]  # g^2
    for _ in range(K - 1):
        powers.append(g[powers[-1]])
    want = torch.stack(powers, dim=1)  # (V, K): head i (0-based) scores g^(i+2)(x)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-2)
    for _ in range(300):
        loss = F.cross_entropy(drafter.logits(drafter(feats)).flatten(0, 1), want.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def cases(tiny_target) -> dict:
    """Per (kind, agreement): (target, drafter, expected greedy outputs of PROMPTS)."""
    bigram = bigram_target()
    answers = {id(t): [target_only_greedy(t, p, NEW) for p in PROMPTS] for t in (tiny_target, bigram)}
    picked = {token for answer in answers[id(tiny_target)] for token in answer}
    never = torch.tensor([v for v in range(tiny_target.config.vocab_size) if v not in picked])  # (N,)
    out = {}
    for kind in ("medusa", "eagle"):
        out[kind, "fully"] = bigram, oracle(kind, bigram), answers[id(bigram)]
        out[kind, "never"] = tiny_target, make_drafter(kind, tiny_target, never), answers[id(tiny_target)]
        trained = distill(make_drafter(kind, tiny_target), tiny_target, steps=40)
        out[kind, "partly"] = tiny_target, trained, answers[id(tiny_target)]
        out[kind, "random"] = tiny_target, make_drafter(kind, tiny_target, seed=1), answers[id(tiny_target)]
    return out


# ------------------------------------------------------------------ the target's features
def test_runner_returns_the_features_and_the_plain_logits(tiny_target) -> None:
    ids = torch.tensor([5, 17, 33, 2, 9])
    plain, featured = ModelRunner(tiny_target), ModelRunner(tiny_target)
    logits = plain.forward(ids[:3], num_logits=2)
    logits_h, hidden = featured.forward(ids[:3], num_logits=2, return_hidden=True)
    assert torch.equal(logits, logits_h) and hidden.shape == (3, tiny_target.config.hidden_size)
    # a tree pass: 3 and 4 are siblings after 2
    attend = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 1]], dtype=torch.bool)
    masked = plain.forward_masked(ids[3:], torch.tensor([3, 3]), attend)
    masked_h, tree_hidden = featured.forward_masked(ids[3:], torch.tensor([3, 3]), attend, return_hidden=True)
    assert torch.equal(masked, masked_h)
    with torch.no_grad():
        full = tiny_target.model(ids[None, :4]).last_hidden_state[0]  # (4, H)
        sibling = tiny_target.model(torch.cat([ids[:3], ids[4:]])[None]).last_hidden_state[0, -1]
    assert torch.allclose(hidden, full[:3], atol=1e-5) and torch.allclose(tree_hidden[0], full[3], atol=1e-5)
    assert torch.allclose(tree_hidden[1], sibling, atol=1e-5)
    capped = copy.deepcopy(tiny_target)
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="return_hidden.*final_logit_softcapping"):
        ModelRunner(capped).forward(ids, return_hidden=True)


class FeatureSpy(DraftModelProposer):
    """A draft model that also asks for the target's features and checks, at every proposal, that
    it has received exactly those of positions 0 .. T - 2, equal to a full forward's."""

    needs_target_features = True

    def __init__(self, draft, target) -> None:
        super().__init__(draft)
        self.target = target
        self.checked = 0

    def reset(self) -> None:
        super().reset()
        self.received: list[torch.Tensor] = []

    def observe_features(self, hidden: torch.Tensor) -> None:
        self.received.append(hidden.clone())

    def _check(self, context: torch.Tensor) -> None:
        with torch.no_grad():
            want = self.target.model(context[None, :-1]).last_hidden_state[0]  # (T - 1, H)
        got = torch.cat(self.received)
        assert got.shape == want.shape, (got.shape, want.shape)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
        self.checked += 1

    def propose(self, context, num_tokens, sampling, generator):
        self._check(context)
        return super().propose(context, num_tokens, sampling, generator)

    def propose_tree(self, context, tree, sampling, generator):
        self._check(context)
        return super().propose_tree(context, tree, sampling, generator)


@pytest.mark.parametrize("tree", [None, "tree8", "dynamic:10:4:3"])
def test_features_reach_the_proposer_at_the_right_positions(tiny_pair, tree) -> None:
    target = tiny_pair["target"]
    spy = FeatureSpy(tiny_pair["perturbed"], target)
    spec = SpeculativeGenerator(target, proposer=spy)
    for prompt in PROMPTS:
        result = spec.generate(prompt, SamplingParams(max_new_tokens=30), num_speculative_tokens=4, tree=tree)
        assert result.token_ids == target_only_greedy(target, prompt, 30)
        s = result.stats
        assert 0 < s.accepted_tokens < s.draft_tokens  # acceptances and rejections (rollback) both happened
    assert spy.checked > 20


# ------------------------------------------------------------------ drafts equal a cache-less reference
def eagle_reference(drafter: EagleHead, target, context: torch.Tensor, path: list[int]) -> torch.Tensor:
    """The EAGLE head's scores ``[N]`` after ``context`` + ``path``, recomputed from scratch: true
    features from a full target forward, the pairs (f_p, x_{p+1}) at positions p + 1, then the path's
    tokens with the head's own predicted features, one cache-less causal pass each."""
    T = context.shape[0]
    with torch.no_grad():
        feats = target.model(context[None]).last_hidden_state[0, : T - 1]  # (T - 1, H)
        tokens, positions = context[1:], torch.arange(1, T)
        out = drafter(feats[None], tokens[None], positions[None])[0, -1]  # f^_{T-1}
        for i, token in enumerate(path):
            feats = torch.cat([feats, out[None]])
            tokens = torch.cat([tokens, torch.tensor([token])])
            positions = torch.cat([positions, torch.tensor([T + i])])
            out = drafter(feats[None], tokens[None], positions[None])[0, -1]
        return drafter.logits(out)


def medusa_reference(drafter: MedusaHeads, target, context: torch.Tensor) -> torch.Tensor:
    """Every Medusa head's scores ``[K, N]`` from f_{T-2} of a full target forward."""
    with torch.no_grad():
        feature = target.model(context[None, :-1]).last_hidden_state[0, -1]  # (H,)
        return drafter.logits(drafter(feature))


class Recorder(ProposerBase):
    """Wraps a proposer; keeps (context, draft) of every proposal."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.needs_target_features = True
        self.supports_tree = inner.supports_tree
        self.calls: list[tuple[torch.Tensor, object]] = []

    def reset(self) -> None:
        self.inner.reset()

    def observe_features(self, hidden) -> None:
        self.inner.observe_features(hidden)

    def observe(self, result) -> None:
        self.inner.observe(result)

    def propose(self, context, num_tokens, sampling, generator):
        draft = self.inner.propose(context, num_tokens, sampling, generator)
        self.calls.append((context.clone(), draft))
        return draft

    def propose_tree(self, context, tree, sampling, generator):
        draft = self.inner.propose_tree(context, tree, sampling, generator)
        self.calls.append((context.clone(), draft))
        return draft


def tree_paths(parents: torch.Tensor, ids: torch.Tensor) -> dict[int, list[int]]:
    paths = {0: []}
    for node, parent in enumerate(parents.tolist(), start=1):
        paths[node] = paths[parent] + [int(ids[node - 1])]
    return paths


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
@pytest.mark.parametrize("tree", [None, "dynamic:8:4:3", [[0], [1], [0, 0], [1, 0], [1, 1], [0, 0, 0]]])
def test_drafts_equal_a_cacheless_reference(cases, kind: str, tree) -> None:
    """During real decoding (acceptances and rejections), every chain draft is the reference's
    argmax path and every tree node's children are the reference's best candidates, in order."""
    target, drafter, _ = cases[kind, "partly"]
    recorder = Recorder(proposer(drafter))
    spec = SpeculativeGenerator(target, proposer=recorder)
    for prompt in PROMPTS[:2]:
        spec.generate(prompt, SamplingParams(max_new_tokens=24), num_speculative_tokens=3, tree=tree)
    head_ids = drafter.head_ids
    for context, draft in recorder.calls:
        if kind == "medusa":
            scores = medusa_reference(drafter, target, context)  # (K, N)
        if tree is None:
            ids = draft.ids.tolist()
            for i, token in enumerate(ids):
                row = scores[i] if kind == "medusa" else eagle_reference(drafter, target, context, ids[:i])
                assert token == int(head_ids[row.argmax()])
            continue
        paths = tree_paths(draft.parents, draft.ids)
        for node, children in enumerate(children_lists(draft.parents)):
            if not children:
                continue
            row = (
                scores[len(paths[node])] if kind == "medusa" else eagle_reference(drafter, target, context, paths[node])
            )
            best = head_ids[row.topk(len(children)).indices].tolist()
            assert [int(draft.ids[c - 1]) for c in children] == best
    assert len(recorder.calls) > 10


# ------------------------------------------------------------------ lossless: greedy
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
@pytest.mark.parametrize("agreement", ["fully", "never", "partly", "random"])
@pytest.mark.parametrize("mode", [1, 5, "tree8", "dynamic:10:4:3"])
def test_greedy_equals_target_only(cases, kind: str, agreement: str, mode) -> None:
    target, drafter, answers = cases[kind, agreement]
    spec = SpeculativeGenerator(target, proposer=proposer(drafter))
    tree = mode if isinstance(mode, str) else None
    k = mode if isinstance(mode, int) else 4
    stats = []
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        result = spec.generate(prompt, SamplingParams(max_new_tokens=NEW), num_speculative_tokens=k, tree=tree)
        assert result.token_ids == answer
        stats.append(result.stats)
    drafted = sum(s.draft_tokens for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    mean = sum(s.mean_acceptance_length for s in stats) / len(stats)
    if kind == "medusa" and k == 5:
        assert all(s.drafted_per_position[K:] == [0] for s in stats)  # K heads: at most K tokens
    if agreement == "never":
        assert accepted == 0 and drafted > 0
    elif agreement == "fully" and tree is None:
        assert accepted / drafted > 0.9
    elif agreement == "fully" and tree == "tree8":
        assert mean == pytest.approx(parse_tree(tree).depth + 1, rel=0.1)  # whole root paths accepted
    elif agreement == "fully":
        assert mean > 2.5  # EAGLE-2 keeps the likeliest nodes, not always the whole top-1 path
    elif agreement == "partly" and tree is None:
        assert 0.02 < accepted / drafted < 0.9, accepted / drafted
    elif agreement == "partly":
        assert 1.1 < mean < parse_tree(tree).depth + 1, mean


# ------------------------------------------------------------------ lossless: sampled distribution
V_SMALL = 12
SAMPLING = SamplingParams(temperature=0.8, top_k=9, top_p=0.95, max_new_tokens=3)


@pytest.fixture(scope="module")
def small_target():
    return make_tiny_model(vocab_size=V_SMALL, seed=5, init=0.3)


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
@pytest.mark.parametrize(("tree", "int8_head"), [(None, False), ("dynamic:6:3:2", False), (None, True)])
def test_sampled_tokens_follow_the_target(small_target, kind: str, tree, int8_head: bool) -> None:
    """Temperature 0.8, top-k 9, top-p 0.95, a token map without tokens 8 and 10 (q is zero there):
    the first three tokens follow the exact target-only marginals (chi-square p > P_MIN, 1,200 seeded
    samples); the second and third are accepted, recovered or bonus tokens depending on the step.
    Also with the LM-head rows in int8 (q is then the int8 head's distribution)."""
    head_ids = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 9, 11])
    drafter = distill(make_drafter(kind, small_target, head_ids, seed=2), small_target, steps=10)
    if int8_head:
        drafter.quantize_head()
    prompt = [3, 1, 4]
    exact = exact_marginals(small_target, prompt, 3, SAMPLING)
    spec = SpeculativeGenerator(small_target, proposer=proposer(drafter))
    samples = [
        spec.generate(prompt, SamplingParams(**{**SAMPLING.__dict__, "seed": s}), num_speculative_tokens=2, tree=tree)
        for s in range(1_200)
    ]
    rate = sum(r.stats.accepted_tokens for r in samples) / sum(r.stats.drafts for r in samples)
    assert 0.02 < rate < 0.9, f"the drafts should be accepted only partly, {rate:.2f} accepted per step"
    for pos in range(3):
        tokens = [r.token_ids[pos] for r in samples]
        assert chi_square_p(tokens, exact[pos]) > P_MIN, f"position {pos} differs from the target's"


# ------------------------------------------------------------------ prompt lookup first, the drafter otherwise
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
@pytest.mark.parametrize("agreement", ["fully", "never", "partly"])
@pytest.mark.parametrize("mode", [3, "dynamic:10:4:3"])
def test_greedy_with_prompt_lookup_first(cases, kind: str, agreement: str, mode) -> None:
    """``prompt_lookup_min=2``: steps drafted by lookup and by the drafter mix (both counted), the output
    is the target's, and every draft the drafter makes after lookup steps equals the cache-less
    reference's argmax path (its features stayed in sync while it was not asked)."""
    target, drafter, answers = cases[kind, agreement]
    recorder = Recorder(proposer(drafter))
    config = (EagleConfig if kind == "eagle" else MedusaConfig)(prompt_lookup_min=2)
    hybrid = with_prompt_lookup(recorder, config)
    spec = SpeculativeGenerator(target, proposer=hybrid)
    tree = mode if isinstance(mode, str) else None
    lookup = model = 0
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        result = spec.generate(prompt, SamplingParams(max_new_tokens=NEW), num_speculative_tokens=3, tree=tree)
        assert result.token_ids == answer
        assert result.stats.proposer == f"{kind}+lookup"
        lookup, model = lookup + hybrid.lookup_steps, model + hybrid.model_steps
    assert lookup > 0 and model > 0, (lookup, model)
    if tree is not None:
        return
    head_ids = drafter.head_ids
    for context, draft in recorder.calls:
        ids = draft.ids.tolist()
        for i, token in enumerate(ids):
            if kind == "medusa":
                row = medusa_reference(drafter, target, context)[i]
            else:
                row = eagle_reference(drafter, target, context, ids[:i])
            assert token == int(head_ids[row.argmax()])


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_sampled_tokens_follow_the_target_with_prompt_lookup_first(small_target, kind: str) -> None:
    """As the test below, with ``prompt_lookup_min=1``: steps drafted by lookup (one-hot q) and by the
    drafter (its own q, zero outside its map) mix within requests; chi-square p > P_MIN at each of the
    first three positions (1,200 seeded samples)."""
    head_ids = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 9, 11])
    drafter = distill(make_drafter(kind, small_target, head_ids, seed=2), small_target, steps=10)
    prompt = [3, 1, 4, 1, 5]
    exact = exact_marginals(small_target, prompt, 3, SAMPLING)
    config = (EagleConfig if kind == "eagle" else MedusaConfig)(prompt_lookup_min=1)
    hybrid = with_prompt_lookup(proposer(drafter), config)
    spec = SpeculativeGenerator(small_target, proposer=hybrid)
    samples, lookup, model = [], 0, 0
    for s in range(1_200):
        samples.append(
            spec.generate(prompt, SamplingParams(**{**SAMPLING.__dict__, "seed": s}), num_speculative_tokens=2)
        )
        lookup, model = lookup + hybrid.lookup_steps, model + hybrid.model_steps
    assert lookup > 200 and model > 200, (lookup, model)
    for pos in range(3):
        tokens = [r.token_ids[pos] for r in samples]
        assert chi_square_p(tokens, exact[pos]) > P_MIN, f"position {pos} differs from the target's"


# ------------------------------------------------------------------ save / load, registry, errors
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_save_load_round_trip_and_registry(cases, tmp_path, kind: str) -> None:
    target, drafter, answers = cases[kind, "partly"]
    folder = save_drafter(drafter, tmp_path / kind)
    loaded = load_drafter(folder, target, kind)
    assert type(loaded) is type(drafter) and loaded.config == drafter.config
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    built = make_proposer(kind, target=target, drafter=str(folder), draft_confidence=0.0, head_quantization="none")
    assert isinstance(built, MedusaProposer if kind == "medusa" else EagleProposer)
    assert built.quantization == "none" and make_proposer(kind, target=target, drafter=str(folder)).quantization == (
        "int8-head"  # head_quantization="auto" on the CPU
    )
    original = SpeculativeGenerator(target, proposer=proposer(drafter)).generate(
        PROMPTS[0], SamplingParams(max_new_tokens=NEW), num_speculative_tokens=3
    )
    again = SpeculativeGenerator(target, proposer=built).generate(
        PROMPTS[0], SamplingParams(max_new_tokens=NEW), num_speculative_tokens=3
    )
    assert again.token_ids == original.token_ids == answers[0]
    assert again.stats.accepted_per_position == original.stats.accepted_per_position
    with pytest.raises(ValueError, match="holds a 'medusa' drafter|holds a 'eagle' drafter"):
        load_drafter(folder, target, "eagle" if kind == "medusa" else "medusa")
    with pytest.raises(IncompatibleModelsError, match="weights_hash"):
        load_drafter(folder, make_tiny_model(seed=1), kind)  # same config, other weights
    with pytest.raises(IncompatibleModelsError):
        make_proposer(kind, target=make_tiny_model(vocab_size=64), drafter=str(folder))
    for options in ({}, {"prompt_lookup_min": 2}):  # the registry knows the default k without building
        made = make_proposer(kind, target=target, drafter=str(folder), **options)
        assert PROPOSERS[kind].default_k(**options) == default_num_speculative_tokens(made) == (8 if options else 2)


def test_from_pretrained_with_a_drafter(tiny_target, tiny_tokenizer, tmp_path) -> None:
    from specdecode.models.torch.hf_loading import load_model

    tiny_target.save_pretrained(tmp_path / "target")
    tiny_tokenizer.save_pretrained(tmp_path / "target")
    loaded = load_model(tmp_path / "target", "target", "float32")  # the identity of the saved target
    save_drafter(distill(make_drafter("eagle", loaded), loaded, steps=10), tmp_path / "eagle")
    spec = SpeculativeGenerator.from_pretrained(
        tmp_path / "target", dtype="float32", proposer="eagle", drafter=str(tmp_path / "eagle")
    )
    result = spec.generate(PROMPTS[1], SamplingParams(max_new_tokens=20), tree="dynamic:6:3:2")
    assert result.token_ids == target_only_greedy(tiny_target, PROMPTS[1], 20)
    assert result.stats.proposer == "eagle"


def test_missing_drafter_says_how_to_train_one(tiny_target, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    default = default_drafter_dir("eagle", tiny_target)
    assert default.parent == tmp_path / "drafters" and default.name.startswith("eagle-target-")
    assert default_drafter_dir("medusa", "/models/Qwen2.5 Coder/") == tmp_path / "drafters" / "medusa-Qwen2.5-Coder"
    with pytest.raises(FileNotFoundError, match=r"train-drafter --kind eagle.*--drafter DIR"):
        make_proposer("eagle", target=tiny_target)
    with pytest.raises(FileNotFoundError, match=r"--drafter .*nowhere.*train-drafter --kind medusa"):
        PROPOSERS["medusa"].make_config(drafter=str(tmp_path / "nowhere"))  # fails before any model loads
    with pytest.raises(ValueError, match="draft_confidence"):
        PROPOSERS["eagle"].make_config(draft_confidence=1.5)
    with pytest.raises(ValueError, match="needs the target"):
        PROPOSERS["medusa"].build(PROPOSERS["medusa"].make_config(), None, None)
    with pytest.raises(ValueError, match="kind must be one of"):
        default_drafter_dir("hydra", tiny_target)


def test_find_drafter_prefers_the_users_then_the_shipped_one(tiny_target, tmp_path, monkeypatch) -> None:
    import specdecode.drafters as drafters

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(drafters, "shipped_drafters_root", lambda: tmp_path / "shipped")
    own, shipped = default_drafter_dir("eagle", tiny_target), drafters.shipped_drafter_dir("eagle", tiny_target)
    assert shipped.parent == tmp_path / "shipped" and shipped.name == own.name
    assert drafters.find_drafter_dir("eagle", tiny_target) == own  # neither: the user's folder (says how to train)
    config = DrafterConfig.for_target("eagle", tiny_target, 16, intermediate_size=64)
    save_drafter(build_drafter(config, torch.arange(16)), shipped)
    assert drafters.find_drafter_dir("eagle", tiny_target) == shipped
    assert drafters.find_drafter_dir("medusa", tiny_target) == default_drafter_dir("medusa", tiny_target)
    assert make_proposer("eagle", target=tiny_target).drafter.config.draft_vocab_size == 16  # the shipped one loads
    save_drafter(
        build_drafter(DrafterConfig.for_target("eagle", tiny_target, 8, intermediate_size=64), torch.arange(8)), own
    )
    assert drafters.find_drafter_dir("eagle", tiny_target) == own  # the user's own wins
    with pytest.raises(ValueError, match="kind must be one of"):
        drafters.shipped_drafter_dir("hydra", tiny_target)


def test_a_shipped_drafter_is_found_by_the_targets_identity_under_another_name(tiny_target, tmp_path, monkeypatch):
    """The same weights loaded from another folder (another name) still find the shipped drafter
    made for them; another model of the same config does not."""
    import specdecode.drafters as drafters

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(drafters, "shipped_drafters_root", lambda: tmp_path / "shipped")
    config = DrafterConfig.for_target("eagle", tiny_target, 16, intermediate_size=64)
    folder = tmp_path / "shipped" / "eagle-the-name-it-was-trained-under"
    save_drafter(build_drafter(config, torch.arange(16)), folder)
    assert drafters.target_name(tiny_target) not in folder.name
    broken = tmp_path / "shipped" / "eagle-a-broken-one"  # sorted first: skipped, not an error
    broken.mkdir()
    (broken / "drafter.json").write_text("{not json")
    (broken / "model.safetensors").write_bytes(b"")
    assert drafters.find_drafter_dir("eagle", tiny_target) == folder
    assert drafters.find_drafter_dir("medusa", tiny_target) == default_drafter_dir("medusa", tiny_target)
    other = make_tiny_model(seed=5)  # same config, other weights
    assert drafters.find_drafter_dir("eagle", other) == default_drafter_dir("eagle", other)
    assert drafters.find_drafter_dir("eagle", str(tmp_path / "some-folder")) == default_drafter_dir(
        "eagle", str(tmp_path / "some-folder")
    )  # a path, not a loaded model: found by name only


def test_cli_flags_and_proposer_errors(cases) -> None:
    from specdecode.commands.common import proposer_options
    from specdecode.commands.main import build_parser

    args = build_parser().parse_args(
        ["generate", "hi", "--proposer", "eagle", "--drafter", "d", "--draft-confidence", "0.3"]
    )
    assert proposer_options(args) == {"drafter": "d", "draft_confidence": 0.3}
    target, drafter, _ = cases["eagle", "partly"]
    fresh = proposer(drafter)
    with pytest.raises(RuntimeError, match="needs_target_features"):
        fresh.propose(torch.tensor(PROMPTS[0]), 3, SamplingParams(), None)  # no features given
    with pytest.raises(ValueError, match="EagleHead"):
        EagleProposer(cases["medusa", "partly"][1])


def test_proposer_weight_bytes_counts_what_the_proposer_adds_to_the_target(tiny_target) -> None:
    from specdecode.proposers import proposer_weight_bytes

    def nbytes(module: torch.nn.Module) -> int:
        return sum(t.untyped_storage().nbytes() for t in [*module.parameters(), *module.buffers()])

    draft = make_tiny_model(seed=3)
    assert proposer_weight_bytes(make_proposer("draft_model", draft=draft), tiny_target) == nbytes(draft)
    assert proposer_weight_bytes(make_proposer("prompt_lookup"), tiny_target) == 0
    assert proposer_weight_bytes(make_proposer("early_exit", target=tiny_target), tiny_target) == 0  # its layers
    head_ids = torch.arange(0, tiny_target.config.vocab_size, 2)
    for kind in ("eagle", "medusa"):
        drafter = make_drafter(kind, tiny_target, head_ids)
        proposer = EagleProposer(drafter) if kind == "eagle" else MedusaProposer(drafter)
        copied = drafter._target.head_weight  # the LM-head rows of the map: the drafter's own copy
        assert copied.shape[0] == head_ids.shape[0]
        # the drafter's layers and its copy of the head rows; the target's embeddings it borrows are not counted
        assert proposer_weight_bytes(proposer, tiny_target) == nbytes(drafter) + copied.untyped_storage().nbytes()
        assert proposer_weight_bytes(proposer, None) > proposer_weight_bytes(proposer, tiny_target)


def test_proposer_weight_bytes_counts_prepacked_onednn_copies() -> None:
    """A float32 layer routed through oneDNN gets a prepacked copy of its weight on its first
    multi-row call (specdecode.models.torch.cpu): memory the proposer holds from then on."""
    from specdecode.models.torch.cpu import packed_layers, use_onednn_linears
    from specdecode.proposers import proposer_weight_bytes

    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024))
    if use_onednn_linears(model) == 0:
        pytest.skip("this torch build has no oneDNN")
    plain = 4 * (1024 * 1024 + 1024)
    assert proposer_weight_bytes(model) == plain
    with torch.inference_mode():
        model(torch.randn(2, 1024))  # two rows: the packed copy is made (if memory allows)
    packed = packed_layers(model)
    assert proposer_weight_bytes(model) >= plain + packed * 4 * 1024 * 1024
    assert proposer_weight_bytes(model) < plain + packed * 5 * 1024 * 1024  # its own layout's padding at most


def test_proposer_weight_bytes_counts_an_int8_drafts_packed_weights(tiny_target) -> None:
    """torch.ao keeps a dynamic int8 linear's weight packed, outside parameters and buffers: it is
    counted as int8 bytes (out x in) plus its float32 bias, next to the layers left in float."""
    from specdecode.proposers import proposer_weight_bytes

    draft = make_tiny_model(seed=3)
    proposer = make_proposer("draft_model", draft=draft, draft_quantization="int8")
    quantized = proposer.runner.model
    floats = {name: module for name, module in draft.named_modules()}
    suffix = "._packed_params"  # torch.ao's holder of one layer's packed int8 weight and bias
    packed = [name.removesuffix(suffix) for name, _ in quantized.named_modules() if name.endswith(suffix)]
    assert packed  # the copy does hold int8 layers
    expected = sum(t.untyped_storage().nbytes() for t in [*quantized.parameters(), *quantized.buffers()])
    for name in packed:
        layer = floats[name]
        expected += layer.weight.numel() + (4 * layer.bias.numel() if layer.bias is not None else 0)
    assert proposer_weight_bytes(proposer, tiny_target) == expected


# ------------------------------------------------------------------ the proposer's own default k
def test_eagle_drafts_its_default_k_when_none_is_given(cases) -> None:
    """No ``num_speculative_tokens``: EAGLE drafts 2 per step (its measured best), lookup first 8 (the
    lookup's; the head still drafts at most 2), an explicit k wins; the output is the target's every time."""
    target, drafter, answers = cases["eagle", "fully"]
    eagle = proposer(drafter)
    hybrid = with_prompt_lookup(proposer(drafter), EagleConfig(prompt_lookup_min=2))
    assert default_num_speculative_tokens(eagle) == EagleProposer.default_num_speculative_tokens == 2
    assert MedusaProposer.default_num_speculative_tokens == 2
    assert default_num_speculative_tokens(hybrid) == 8 and default_num_speculative_tokens(None) == 4
    assert DEFAULT_NUM_SPECULATIVE_TOKENS == 4
    for chosen, k, most in ((eagle, None, 2), (eagle, 5, 5), (hybrid, None, 8)):
        spec = SpeculativeGenerator(target, proposer=chosen)
        for prompt, answer in zip(PROMPTS, answers, strict=True):
            result = spec.generate(prompt, SamplingParams(max_new_tokens=NEW), num_speculative_tokens=k)
            assert result.token_ids == answer
            assert result.stats.num_speculative_tokens == most
            assert len(result.stats.drafted_per_position) <= most
        assert len(result.stats.drafted_per_position) == most  # full agreement: every step drafts k


def test_a_bad_default_k_is_a_clear_error() -> None:
    class Odd:
        name = "odd"
        default_num_speculative_tokens = 0

    with pytest.raises(ValueError, match="'odd': default_num_speculative_tokens must be an integer in \\[1, 64\\]"):
        default_num_speculative_tokens(Odd())


# ------------------------------------------------------------------ the LM-head rows in int8
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
@pytest.mark.parametrize("agreement", ["fully", "never", "partly"])
@pytest.mark.parametrize("mode", [3, "dynamic:10:4:3"])
def test_greedy_with_an_int8_head_equals_target_only(cases, kind: str, agreement: str, mode) -> None:
    """``quantize_head()``: the drafts are scored by int8 rows, the output is still the target's (float32),
    and the drafts are (nearly) the float head's: the oracle still agrees, the never-map never does."""
    target, drafter, answers = cases[kind, agreement]
    quantized = copy.deepcopy(drafter).quantize_head()
    assert quantized.head_quantized and quantized._target.head_weight is None
    spec = SpeculativeGenerator(target, proposer=proposer(quantized))
    assert spec.proposer.quantization == "int8-head"
    tree = mode if isinstance(mode, str) else None
    k = mode if isinstance(mode, int) else None
    stats = []
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        result = spec.generate(prompt, SamplingParams(max_new_tokens=NEW), num_speculative_tokens=k, tree=tree)
        assert result.token_ids == answer
        assert result.stats.draft_quantization == "int8-head"
        stats.append(result.stats)
    drafted = sum(s.draft_tokens for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    if agreement == "never":
        assert accepted == 0 and drafted > 0
    elif agreement == "fully" and tree is None:
        assert accepted / drafted > 0.9
    elif agreement == "partly" and tree is None:
        assert 0.02 < accepted / drafted < 0.9, accepted / drafted


def test_int8_head_rows_score_like_the_float_rows_in_less_memory(tiny_target) -> None:
    """The int8 rows' logits are within int8 rounding of the float rows' (per-row scales), the float
    copy is freed (proposer weights: drafter + 1 byte per row entry + scales), attach() restores it,
    and the proposers' head_quantization option resolves and checks as documented."""
    from specdecode.proposers import proposer_weight_bytes
    from specdecode.proposers.trained_drafters import resolve_head_quantization

    head_ids = torch.arange(0, tiny_target.config.vocab_size, 2)
    drafter = make_drafter("eagle", tiny_target, head_ids)
    hidden = torch.randn(5, tiny_target.config.hidden_size)
    before = drafter.logits(hidden)
    full = proposer_weight_bytes(EagleProposer(drafter), tiny_target)
    rows = drafter._target.head_weight.untyped_storage().nbytes()
    drafter.quantize_head()
    after = drafter.logits(hidden)
    assert after.dtype == torch.float32 and after.shape == before.shape
    assert (after - before).abs().max() < 0.02 * before.abs().max()
    assert (after.argmax(-1) == before.argmax(-1)).float().mean() >= 0.8
    smaller = proposer_weight_bytes(EagleProposer(drafter), tiny_target)
    assert full - rows < smaller < full - rows + rows // 4 + 16 * head_ids.numel()  # int8 rows + per-row scales
    assert drafter.quantize_head() is drafter  # idempotent
    drafter.attach(tiny_target)
    assert not drafter.head_quantized and torch.equal(drafter.logits(hidden), before)
    assert resolve_head_quantization("auto", tiny_target) == "int8"
    assert resolve_head_quantization("none", tiny_target) == "none"
    assert EagleConfig(head_quantization=None).head_quantization == "none"  # as bench options spell it
    with pytest.raises(ValueError, match="head_quantization must be one of"):
        EagleConfig(head_quantization="int4")
    with pytest.raises(RuntimeError, match="not attached"):
        build_drafter(drafter.config, head_ids).quantize_head()


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_behind_lookup_the_drafter_drafts_its_own_k(cases, kind: str) -> None:
    """k = 6 bounds lookup's drafts; the drafter, asked when lookup finds nothing, drafts at most its
    own k (``prompt_lookup_model_k``, default its default k, 2); the output is the target's."""
    target, drafter, answers = cases[kind, "fully"]
    config_cls = EagleConfig if kind == "eagle" else MedusaConfig
    assert with_prompt_lookup(proposer(drafter), config_cls(prompt_lookup_min=2)).model_k == 2
    assert with_prompt_lookup(proposer(drafter), config_cls(prompt_lookup_min=2, prompt_lookup_model_k=5)).model_k == 5
    with pytest.raises(ValueError, match="prompt_lookup_model_k must be None or an integer in \\[1, 64\\]"):
        config_cls(prompt_lookup_min=2, prompt_lookup_model_k=0)
    recorder = Recorder(proposer(drafter))
    hybrid = with_prompt_lookup(recorder, config_cls(prompt_lookup_min=2, prompt_lookup_model_k=2))
    spec = SpeculativeGenerator(target, proposer=hybrid)
    longest = 0
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        result = spec.generate(prompt, SamplingParams(max_new_tokens=NEW), num_speculative_tokens=6)
        assert result.token_ids == answer
        longest = max(longest, len(result.stats.drafted_per_position))
    assert recorder.calls and max(len(draft) for _, draft in recorder.calls) == 2  # the drafter: its own k
    assert longest > 2  # lookup drafted longer runs in the same requests


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
@pytest.mark.parametrize("agreement", ["fully", "partly"])
def test_head_forwards_are_recorded_for_the_cost_table(cases, kind: str, agreement: str) -> None:
    """``draft_pass_widths`` holds one width per head forward, which ``specdecode bench --cost-table``
    prices on the table's curve of ``draft_pass_kind``: EAGLE feeds the pairs new since its last
    step (the prompt's first), then one per further draft; Medusa evaluates its heads once per step."""
    target, drafter, answers = cases[kind, agreement]
    spec = SpeculativeGenerator(target, proposer=proposer(drafter))
    for prompt, answer in zip(PROMPTS[:2], answers, strict=False):
        stats = spec.generate(prompt, SamplingParams(max_new_tokens=NEW), num_speculative_tokens=3).stats
        assert stats.draft_pass_kind == kind
        drafted = [w - 1 for w in stats.target_pass_widths[1:]]  # per verification step
        expected: list[int] = []
        length, fed = len(prompt) + 1, 1  # the context after the prefill; the head has cached none yet
        for d, accepted in zip(drafted, stats.accepted_per_step, strict=True):
            if d == 0:  # a plain step (the last token of the budget): the proposer was not asked
                pass
            elif kind == "medusa":
                expected.append(1)
            else:
                expected += [length - fed] + [1] * (d - 1)  # the new pairs, then each further draft
                fed = length
            length += accepted + 1
        assert stats.draft_pass_widths == expected
        assert sum(d > 0 for d in drafted) >= len(drafted) - 1  # plain steps only at the budget's end
