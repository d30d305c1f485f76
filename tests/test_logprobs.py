"""Log-probabilities under speculation (issue 33): every reported value equals a plain re-scoring
of prompt + emitted tokens by the same target (one fresh forward, no cache), with speculation off
and on (drafts that agree fully: bonus tokens; never: recovered tokens; partly), with prompt lookup,
with token trees, greedy and sampled, on tiny random float32 models.

Tolerance: ``ATOL = 1e-4`` nats, absolute, on every log-probability (the chosen token's and the
alternatives'). Both sides are float32 ``log_softmax`` of the same target's logits; what differs is
only the pass a position was scored in (cached verification pass against one full forward), which
moves float32 logits by ~1e-6 here.
"""

from __future__ import annotations

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, check_num_logprobs, token_logprobs
from specdecode.models.torch.runner import ModelRunner
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.proposers.prompt_lookup import PromptLookupConfig, PromptLookupProposer

ATOL = 1e-4  # nats; see the module docstring
PROMPT = [5, 17, 33, 2, 9, 60, 11, 5, 17, 33]
GREEDY = SamplingParams(max_new_tokens=24)
# sampled, with top-k and top-p: the reported values must still be the raw distribution's
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_new_tokens=24)


def rescored(target, prompt: list[int], emitted: list[int]) -> torch.Tensor:
    """float32 ``[len(emitted), V]``: log_softmax of one fresh forward over prompt + emitted (no cache),
    row i for the position of ``emitted[i]``."""
    P = len(prompt)
    with torch.no_grad():
        logits = target(torch.tensor([prompt + emitted])).logits[0].float()  # (P + m, V)
    return torch.log_softmax(logits[P - 1 : P - 1 + len(emitted)], dim=-1)  # (m, V)


def check_against_rescoring(target, prompt: list[int], ids: list[int], logprobs: list[TokenLogprob], n: int) -> None:
    """Every entry: the chosen token's value, and N alternatives that are the N largest of the
    re-scored row (values compared; ids checked through their re-scored values, so that near-ties
    may come in either order)."""
    assert logprobs is not None and len(logprobs) == len(ids) > 0
    ref = rescored(target, prompt, ids)
    for i, (entry, token) in enumerate(zip(logprobs, ids, strict=True)):
        assert entry.token_id == token
        assert abs(entry.logprob - float(ref[i, token])) <= ATOL, (i, entry.logprob, float(ref[i, token]))
        assert len(entry.top) == n
        best = torch.topk(ref[i], n).values.tolist()
        for (alt, value), expected in zip(entry.top, best, strict=True):
            assert abs(value - expected) <= ATOL, (i, value, expected)
            assert abs(value - float(ref[i, alt])) <= ATOL, (i, alt, value, float(ref[i, alt]))


def generators(pair) -> dict[str, tuple[SpeculativeGenerator, dict]]:
    target = pair["target"]
    lookup = PromptLookupProposer(PromptLookupConfig(max_ngram=3, min_ngram=1))
    return {
        "off": (SpeculativeGenerator(target), {"speculative": False}),
        "identical": (SpeculativeGenerator(target, proposer=DraftModelProposer(pair["identical"])), {}),
        "unrelated": (SpeculativeGenerator(target, proposer=DraftModelProposer(pair["unrelated"])), {}),
        "perturbed": (SpeculativeGenerator(target, proposer=DraftModelProposer(pair["perturbed"])), {}),
        "prompt_lookup": (SpeculativeGenerator(target, proposer=lookup), {}),
        "tree": (SpeculativeGenerator(target, proposer=DraftModelProposer(pair["perturbed"])), {"tree": "tree8"}),
        "dynamic_tree": (
            SpeculativeGenerator(target, proposer=DraftModelProposer(pair["perturbed"])),
            {"tree": "dynamic:6:3:2"},
        ),
    }


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("how", ["off", "identical", "unrelated", "perturbed", "prompt_lookup", "tree", "dynamic_tree"])
def test_logprobs_equal_rescoring_with_speculation_off_on_and_trees(tiny_pair, how, sampling) -> None:
    spec, options = generators(tiny_pair)[how]
    result = spec.generate(PROMPT, sampling, logprobs=5, **options)
    check_against_rescoring(tiny_pair["target"], PROMPT, result.token_ids, result.logprobs, 5)
    if how == "identical":  # all accepted: bonus tokens were emitted and checked
        assert result.stats.accepted_tokens > 0
    if how == "unrelated":  # rejections: recovered tokens were emitted and checked
        assert result.stats.accepted_tokens < result.stats.draft_tokens
    # asking for log-probabilities changes nothing that is decoded
    plain = spec.generate(PROMPT, sampling, **options)
    assert plain.token_ids == result.token_ids and plain.logprobs is None


