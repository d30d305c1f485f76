"""The llamacpp backend on the real default GGUF pair (Qwen2.5-Coder 1.5B target, 0.5B draft).

What exactness rests on is tested here, on the files users run: rollback by truncation, passes of
up to ``invariant_tokens`` rows bit-identical to one-token passes, the split of longer verification
passes, greedy speculative output equal to plain decoding on this backend (drafts that agree
fully, never and partly; prompt lookup; the draft model), and the sampled distribution of the
first two tokens (chi-square per position, family-wise ``stat_checks.P_MIN``).

Skipped, with the reason, when llama-cpp-python or the model packages are not installed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.proposers.base import DraftTokens, ProposerBase
from specdecode.sampling import logits_to_probs
from specdecode.verify import VerifyResult

from conftest import load_default_gguf, plain_greedy
from stat_checks import P_MIN, check_all, first_two_tokens_p_values

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Complete the following Python function:\n```python\ndef running_sum(xs: list[int]) -> list[int]:\n"
    '    """Return the running sums of xs: running_sum([1, 2, 3]) == [1, 3, 6]."""\n```',
]
# past 512 cached tokens (where llama.cpp's attention kernels change their summation order)
LONG_PROMPT = (
    "Here is a module:\n```python\n"
    + "".join(f"def f{i}(x: int) -> int:\n    return x * {i} + {i % 7}\n\n" for i in range(40))
    + "```\nRewrite every function so that it also accepts floats, and keep the same order."
)


@pytest.fixture(scope="module")
def target():
    return load_default_gguf("target")  # the defaults: exact, repacked weights (loaded once per session)


@pytest.fixture(scope="module")
def draft():
    return load_default_gguf("draft")


@pytest.fixture(scope="module")
def tokenizer(target):
    from specdecode.models.backends import load_llamacpp_tokenizer

    return load_llamacpp_tokenizer(target)


IDS = torch.tensor([(37 * i + 11) % 20000 + 100 for i in range(700)])


def test_truncate_then_decode_equals_the_same_passes_without_rollback(target) -> None:
    a, b = target.make_runner(n_ctx=256), target.make_runner(n_ctx=256)
    a.forward(IDS[:20])
    a.forward(IDS[30:36], num_logits=6)  # rejected drafts
    a.truncate(20)
    assert a.length == 20
    rolled_back = a.forward(IDS[20:23], num_logits=3)
    b.forward(IDS[:20])
    fresh = b.forward(IDS[20:23], num_logits=3)
    assert torch.equal(rolled_back, fresh)  # same passes, same cache content: bit for bit
    # and a fresh prefill of the whole sequence (one pass of another shape): equal up to rounding
    c = target.make_runner(n_ctx=256)
    whole = c.forward(IDS[:23], num_logits=3)
    assert (whole - fresh).abs().max() < 0.05 * (1 + fresh.abs().max())
    assert torch.equal(whole.argmax(-1), fresh.argmax(-1))
    with pytest.raises(ValueError, match="truncate length"):
        a.truncate(24)


def test_a_repeated_prompt_reuses_its_first_pass_bit_for_bit(target) -> None:
    """``restart`` (prompt reuse, specdecode.models.first_pass): the same prompt again returns the
    first pass's rows with no pass, and every pass after it equals a fresh sequence's bit for bit
    (the cells it kept are that pass's own); other arguments, a rollback below the prompt, a tree
    pass's nodes or ``reset`` make it run a pass, or drop what they must; a plain ``forward`` keeps
    nothing."""
    runner, fresh = target.make_runner(n_ctx=256), target.make_runner(n_ctx=256)
    prompt = IDS[:20]
    first = runner.restart(prompt)
    assert not runner.reused_prompt and runner.passes == 1
    runner.forward(IDS[20:26], num_logits=6)  # a verification pass, then a token
    runner.forward(IDS[26:27])
    passes = runner.passes
    again = runner.restart(prompt)
    assert runner.reused_prompt and runner.passes == passes and runner.length == 20
    assert torch.equal(again, first) and again.data_ptr() != first.data_ptr()
    fresh.forward(prompt)
    assert torch.equal(runner.forward(IDS[40:44], num_logits=4), fresh.forward(IDS[40:44], num_logits=4))
    assert torch.equal(runner.forward(IDS[44:45]), fresh.forward(IDS[44:45]))
    # a tree pass's nodes after the prompt are dropped with the rest
    attend = torch.ones(2, runner.length + 2, dtype=torch.bool)
    attend[0, -1] = False
    runner.forward_masked(IDS[50:52], torch.tensor([runner.length, runner.length + 1]), attend)
    assert torch.equal(runner.restart(prompt), first) and runner.reused_prompt and runner.length == 20
    fresh.truncate(20)
    assert torch.equal(runner.forward(IDS[40:44], num_logits=4), fresh.forward(IDS[40:44], num_logits=4))
    # other arguments, another prompt: a pass runs (and is kept in turn)
    for ids, n, hidden in [(prompt, 2, False), (IDS[:19], 1, False), (prompt, 1, True)]:
        runner.restart(ids, num_logits=n, return_hidden=hidden)
        assert not runner.reused_prompt
    logits, features = runner.restart(prompt, return_hidden=True)
    assert runner.reused_prompt and features.shape == (20, target.hidden_size)
    runner.truncate(19)  # its cells are gone
    runner.restart(prompt, return_hidden=True)
    assert not runner.reused_prompt
    runner.reset()
    assert torch.equal(runner.restart(prompt), first) and not runner.reused_prompt
    runner.reset()
    runner.forward(prompt)  # not a restart: nothing kept
    runner.restart(prompt)
    assert not runner.reused_prompt


def test_after_reset_every_pass_equals_a_fresh_runners(target) -> None:
    """``reset`` frees the cells and leaves their K and V in place (zeroing them cost 2.5 ms a
    request): a sequence decoded after a longer one, prefill, verification and one-token passes,
    equals a fresh runner's bit for bit, so nothing of the old sequence reaches a row."""
    used, fresh = target.make_runner(n_ctx=512), target.make_runner(n_ctx=512)
    used.forward(IDS[:300])
    used.forward(IDS[300:309], num_logits=9)
    used.reset()
    assert used.length == 0
    for runner in (used, fresh):
        runner.forward(IDS[400:430])
    assert torch.equal(used.forward(IDS[430:439], num_logits=9), fresh.forward(IDS[430:439], num_logits=9))
    used.truncate(32)  # two drafts accepted
    fresh.truncate(32)
    for i in range(432, 436):
        assert torch.equal(used.forward(IDS[i : i + 1]), fresh.forward(IDS[i : i + 1]))


def test_weights_in_huge_pages_give_the_same_logits(target) -> None:
    """``huge_pages`` (the default) changes where the weights sit, not what they are: a prefill, a
    verification pass and one-token passes equal a load without it bit for bit; without it nothing
    is collapsed."""
    from specdecode.models.llamacpp.model import LlamaCppModel

    plain = LlamaCppModel(target.path, replace(target.options, huge_pages=False))
    assert plain.huge_page_bytes == 0 and target.huge_page_bytes % (2 << 20) == 0  # whole 2 MiB pages, if any
    a, b = target.make_runner(n_ctx=256), plain.make_runner(n_ctx=256)
    assert torch.equal(a.forward(IDS[:40]), b.forward(IDS[:40]))
    assert torch.equal(a.forward(IDS[40:49], num_logits=9), b.forward(IDS[40:49], num_logits=9))
    for i in range(49, 52):
        assert torch.equal(a.forward(IDS[i : i + 1]), b.forward(IDS[i : i + 1]))


WIDTHS = (2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 24, 33)
"""Verification widths checked for invariance (those up to ``invariant_tokens``)."""


@pytest.mark.parametrize("cached", [20, 300, 600])
def test_passes_up_to_invariant_tokens_are_bit_identical_to_one_token_passes(target, cached) -> None:
    """The property exact mode rests on, on this build and this CPU; after 300 and 600 cached tokens
    too (llama.cpp's flash attention sums a one-token pass over 512+ cached tokens in per-thread
    chunks: exact mode runs such passes on ggml's reference kernels, below). The set-up's build
    carries specdecode's batch-invariance patch, so every width up to 33 is one pass here."""
    n_inv = target.options.invariant_tokens
    widths = [n for n in WIDTHS if n <= n_inv]
    runner = target.make_runner(n_ctx=1024)
    runner.forward(IDS[:cached])
    singles = torch.cat([runner.forward(IDS[cached + i : cached + i + 1]) for i in range(max(widths))])
    for n in widths:
        runner.truncate(cached)
        before = runner.passes
        logits = runner.forward(IDS[cached : cached + n], num_logits=n)
        assert runner.passes - before == 1
        assert torch.equal(logits, singles[:n]), f"pass of {n} tokens after {cached}"


def test_the_set_up_build_verifies_any_width_in_one_pass(target) -> None:
    """scripts/setup.sh builds llama.cpp with specdecode's batch-invariance patch
    (``models/llamacpp/invariant_patch.py``): the CPU backend answers its marker, and an exact model
    left to its defaults verifies up to PATCHED_INVARIANT_TOKENS tokens in one pass."""
    from specdecode.models.llamacpp.invariant_patch import VERSION
    from specdecode.models.llamacpp.kernels import invariant_rows
    from specdecode.models.llamacpp.model import PATCHED_INVARIANT_TOKENS

    assert invariant_rows() == VERSION, "the installed llama.cpp build lacks the patch: rerun scripts/setup.sh"
    assert target.options.invariant_tokens == PATCHED_INVARIANT_TOKENS


def test_a_verification_pass_wider_than_invariant_tokens_is_split() -> None:
    """An exact model given ``invariant_tokens`` (here 3, the rule of a build without the patch)
    splits a 12-row verification pass into chunks of at most 3, each bit-identical to one-token
    passes."""
    narrow = load_default_gguf("target", invariant_tokens=3)
    runner = narrow.make_runner(n_ctx=256)
    runner.forward(IDS[:20])
    singles = torch.cat([runner.forward(IDS[20 + i : 21 + i]) for i in range(12)])
    runner.truncate(20)
    before = runner.passes
    split = runner.forward(IDS[20:32], num_logits=12)
    assert runner.passes - before == 4
    assert torch.equal(split, singles)


def _two_token_pass_matches_one_token_passes(runner, cached: int) -> bool:
    runner.forward(IDS[:cached])
    singles = torch.cat([runner.forward(IDS[cached + i : cached + i + 1]) for i in range(2)])
    runner.truncate(cached)
    return torch.equal(runner.forward(IDS[cached : cached + 2], num_logits=2), singles)


def test_exact_mode_runs_flash_attention_on_reference_kernels(target) -> None:
    """Exact mode keeps llama.cpp's flash attention on and switches ggml's CPU reference kernels on
    (``models/llamacpp/kernels.py``): on the set-up's patched build for every pass, prefills included
    (``every_pass``: each cell is what one-token decoding writes, so a reused prefix is exact); on an
    unpatched one for passes of at most ``invariant_tokens`` tokens, a prefill on the fast kernels.
    The switch is what makes the invariance test above pass after 600 cached tokens: held off,
    llama.cpp sums a one-token pass over 512+ cells in per-thread chunks and the 2-token pass rounds
    differently (if a llama.cpp update changes that, re-measure and update docs/llamacpp.md)."""
    from specdecode.models.llamacpp.kernels import invariant_rows

    runner = target.make_runner(n_ctx=1024)
    kernels = runner.reference_kernels
    assert kernels is not None, "setup.sh's CPU build offers ggml_backend_cpu_set_use_ref"
    assert kernels.every_pass == (invariant_rows() > 0) and runner.reuses_prefixes == kernels.every_pass
    runner.forward(IDS[:600])
    assert kernels.on == kernels.every_pass  # the prefill: fast (tiled, split) kernels unless every pass
    runner.forward(IDS[600:601])
    assert kernels.on
    short = target.make_runner(n_ctx=256)
    short.forward(IDS[:40])  # a prompt's first pass of 40 tokens
    assert short.reference_kernels.on == kernels.every_pass
    short.forward(IDS[40:60], num_logits=20)  # a verification pass of 20: invariant, reference kernels
    assert short.reference_kernels.on == (target.options.invariant_tokens >= 20 or kernels.every_pass)
    held_off = target.make_runner(n_ctx=1024)
    held_off.reference_kernels = None  # flash attention on, llama.cpp's own kernels throughout
    assert not _two_token_pass_matches_one_token_passes(held_off, 600)


def test_the_reference_switchs_attention_agrees_with_llama_cpps_own(target) -> None:
    """The patch computes attention for the reference switch by blocks of 64 cached positions with an
    FP32 accumulator (``native/flash_attn_rows.cpp``), not as ggml's reference path does: after 600
    cached tokens (blocks of 64, the last one partly masked) its logits stay within rounding of
    llama.cpp's own kernels (split-KV attention). Measured 2026-11-28 on the 2-core EPYC, 900 cached:
    largest difference 0.43, mean 0.058, as ggml's reference path (0.42, 0.058); a wrong mask or
    rescaling moves logits by whole units."""
    exact = target.make_runner(n_ctx=1024)
    own = target.make_runner(n_ctx=1024)
    own.reference_kernels = None  # llama.cpp's own kernels throughout
    rows = []
    for runner in (exact, own):
        runner.forward(IDS[:600])
        rows.append(torch.cat([runner.forward(IDS[600 + i : 601 + i]) for i in range(6)]))
    assert exact.reference_kernels is not None and exact.reference_kernels.on
    difference = (rows[0] - rows[1]).abs()
    assert float(difference.max()) < 1.0 and float(difference.mean()) < 0.15, difference.max()


def test_without_the_switch_exact_mode_turns_flash_attention_off(target, monkeypatch) -> None:
    """A llama.cpp build without the switch: exact mode falls back to flash attention off (the
    runner then has no switch) and passes stay invariant past 512 cached tokens."""
    import specdecode.models.llamacpp.kernels as kernels_module

    monkeypatch.setattr(kernels_module, "reference_kernels", lambda *args: None)
    runner = target.make_runner(n_ctx=1024)
    assert runner.reference_kernels is None
    assert _two_token_pass_matches_one_token_passes(runner, 600)


def test_fast_mode_verifies_in_one_pass(target) -> None:
    fast = load_default_gguf("target", exact=False)
    assert fast.path == target.path and not fast.options.exact
    runner = fast.make_runner(n_ctx=128)
    runner.forward(IDS[:10])
    before = runner.passes
    logits = runner.forward(IDS[10:22], num_logits=12)
    assert runner.passes - before == 1 and logits.shape == (12, fast.vocab_size)


class Scripted(ProposerBase):
    """A proposer that drafts from a known continuation: ``agree`` of each draft's tokens right
    (all: fully, 0: never; the rest wrong by one id)."""

    name = "scripted"

    def __init__(self, prompt_len: int, continuation: list[int], agree: int | None) -> None:
        self.prompt_len, self.continuation, self.agree = prompt_len, continuation, agree

    def reset(self) -> None:
        pass

    def propose(self, context, num_tokens, sampling, generator) -> DraftTokens:
        start = int(context.shape[0]) - self.prompt_len
        right = self.continuation[start : start + num_tokens]
        ids = [t if self.agree is None or i < self.agree else (t + 1) % 151000 for i, t in enumerate(right)]
        return DraftTokens(torch.tensor(ids, dtype=torch.int64))

    def observe(self, result: VerifyResult) -> None:
        pass


@pytest.mark.parametrize("agree", [None, 0, 2])
@pytest.mark.parametrize("k", [3, 8])
def test_greedy_equals_plain_decoding_with_drafts_that_agree_fully_never_partly(target, tokenizer, agree, k) -> None:
    """24 tokens: k = 8 verifies in three chunks of ``invariant_tokens`` and k = 3 in two, and the
    partly agreeing drafts (2 of each k right) are cut at a known place in every one of 6-8 steps."""
    sampling = SamplingParams(max_new_tokens=24)
    ids = SpeculativeGenerator(target, tokenizer=tokenizer).encode_prompt(PROMPTS[0]).tolist()
    expected = plain_greedy(target, ids, 24, tokenizer)  # plain decoding, once for the six cases
    proposer = Scripted(len(ids), expected + [0] * 16, agree)
    result = SpeculativeGenerator(target, tokenizer=tokenizer, proposer=proposer).generate(
        ids, sampling, num_speculative_tokens=k
    )
    assert result.token_ids == expected and len(expected) == 24
    rate = result.stats.acceptance_rate
    assert rate > 0.95 if agree is None else (rate == 0.0 if agree == 0 else 0.1 < rate < 0.95), rate


def test_the_gates_whole_passes_equal_plain_decoding(target, tokenizer, monkeypatch) -> None:
    """The draft gate sends a likely draft as one whole call without the early stop
    (``DraftTokens.early_stop`` False: no greedy hint) where the patched build's 2-row first chunk
    would cost an extra call; with the 2-core EPYC's call costs fixed (~20.9 + 12.1 n ms) such passes
    run, and the output is plain decoding's."""
    from specdecode.draft_gate import PassCosts
    from specdecode.proposers.prompt_lookup import PromptLookupConfig, PromptLookupProposer

    lookup = PromptLookupProposer(PromptLookupConfig(min_ngram=3, max_ngram=8))
    spec = SpeculativeGenerator(target, tokenizer=tokenizer, proposer=lookup)
    costs = PassCosts(ema=1e-9)  # the run's own timings barely move them
    for w in range(1, 18):
        costs.ms[w] = 20.9 + 12.1 * w if w <= 2 else (20.9 + 12.1 * 2) + (20.9 + 12.1 * (w - 2))
    spec.pass_costs = costs
    from specdecode.models.llamacpp.model import LlamaCppRunner

    whole = []
    forward = LlamaCppRunner.forward

    def spy(self, input_ids, num_logits=1, return_hidden=False, greedy_draft=None):
        whole.append(num_logits > 1 and greedy_draft is None)
        return forward(self, input_ids, num_logits, return_hidden, greedy_draft)

    copying = (  # an answer that copies the prompt: drafts right most of the time
        "Here is a module:\n```python\n"
        + "".join(f"def f{i}(x: int) -> int:\n    return x * {i} + {i % 7}\n\n" for i in range(6))
        + "```\nRewrite every function so that it also accepts floats, and keep the same order."
    )
    ids = spec.encode_prompt(copying).tolist()
    expected = plain_greedy(target, ids, 64, tokenizer)
    monkeypatch.setattr(LlamaCppRunner, "forward", spy)
    result = spec.generate(ids, SamplingParams(max_new_tokens=64))
    assert result.token_ids == expected
    assert any(whole), "no whole pass ran"


@pytest.mark.parametrize("proposer", ["prompt_lookup", "draft_model"])
def test_greedy_speculation_equals_plain_decoding_on_real_prompts(target, draft, tokenizer, proposer) -> None:
    from specdecode.proposers import make_proposer

    built = make_proposer(proposer, draft=draft, target=target)
    spec = SpeculativeGenerator(target, tokenizer=tokenizer, proposer=built)
    sampling = SamplingParams(max_new_tokens=32)
    accepted = 0
    assert int(spec.encode_prompt(LONG_PROMPT).shape[0]) > 512
    for prompt in [*PROMPTS, LONG_PROMPT]:
        ids = spec.encode_prompt(prompt).tolist()
        expected = plain_greedy(target, ids, 32, tokenizer)  # decoded once for both proposers
        result = spec.generate(ids, sampling, schedule="ungated")  # every draft sent: the proposer's own
        assert result.token_ids == expected, prompt
        accepted += result.stats.accepted_tokens
        assert result.stats.dtype.startswith("gguf")
    assert accepted > 10  # the drafts were used


def test_from_pretrained_runs_the_default_pair_on_llamacpp(target) -> None:
    spec = SpeculativeGenerator.from_pretrained(threads=2)  # auto: the default pair runs on llama.cpp
    assert spec.backend == "llamacpp"
    assert spec.proposer.name == "prompt_lookup" and spec.proposer.config.min_ngram == 3  # proposer auto
    drafted = SpeculativeGenerator.from_pretrained(backend="llamacpp", threads=2, proposer="draft_model")
    result = drafted.generate(PROMPTS[1], SamplingParams(max_new_tokens=24))
    assert "def" in result.text or "running" in result.text
    assert result.stats.proposer == "draft_model" and result.stats.accepted_tokens > 0
    with pytest.raises(ValueError, match="llamacpp backend"):
        SpeculativeGenerator.from_pretrained(backend="llamacpp", proposer="early_exit")


SAMPLED_RUNS = 600  # seeds 0-599; the power below is for this many


def test_sampled_first_two_tokens_follow_the_target(target, draft, tokenizer) -> None:
    """Temperature 1, top-k 6: tokens 1 and 2 of speculative sampling (draft model, k = 1: the
    second token is the draft's when accepted, else a recovered token; the third may be a bonus
    token; with two tokens asked for nothing would be drafted, as no room is left for one)
    follow the target's exact distribution, computed from llama.cpp's own logits.

    Two tests, at family-wise significance P_MIN (Bonferroni, P_MIN / 2 each; a correct sampler
    fails on fresh seeds with probability <= P_MIN, 0.0012 measured by simulation from this prompt's
    laws): token 1 against the target's first law, and token 2 given token 1 against the target's
    law after it, Pearson's statistic summed over the first tokens, every cell's expected count >= 5
    (stat_checks.first_two_tokens_p_values). Power at 600 samples, simulated from this prompt's
    target and draft laws: a bug is caught with probability 1.00 when the draft leaks (every draft
    accepted) or token 2 is checked against the next logits row; 0.998 with the acceptance ratio
    inverted (min(1, q/p)); 0.98 with the recovered token drawn from p instead of norm(max(0, p - q))
    (total variation 0.02-0.21 per first token); 0.26 with q taken without top-k in the ratio and
    the residual (total variation 0.01-0.15). The joint test over the 36 pairs at 400 samples that
    this replaces: 0.76 for the recovered-token bug (false alarms 0.0013). Fewer samples lose that
    power (re-simulated for issue 50: the recovered-token bug 0.72 at 400 samples, 0.45 at 300;
    q without top-k 0.08, 0.03), so the test keeps 600 though it is the suite's slowest."""
    from specdecode.proposers import make_proposer

    sampling = SamplingParams(temperature=1.0, top_k=6, max_new_tokens=3)  # 3: token 2 is drafted (k = 1)
    prompt = tokenizer.encode("My favourite fruit is")  # six likely next tokens, none dominant
    runner = target.make_runner(n_ctx=64)
    p1 = logits_to_probs(runner.forward(torch.tensor(prompt))[0].double(), sampling).double()  # (V,)
    p2: dict[int, torch.Tensor] = {}  # the target's law of token 2 after each possible token 1
    for t1 in p1.nonzero().flatten().tolist():
        runner.truncate(len(prompt))
        p2[t1] = logits_to_probs(runner.forward(torch.tensor([t1]))[0].double(), sampling).double()  # (V,)
    spec = SpeculativeGenerator(target, proposer=make_proposer("draft_model", draft=draft))
    pairs, accepted = [], 0
    for seed in range(SAMPLED_RUNS):
        tokens: list[int] = []
        seeded = SamplingParams(**{**sampling.__dict__, "seed": seed})
        for new, _, so_far in spec.stream_tokens(prompt, seeded, num_speculative_tokens=1):
            tokens += new
            if len(tokens) >= 2:  # token 2 is known: the step after a rejection (for token 3) is not run
                break
        pairs.append((tokens[0], tokens[1]))
        accepted += so_far.stats.accepted_tokens
    p_values = first_two_tokens_p_values(pairs, p1, p2)
    assert check_all(p_values, P_MIN), p_values
    assert 0.1 * SAMPLED_RUNS < accepted < 0.975 * SAMPLED_RUNS  # drafts both accepted and rejected


def test_a_repeated_prompt_decodes_as_a_fresh_one(target, draft, tokenizer) -> None:
    """Prompt reuse through the engine: a request whose prompt is the previous one's skips the
    prefill (``stats.prefill_reused``) and gives the tokens a generator that runs every prefill
    (``reuse_prompt = False``) gives, greedy and sampled with a seed; the draft model keeps its
    cells across requests too (``clear_cache`` forgets them): its first pass feeds the last prompt
    token only, and it drafts what a fresh draft does."""
    prompt = tokenizer.encode("def fibonacci(n):")
    reusing = SpeculativeGenerator(target, draft=draft)
    fresh = SpeculativeGenerator(target, draft=draft)
    fresh.reuse_prompt = False
    runs = [SamplingParams(max_new_tokens=12), SamplingParams(temperature=1.0, seed=3, max_new_tokens=12)]
    reusing.generate(prompt, runs[0], num_speculative_tokens=3)
    for sampling in runs:
        again = reusing.generate(prompt, sampling, num_speculative_tokens=3)
        fresh.proposer.clear_cache()  # its draft from an empty cache
        alone = fresh.generate(prompt, sampling, num_speculative_tokens=3)
        assert again.stats.prefill_reused and not alone.stats.prefill_reused
        assert again.token_ids == alone.token_ids
        assert again.stats.draft_pass_widths[0] == 1 < alone.stats.draft_pass_widths[0]  # the draft's kept prompt
        assert again.stats.accepted_per_step == alone.stats.accepted_per_step  # the same drafts
    other = reusing.generate(prompt[:-1], runs[0], num_speculative_tokens=3)
    assert not other.stats.prefill_reused


def test_hidden_states_are_what_the_lm_head_turns_into_the_logits(target) -> None:
    """``return_hidden``: the features are llama.cpp's final hidden states (after the output norm):
    multiplied by the GGUF's own output matrix (rows dequantized with the ``gguf`` package) they give
    the returned logits, up to llama.cpp's 8-bit quantized activations; the pass's logits equal
    those of the same pass without features up to the same rounding."""
    gguf = pytest.importorskip("gguf")
    runner = target.make_runner(n_ctx=128)
    logits, hidden = runner.forward(IDS[:12], num_logits=4, return_hidden=True)
    assert hidden.shape == (12, target.hidden_size) and hidden.dtype == torch.float32
    assert logits.shape == (4, target.vocab_size) and runner.length == 12
    plain = target.make_runner(n_ctx=128).forward(IDS[:12], num_logits=4)
    assert torch.equal(plain.argmax(-1), logits.argmax(-1))
    assert (plain - logits).abs().max() < 0.05 * (1 + plain.abs().max())
    tensors = {t.name: t for t in gguf.GGUFReader(target.path).tensors}
    head = tensors.get("output.weight") or tensors["token_embd.weight"]  # tied embeddings have no output.weight
    ids = sorted(set(logits.topk(8, dim=-1).indices.flatten().tolist()) | {0, 17, 4242, 100000})
    rows = torch.from_numpy(gguf.quants.dequantize(head.data[ids], head.tensor_type).copy()).float()  # (n, H)
    mine = hidden[-4:] @ rows.T  # (4, n)
    scale = 1 + float(logits[:, ids].abs().max())
    assert (mine - logits[:, ids]).abs().max() < 0.02 * scale
    # a later pass with features continues the same sequence: the root row matches a pass without them
    more, more_hidden = runner.forward(IDS[12:15], num_logits=3, return_hidden=True)
    assert more_hidden.shape == (3, target.hidden_size) and runner.length == 15
    reference = target.make_runner(n_ctx=128)
    reference.forward(IDS[:12])
    assert (reference.forward(IDS[12:15], num_logits=3) - more).abs().max() < 0.05 * scale


def test_a_greedy_verification_pass_stops_after_the_first_chunk_with_a_wrong_draft() -> None:
    """Exact mode verifies in chunks of ``invariant_tokens`` (here given: 3); with ``greedy_draft`` it
    stops after the chunk whose argmax first disagrees with the draft (the verifier would throw the
    later rows away)."""
    target = load_default_gguf("target", invariant_tokens=3)
    runner = target.make_runner(n_ctx=128)
    first = int(runner.forward(IDS[:20])[0].argmax())
    chain = [first]
    for _ in range(8):  # the target's own greedy continuation, one token per pass
        chain.append(int(runner.forward(torch.tensor(chain[-1:]))[0].argmax()))
    runner.truncate(20)
    right = torch.tensor(chain)  # (9,): root + 8 drafts the target agrees with
    full = runner.forward(right, num_logits=9, greedy_draft=right[1:])
    assert full.shape[0] == 9 and runner.length == 29
    assert torch.equal(full.argmax(-1)[:-1], right[1:])
    runner.truncate(20)
    wrong = right.clone()
    wrong[2] = (wrong[2] + 1) % 1000  # the second draft is wrong: the first chunk (3 rows) shows it
    rows = runner.forward(wrong, num_logits=9, greedy_draft=wrong[1:])
    n_inv = target.options.invariant_tokens
    assert rows.shape[0] == n_inv and runner.length == 20 + n_inv
    assert torch.equal(rows[:2], full[:2])  # the rows before the wrong token are the same


def test_exact_mode_declares_its_chunks_to_the_draft_gate(target) -> None:
    """The draft gate prices a wrong draft at the chunks up to it: exact mode declares where it stops
    (the patched build: a first chunk of 2 rows, then the rest in one pass)."""
    from specdecode.models.llamacpp.model import GREEDY_FIRST_ROWS, greedy_first_chunk

    n_inv = target.options.invariant_tokens
    expected_first = GREEDY_FIRST_ROWS if n_inv > 3 else n_inv
    assert target.capabilities.greedy_stop_rows == greedy_first_chunk(n_inv) == expected_first
    assert target.capabilities.greedy_stop_then == n_inv
    runner = target.make_runner()
    assert runner.capabilities.greedy_stop_rows == greedy_first_chunk(n_inv)


def test_a_wide_greedy_pass_stops_after_two_rows_at_a_wrong_first_draft(target) -> None:
    """On the patched build a greedy verification pass computes the root and the first draft first:
    a wrong first draft stops it there (2 rows, one pass); right drafts get the rest in one more pass,
    bit for bit the rows of one pass."""
    if target.options.invariant_tokens <= 3:
        pytest.skip("a build without the batch-invariance patch: chunks of 3 (the test above)")
    runner = target.make_runner(n_ctx=128)
    first = int(runner.forward(IDS[:20])[0].argmax())
    chain = [first]
    for _ in range(8):
        chain.append(int(runner.forward(torch.tensor(chain[-1:]))[0].argmax()))
    runner.truncate(20)
    right = torch.tensor(chain)
    whole = runner.forward(right, num_logits=9)  # no hint: one pass
    runner.truncate(20)
    before = runner.passes
    hinted = runner.forward(right, num_logits=9, greedy_draft=right[1:])
    assert runner.passes - before == 2 and torch.equal(hinted, whole)
    runner.truncate(20)
    wrong = right.clone()
    wrong[1] = (wrong[1] + 1) % 1000  # the first draft is wrong
    before = runner.passes
    rows = runner.forward(wrong, num_logits=9, greedy_draft=wrong[1:])
    assert runner.passes - before == 1 and rows.shape[0] == 2 and runner.length == 22
    assert torch.equal(rows[0], whole[0])
