"""Structured output under speculation (issue 33): exact against constrained decoding by the target
alone, greedy token for token and sampled in distribution; grammar-aware drafting (forbidden drafts
cut, forced tokens drafted); every output valid; bad constraints refused naming the parameter.

The references here use llguidance directly (a fresh ``LLMatcher`` per step over the whole output),
not :mod:`specdecode.constraints`, and full forwards without a cache."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.constraints import ConstraintError, Grammar, JsonSchema, Regex
from specdecode.constraints.masked_verify import DraftCut, verify_constrained
from specdecode.constraints.spec import compile_constraint
from specdecode.constraints.tokenizer import ll_tokenizer
from specdecode.proposers.base import DraftTokens, ProposerBase
from specdecode.sampling import logits_to_probs

from conftest import make_tiny_model, make_tiny_tokenizer, perturbed_copy
from stat_checks import P_MIN, chi_square_p

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["add", "prime"]},
    },
    "required": ["name", "count", "kind"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "regex": Regex(r"(def|class) [a-z]{1,8}\(\):"),
    "json": JsonSchema(SCHEMA),
    "lark": Grammar('start: "for " NAME " in range(" NUM "):"\nNAME: /[a-z]{1,4}/\nNUM: /[1-9][0-9]?/'),
}


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer(vocab_size=300)


@pytest.fixture(scope="module")
def models(tok):
    target = make_tiny_model(vocab_size=len(tok), seed=0)
    return {
        "target": target,
        "identical": make_tiny_model(vocab_size=len(tok), seed=0),
        "unrelated": make_tiny_model(vocab_size=len(tok), seed=123),
        "perturbed": perturbed_copy(target, noise=0.01),
    }


class FixedProposer(ProposerBase):
    """Drafts ``tokens[T - P : T - P + k]`` of a known continuation (an oracle when it is the right
    one), or always the same ``token`` k times."""

    name = "fixed"

    def __init__(self, prompt_len: int, tokens: list[int] | None = None, token: int | None = None) -> None:
        self.prompt_len, self.tokens, self.token = prompt_len, tokens, token

    def propose(self, context, num_tokens, sampling, generator) -> DraftTokens:
        if self.token is not None:
            return DraftTokens(torch.full((num_tokens,), self.token, dtype=torch.int64))
        done = context.shape[0] - self.prompt_len
        return DraftTokens(torch.tensor(self.tokens[done : done + num_tokens], dtype=torch.int64))


def reference_greedy(target, tok, constraint, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    """Constrained greedy decoding by the target alone: full forward, logits masked by a fresh
    llguidance matcher over the output so far, argmax; stops at EOS."""
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=sorted(eos))
    grammar = compile_constraint(constraint, lltok)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
            assert matcher.consume_tokens(out)
            allowed = llguidance.LLMatcher.compute_logit_bias(matcher)
            mask = torch.frombuffer(bytearray(allowed), dtype=torch.uint8)[: len(tok)] > 0
            logits = target(torch.tensor([prompt + out])).logits[0, -1]
            token = int(logits.masked_fill(~mask, float("-inf")).argmax())
            out.append(token)
            if token in eos:
                break
    return out


def _prompt(tok) -> list[int]:
    return tok.encode("def is_prime(n):\n")


# ------------------------------------------------------------------------------- greedy exactness
@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
@pytest.mark.parametrize("draft", ["identical", "unrelated", "perturbed"])
def test_greedy_equals_constrained_target_only(models, tok, name: str, draft: str) -> None:
    """Drafts that agree (identical draft: its raw argmax, often forbidden, is cut), that never
    agree (unrelated) and partly agree: the output is token for token constrained target-only
    greedy decoding, and it matches the constraint."""
    constraint = CONSTRAINTS[name]
    prompt = _prompt(tok)
    spec = SpeculativeGenerator(models["target"], models[draft], tokenizer=tok)
    expected = reference_greedy(models["target"], tok, constraint, prompt, 80, set(spec.eos_token_ids))
    for k in (1, 4):
        got = spec.generate(prompt, SamplingParams(max_new_tokens=80), num_speculative_tokens=k, constraint=constraint)
        assert got.token_ids == expected, f"{draft} k={k}"
    plain = spec.generate(prompt, SamplingParams(max_new_tokens=80), speculative=False, constraint=constraint)
    assert plain.token_ids == expected
    assert plain.finish_reason == "stop", "the tiny target completes the grammar within 80 tokens"
    _check_valid(name, plain.text)


def _check_valid(name: str, text: str) -> None:
    import re

    if name == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif name == "regex":
        assert re.fullmatch(r"(def|class) [a-z]{1,8}\(\):", text), text
    else:
        assert re.fullmatch(r"for [a-z]{1,4} in range\([1-9][0-9]?\):", text), text


def test_oracle_drafts_are_all_accepted_and_forbidden_drafts_are_never_sent(models, tok) -> None:
    """An oracle proposing the constrained answer has every draft accepted (the masks of each
    position follow the drafts before it); a proposer of a token the grammar always forbids is cut
    every step (nothing sent, cut_draft_tokens counted) and the output is unchanged."""
    constraint = CONSTRAINTS["json"]
    prompt = _prompt(tok)
    target = models["target"]
    expected = SpeculativeGenerator(target, tokenizer=tok).generate(
        prompt, SamplingParams(max_new_tokens=60), speculative=False, constraint=constraint
    )
    oracle = SpeculativeGenerator(target, tokenizer=tok, proposer=FixedProposer(len(prompt), expected.token_ids))
    got = oracle.generate(prompt, SamplingParams(max_new_tokens=60), num_speculative_tokens=4, constraint=constraint)
    assert got.token_ids == expected.token_ids
    assert got.stats.accepted_tokens == got.stats.draft_tokens > 0
    forbidden = tok.convert_tokens_to_ids("<|user|>")
    cutter = SpeculativeGenerator(target, tokenizer=tok, proposer=FixedProposer(len(prompt), token=forbidden))
    got = cutter.generate(prompt, SamplingParams(max_new_tokens=60), num_speculative_tokens=3, constraint=constraint)
    assert got.token_ids == expected.token_ids
    assert got.stats.cut_draft_tokens > 0
    assert got.stats.draft_tokens == got.stats.forced_draft_tokens, "only forced tokens reached the target"


def test_forced_tokens_are_drafted_and_save_passes(models, tok) -> None:
    """A proposer that never drafts still speculates under a schema with fixed keys: the forced
    tokens (keys, punctuation) are drafted, accepted, and the target runs fewer passes than
    constrained target-only decoding, with the same output. With grammar-aware drafting off, no
    forced token is drafted."""
    constraint = CONSTRAINTS["json"]
    prompt = _prompt(tok)
    target = models["target"]
    sampling = SamplingParams(max_new_tokens=60)
    plain = SpeculativeGenerator(target, tokenizer=tok).generate(
        prompt, sampling, speculative=False, constraint=constraint
    )
    spec = SpeculativeGenerator(target, tokenizer=tok, proposer=FixedProposer(len(prompt), []))
    got = spec.generate(prompt, sampling, num_speculative_tokens=8, constraint=constraint)
    assert got.token_ids == plain.token_ids
    assert got.stats.forced_accepted_tokens > 0
    assert got.stats.forced_accepted_tokens <= got.stats.forced_draft_tokens == got.stats.draft_tokens
    assert got.stats.target_forward_passes < plain.stats.target_forward_passes
    spec.grammar_aware_drafting = False
    off = spec.generate(prompt, sampling, num_speculative_tokens=8, constraint=constraint)
    assert off.token_ids == plain.token_ids
    assert off.stats.forced_draft_tokens == 0 and off.stats.target_forward_passes == plain.stats.target_forward_passes


@pytest.mark.parametrize("aware", [True, False])
def test_tree_branches_checked_against_the_grammar(models, tok, aware: bool) -> None:
    """Token trees from a draft model under a constraint: same output as constrained target-only
    greedy decoding, with the forbidden branches cut (grammar-aware) or masked (not)."""
    constraint = CONSTRAINTS["regex"]
    prompt = _prompt(tok)
    spec = SpeculativeGenerator(models["target"], models["perturbed"], tokenizer=tok)
    spec.grammar_aware_drafting = aware
    expected = reference_greedy(models["target"], tok, constraint, prompt, 30, set(spec.eos_token_ids))
    got = spec.generate(prompt, SamplingParams(max_new_tokens=30), tree="default", constraint=constraint)
    assert got.token_ids == expected
    assert (got.stats.cut_draft_tokens > 0) == aware


@pytest.mark.parametrize("draft", ["unrelated", "perturbed"])
def test_trees_get_forced_tokens(models, tok, draft: str) -> None:
    """Under a schema with fixed keys, a tree's leaves above its depth (branches cut by the grammar)
    get the grammar's forced tokens as chains: the same output as constrained target-only greedy
    decoding, forced nodes drafted and accepted, fewer target passes than with masks only (no cut,
    no forced tokens); sampled outputs still validate."""
    constraint = CONSTRAINTS["json"]
    prompt = _prompt(tok)
    spec = SpeculativeGenerator(models["target"], models[draft], tokenizer=tok)
    sampling = SamplingParams(max_new_tokens=60)
    expected = reference_greedy(models["target"], tok, constraint, prompt, 60, set(spec.eos_token_ids))
    got = spec.generate(prompt, sampling, tree="default", constraint=constraint)
    assert got.token_ids == expected
    assert 0 < got.stats.forced_accepted_tokens <= got.stats.forced_draft_tokens
    spec.grammar_aware_drafting = False
    off = spec.generate(prompt, sampling, tree="default", constraint=constraint)
    assert off.token_ids == expected and off.stats.forced_draft_tokens == 0
    assert got.stats.target_forward_passes < off.stats.target_forward_passes
    spec.grammar_aware_drafting = True
    for seed in range(3):
        sampled = spec.generate(
            prompt, SamplingParams(max_new_tokens=80, temperature=1.0, seed=seed), tree="default", constraint=constraint
        )
        if sampled.finish_reason == "stop":
            jsonschema.validate(json.loads(sampled.text), SCHEMA)


def test_outputs_parse_and_validate_under_sampling(models, tok) -> None:
    """Sampled outputs (temperature 1, several seeds, a sampling draft) all parse and validate."""
    spec = SpeculativeGenerator(models["target"], models["perturbed"], tokenizer=tok)
    for seed in range(8):
        sampling = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=80)
        for name, constraint in CONSTRAINTS.items():
            got = spec.generate(_prompt(tok), sampling, num_speculative_tokens=3, constraint=constraint)
            assert got.finish_reason == "stop", (name, got.text)
            _check_valid(name, got.text)


def test_stream_tokens_and_stream_take_the_constraint(models, tok) -> None:
    spec = SpeculativeGenerator(models["target"], models["perturbed"], tokenizer=tok)
    constraint = CONSTRAINTS["regex"]
    whole = spec.generate(_prompt(tok), SamplingParams(max_new_tokens=30), constraint=constraint)
    assert "".join(spec.stream(_prompt(tok), SamplingParams(max_new_tokens=30), constraint=constraint)) == whole.text
    ids = [
        i
        for new, _, _ in spec.stream_tokens(_prompt(tok), SamplingParams(max_new_tokens=30), constraint=constraint)
        for i in new
    ]
    assert ids == whole.token_ids


# ------------------------------------------------------------------------------ bad constraints
@pytest.mark.parametrize(
    "constraint, param",
    [
        (JsonSchema({"type": "objectx"}), "json_schema"),
        (JsonSchema("{not json"), "json_schema"),
        (JsonSchema([1, 2]), "json_schema"),  # type: ignore[arg-type]
        (Regex("a("), "regex"),
        (Regex(""), "regex"),
        (Grammar("start: foo"), "grammar"),
        (Grammar("root ::= undefined-rule"), "grammar"),
        (Grammar("start: 'a'", syntax="yaml"), "grammar"),
        (
            JsonSchema({"type": "integer"}, param="response_format.json_schema.schema"),
            "response_format.json_schema.schema",
        ),
    ],
)
def test_bad_constraints_name_the_parameter(models, tok, constraint, param: str) -> None:
    spec = SpeculativeGenerator(models["target"], tokenizer=tok)
    if param.endswith("schema") and isinstance(constraint.schema, dict) and constraint.schema.get("type") == "integer":
        spec.generate(_prompt(tok), SamplingParams(max_new_tokens=4), constraint=constraint)  # valid: no error
        return
    with pytest.raises(ConstraintError) as error:
        spec.generate(_prompt(tok), SamplingParams(max_new_tokens=4), constraint=constraint)
    assert error.value.param == param and str(error.value).startswith(param)
    assert isinstance(error.value, ValueError)


def test_slow_tokenizer_is_refused() -> None:
    with pytest.raises(ValueError, match="fast"):
        ll_tokenizer(object(), 10, [0])


# ---------------------------------------------------------------------------- sampled distribution
V_SMALL = 12
LETTERS = [bytes([ord("a") + i]) for i in range(V_SMALL - 1)]  # tokens 0..10 = a..k, 11 = EOS
SAMPLING = SamplingParams(temperature=0.8, top_k=9, top_p=0.95, max_new_tokens=3)
# prefix-dependent masks: first a-f; after "a" only b-e, after "b" only f-h, after c-f only a-c; then d-j
SMALL_REGEX = Regex(r"(a[b-e]|b[f-h]|[c-f][a-c])[d-j]")


class LetterTokenizer:
    """A 12-token vocabulary: single letters a..k and an EOS token (for llguidance and the text)."""

    eos_token_id = V_SMALL - 1
    bos_token_id = None
    tokens = [*LETTERS, b"<eos>"]
    special_token_ids = [V_SMALL - 1]

    def __call__(self, s: bytes) -> list[int]:
        return [b - ord("a") for b in s]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.tokens[i].decode() for i in ids if i != self.eos_token_id)


def letter_tokenizer() -> LetterTokenizer:
    """The letters, with their llguidance tokenizer as ``llguidance_tokenizer``."""
    tok = LetterTokenizer()
    tok.llguidance_tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(LetterTokenizer()), n_vocab=V_SMALL)
    return tok


@pytest.fixture(scope="module")
def small_pair():
    target = make_tiny_model(vocab_size=V_SMALL, seed=5, init=0.3)
    return target, perturbed_copy(target, noise=0.1, seed=6)


def constrained_marginals(target, prompt: list[int], lltok, grammar: str, positions: int) -> list[torch.Tensor]:
    """Exact marginals of constrained target-only sampling: every prefix enumerated, each position's
    logits masked by a fresh matcher over the prefix."""
    marginals, prefixes = [], [((), 1.0)]
    with torch.no_grad():
        for _ in range(positions):
            total = torch.zeros(V_SMALL, dtype=torch.float64)
            nxt = []
            for t, w in prefixes:
                matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
                assert matcher.consume_tokens(list(t))
                mask = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)[:V_SMALL] > 0
                logits = target(torch.tensor([prompt + list(t)])).logits[0, -1].double()
                p = logits_to_probs(logits.masked_fill(~mask, float("-inf")), SAMPLING).double()
                total += w * p
                nxt += [(t + (v,), w * float(p[v])) for v in range(V_SMALL) if p[v] > 0]
            marginals.append(total)
            prefixes = nxt
    return marginals


@pytest.mark.parametrize("k", [1, 2])
def test_sampled_tokens_follow_the_constrained_target(small_pair, k: int) -> None:
    """Temperature 0.8, top-k 9, top-p 0.95 under a regex whose masks depend on the prefix: the
    first three tokens with a sampling draft model (q not masked; drafts cut at a sampled forbidden
    token, the residual drawn at the cut) follow the exact marginals of constrained target-only
    sampling (chi-square p > P_MIN, 1,500 seeded samples each)."""
    target, draft = small_pair
    tok = letter_tokenizer()
    lltok = tok.llguidance_tokenizer
    grammar = compile_constraint(SMALL_REGEX, lltok)
    prompt = [3, 1, 4]
    exact = constrained_marginals(target, prompt, lltok, grammar, 3)
    spec = SpeculativeGenerator(target, draft, tokenizer=tok)
    samples = [
        spec.generate(
            prompt, SamplingParams(**{**SAMPLING.__dict__, "seed": s}), num_speculative_tokens=k, constraint=SMALL_REGEX
        )
        for s in range(1_500)
    ]
    cut = sum(r.stats.cut_draft_tokens for r in samples)
    assert cut > 100, f"the draft should often sample forbidden tokens, {cut} cut"
    accepted = sum(r.stats.accepted_tokens for r in samples)
    assert accepted > 100, "the draft should also be accepted often"
    for pos in range(3):
        tokens = [r.token_ids[pos] for r in samples]
        assert chi_square_p(tokens, exact[pos]) > P_MIN, f"position {pos} differs from the constrained target's"


@pytest.mark.parametrize("residual_at_cut", [True, False])
def test_cut_of_a_sampled_draft_needs_the_residual(residual_at_cut: bool) -> None:
    """The verifier alone, one position: p' = (0.5, 0.5, 0, 0) (tokens 2, 3 forbidden), the draft's
    q = (0.5, 0, 0.5, 0). Sampling x ~ q, cutting the draft when x is forbidden and verifying gives
    tokens distributed as p' only when the cut position draws from the residual ``norm(max(0, p' - q))``
    (``cut`` passed); drawing it from p' itself (a bonus) gives P(0) = 0.75, and the same chi-square
    check sees it. So the check can fail, and the cut rule is the exact one."""
    logits = torch.log(torch.tensor([[0.5, 0.5, 0.25, 0.25]]))  # (1, V): masked below to p'
    allowed = torch.tensor([[True, True, False, False]])
    q = torch.tensor([0.5, 0.0, 0.5, 0.0])
    sampling = SamplingParams(temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(4_000):
        x = int(torch.multinomial(q, 1, generator=generator))
        if allowed[0, x]:  # sent: verified against p' with its q row (the bonus row is p' too)
            ids, probs, rows, cut = torch.tensor([x]), q[None], torch.cat([logits, logits]), None
            mask = torch.cat([allowed, allowed])
        else:  # cut: nothing sent
            ids, probs, rows, mask = torch.empty(0, dtype=torch.int64), None, logits, allowed
            cut = DraftCut(x, q) if residual_at_cut else None
        out.append(int(verify_constrained(ids, probs, rows, mask, sampling, generator, cut).tokens[0]))
    p = chi_square_p(out, torch.tensor([0.5, 0.5, 0.0, 0.0]))
    assert (p > P_MIN) == residual_at_cut, f"chi-square p = {p:.3g}"