def test_logprobs_are_the_raw_distribution_not_the_sampling_one(tiny_pair) -> None:
    """With top-k 2 the sampling distribution gives every other token -inf; the reported
    alternatives are the raw distribution's, so the third one is finite."""
    spec = SpeculativeGenerator(tiny_pair["target"], proposer=DraftModelProposer(tiny_pair["perturbed"]))
    sampling = SamplingParams(temperature=0.5, top_k=2, seed=3, max_new_tokens=8)
    result = spec.generate(PROMPT, sampling, logprobs=3)
    assert all(len(e.top) == 3 and e.top[2][1] > float("-inf") for e in result.logprobs)
    check_against_rescoring(tiny_pair["target"], PROMPT, result.token_ids, result.logprobs, 3)


class EarlyStopRunner(ModelRunner):
    """A runner that, as llama.cpp's exact runner does, returns a greedy verification pass's rows
    only up to the first whose argmax disagrees with the draft (and caches only those tokens)."""

    def forward(self, input_ids, num_logits=1, return_hidden=False, greedy_draft=None):
        logits = super().forward(input_ids, num_logits, return_hidden)
        if greedy_draft is None:
            return logits
        wrong = (logits[:-1].argmax(-1) != greedy_draft.to(logits.device)).nonzero()
        if not wrong.numel():
            return logits
        m = int(wrong[0, 0]) + 1  # the rejected row is kept: it scores the recovered token
        self.truncate(self.length - (logits.shape[0] - m))
        return logits[:m]


def test_logprobs_from_a_runner_that_stops_a_verification_pass_early(tiny_pair) -> None:
    spec = SpeculativeGenerator(tiny_pair["target"], proposer=DraftModelProposer(tiny_pair["unrelated"]))
    spec.target = EarlyStopRunner(tiny_pair["target"])
    result = spec.generate(PROMPT, GREEDY, num_speculative_tokens=4, logprobs=2)
    assert result.stats.accepted_tokens < result.stats.draft_tokens  # stops happened
    check_against_rescoring(tiny_pair["target"], PROMPT, result.token_ids, result.logprobs, 2)


def test_logprobs_follow_the_tokens_cut_at_a_stop_and_the_stream(tiny_pair) -> None:
    spec = SpeculativeGenerator(tiny_pair["target"], proposer=DraftModelProposer(tiny_pair["identical"]))
    sampling = SamplingParams(max_new_tokens=7)  # the last pass's tokens are cut at the limit
    seen: list[TokenLogprob] = []
    for new_ids, _, result in spec.stream_tokens(PROMPT, sampling, num_speculative_tokens=4, logprobs=0):
        seen += result.logprobs[len(result.logprobs) - len(new_ids) :]
    assert len(result.token_ids) == 7 and [e.token_id for e in seen] == result.token_ids
    assert all(e.top == () for e in seen)
    check_against_rescoring(tiny_pair["target"], PROMPT, result.token_ids, seen, 0)
    out = result.to_dict()
    assert [e["token_id"] for e in out["logprobs"]] == result.token_ids
    assert "logprobs" not in spec.generate(PROMPT, sampling).to_dict()


def test_token_logprobs_by_hand() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 1.0, -1.0], [9.0, 9.0, 9.0, 9.0]])
    got = token_logprobs(logits, [3, 2], 2)  # the third row is not used
    assert len(got) == 2
    assert got[0].token_id == 3 and abs(got[0].logprob - float(torch.tensor(0.25).log())) < 1e-6
    z = float(torch.tensor([2.0, 0.0, 1.0, -1.0]).exp().sum().log())
    assert abs(got[1].logprob - (1.0 - z)) < 1e-6
    assert [t for t, _ in got[1].top] == [0, 2] and abs(got[1].top[0][1] - (2.0 - z)) < 1e-6
    assert token_logprobs(logits, [], 3) == []
    with pytest.raises(ValueError, match="rows"):
        token_logprobs(logits[:1], [1, 2], 0)
    with pytest.raises(ValueError, match="token ids"):
        token_logprobs(logits, [4], 0)


@pytest.mark.parametrize("bad", [-1, MAX_TOP_LOGPROBS + 1, True, 1.5, "2"])
def test_bad_logprobs_are_refused_naming_the_parameter(tiny_pair, bad) -> None:
    with pytest.raises(ValueError, match="logprobs"):
        check_num_logprobs(bad)
    with pytest.raises(ValueError, match="logprobs"):
        SpeculativeGenerator(tiny_pair["target"]).generate(PROMPT, GREEDY, logprobs=bad)
    assert check_num_logprobs(0) == 0 and check_num_logprobs(None) is None


# ------------------------------------------------------------------ the command line
@pytest.mark.parametrize("speculation", [[], ["--no-speculation"]], ids=["speculative", "target-only"])
def test_cli_logprobs_in_json_equal_rescoring(model_dirs, capsys, speculation) -> None:
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdecode.commands.main import main

    target_dir, draft_dir = model_dirs
    prompt = "def add(a, b):"
    argv = ["generate", prompt, "--raw", "--target", str(target_dir), "--draft", str(draft_dir), "--json"]
    argv += ["--dtype", "float32", "--max-new-tokens", "12", "-k", "3", "--logprobs", "3", *speculation]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    entries = out["logprobs"]
    assert [e["token_id"] for e in entries] == out["token_ids"]
    assert all(e["token"] == tokenizer.decode([e["token_id"]]) and len(e["top_logprobs"]) == 3 for e in entries)
    as_records = [
        TokenLogprob(e["token_id"], e["logprob"], tuple((t["token_id"], t["logprob"]) for t in e["top_logprobs"]))
        for e in entries
    ]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)  # --raw: as the engine encodes it
    check_against_rescoring(target, prompt_ids, out["token_ids"], as_records, 3)


@pytest.mark.parametrize("flags", [["--logprobs", "21", "--json"], ["--logprobs", "-1", "--json"], ["--logprobs", "2"]])
def test_cli_bad_logprobs_fail_before_loading_naming_the_flag(capsys, flags) -> None:
    from specdecode.commands.main import main

    assert main(["generate", "hi", "--target", "/nonexistent", *flags]) == 2
    assert "--logprobs" in capsys.readouterr().err


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_logprobs_under_a_constraint_are_the_raw_unmasked_distribution(tiny_tokenizer, sampling) -> None:
    """Structured output masks the distribution the tokens are drawn from; the reported values
    stay the target's raw ones (the masked-out alternatives included), equal to re-scoring."""
    pytest.importorskip("llguidance")
    from specdecode.constraints import Regex

    from conftest import make_tiny_model, perturbed_copy

    target = make_tiny_model(vocab_size=len(tiny_tokenizer), seed=0)
    spec = SpeculativeGenerator(
        target, tokenizer=tiny_tokenizer, proposer=DraftModelProposer(perturbed_copy(target, 0.01))
    )
    prompt = tiny_tokenizer.encode("def add(a, b):")
    result = spec.generate(prompt, sampling, logprobs=4, constraint=Regex(r"(def|class) [a-z]{1,8}\(\):"))
    assert result.text.startswith(("def ", "class "))
    check_against_rescoring(target, prompt, result.token_ids, result.logprobs, 4)
