"""The ``prediction`` proposer (OpenAI's Predicted Outputs): alignment, re-synchronization after
an edit, the usage record, and lossless decoding (greedy identity with predictions that agree
fully, never and partly; sampled tokens at every position against the target's exact marginals)."""

from __future__ import annotations

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.proposers.prediction import (
    PREDICTION_DEFAULT_K,
    PredictionConfig,
    PredictionProposer,
    encode_prediction,
    locate,
)
from specdecode.proposers.prompt_lookup import PromptLookupProposer
from specdecode.verify import VerifyResult

from conftest import make_tiny_model
from reference import exact_marginals, target_only_greedy
from stat_checks import P_MIN, chi_square_p

CONFIG = PredictionConfig()


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ---------------------------------------------------------------- where the prediction continues
def test_empty_answer_starts_at_the_prediction_start() -> None:
    assert locate(ids(5, 6, 7), ids(), 0, CONFIG) == (0, CONFIG.start_ngram)
    assert locate(ids(), ids(), 0, CONFIG) is None


def test_aligned_answer_continues_after_its_longest_match() -> None:
    prediction = ids(1, 2, 3, 4, 5, 6, 7, 8)
    assert locate(prediction, ids(1, 2, 3), 0, CONFIG) == (3, CONFIG.start_ngram + 3)  # the whole answer so far
    assert locate(prediction, ids(9, 2, 3), 0, CONFIG) == (3, 2)
    assert locate(prediction, ids(1, 2, 3, 4, 5, 6, 7, 8), 0, CONFIG) == (8, 12)  # used up: position L
    assert locate(prediction, ids(0, 1, 2, 3, 4, 5, 6, 7, 8), 0, CONFIG) == (8, 8)


def test_replaced_span_resynchronizes_on_the_text_after_it() -> None:
    """An edit replaced tokens 3, 4 by 30, 40: after the answer writes 5 the prediction goes on at 6."""
    prediction = ids(1, 2, 3, 4, 5, 6, 7, 8)
    assert locate(prediction, ids(1, 2, 30, 40), 2, CONFIG) is None  # inside the edit: nothing
    assert locate(prediction, ids(1, 2, 30, 40, 5), 2, CONFIG) == (5, 1)


def test_insertion_and_deletion() -> None:
    prediction = ids(1, 2, 3, 4, 5, 6, 7, 8)
    assert locate(prediction, ids(1, 2, 99, 3), 2, CONFIG) == (3, 1)  # 99 inserted, then the prediction again
    assert locate(prediction, ids(1, 2, 5, 6), 2, CONFIG) == (6, 2)  # 3, 4 deleted


def test_nearest_occurrence_after_the_last_aligned_position_wins() -> None:
    """Code repeats itself: ``6, 7, 8`` occurs twice; the answer is past the first, so the second wins."""
    prediction = ids(6, 7, 8, 1, 2, 3, 6, 7, 8, 4, 5)
    assert locate(prediction, ids(0, 6, 7, 8), 4, CONFIG) == (9, 3)
    assert locate(prediction, ids(0, 6, 7, 8), 0, CONFIG) == (3, 3)
    assert locate(prediction, ids(0, 6, 7, 8), 10, CONFIG) == (9, 3)  # none ahead: the nearest before
    assert locate(prediction, ids(0, 7, 8), 10, CONFIG) is None  # 2 tokens: trusted only ahead, near


def test_short_matches_are_trusted_only_near_the_last_position() -> None:
    config = PredictionConfig(window=4, near_ngram=3)
    prediction = ids(*range(20), 50, 51)
    assert locate(prediction, ids(99, 50), 0, config) is None  # a 1-token match 20 tokens ahead
    assert locate(prediction, ids(99, 50), 18, config) == (21, 1)
    assert locate(prediction, ids(18, 19, 50), 0, config) == (21, 3)  # 3 tokens: trusted anywhere


def test_bad_options_name_the_option() -> None:
    with pytest.raises(ValueError, match="min_ngram"):
        PredictionConfig(min_ngram=0)
    with pytest.raises(ValueError, match="max_ngram"):
        PredictionConfig(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="max_spec_factor"):
        PredictionConfig(max_spec_factor=0)


def test_encode_prediction_checks_its_input() -> None:
    assert encode_prediction([3, 4], None, 10).tolist() == [3, 4]
    with pytest.raises(ValueError, match=r"prediction token ids must be in \[0, 10\)"):
        encode_prediction([3, 10], None, 10)
    with pytest.raises(ValueError, match="prediction must be a string or a list of token ids"):
        encode_prediction({"type": "content"}, None, 10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no tokenizer"):
        encode_prediction("text", None, 10)


# ---------------------------------------------------------------- the proposer's steps and record
def test_steps_draft_the_prediction_and_fall_back_where_it_has_nothing() -> None:
    prompt = [60, 61, 62, 60, 61]
    fallback = PromptLookupProposer()
    proposer = PredictionProposer(ids(1, 2, 3, 4, 5, 6), fallback, prompt_len=len(prompt))
    greedy = SamplingParams()
    context = torch.tensor(prompt + [1, 2])
    draft = proposer.propose(context, 3, greedy, None)
    assert draft.ids.tolist() == [3, 4, 5] and draft.probs is None
    assert draft.evidence == ("prediction", CONFIG.start_ngram + 2)  # the gate sends it whole or withholds it
    assert draft.early_stop  # the first step of a copy keeps the runner's early stop
    proposer.observe(VerifyResult(2, ids(3, 4, 9)))  # 3, 4 accepted; 9 instead of 5
    assert proposer.record.accepted_prediction_tokens == 2
    context = torch.tensor(prompt + [1, 2, 3, 4, 9])
    draft = proposer.propose(context, 3, greedy, None)  # 9 is nowhere in the prediction: prompt lookup
    assert proposer.record.fallback_steps == 1
    assert draft.ids.tolist() == []  # nor in the prompt
    context = torch.tensor(prompt + [1, 2, 3, 4, 9, 6])
    assert proposer.propose(context, 3, greedy, None).ids.tolist() == []  # 6 is the prediction's last token
    record = proposer.record
    assert (record.prediction_tokens, record.accepted_prediction_tokens, record.rejected_prediction_tokens) == (6, 2, 4)
    proposer.reset()
    assert proposer.record.accepted_prediction_tokens == 0 and proposer.record.prediction_steps == 0


def test_fallback_drafts_where_the_prediction_has_nothing() -> None:
    prompt = [60, 61, 62, 63, 64, 65, 60, 61, 62]
    proposer = PredictionProposer(ids(1, 2), PromptLookupProposer(), prompt_len=len(prompt))
    draft = proposer.propose(torch.tensor(prompt + [70]), 4, SamplingParams(), None)
    assert draft.ids.tolist() == [] and proposer.record.fallback_steps == 1
    proposer = PredictionProposer(ids(1, 2), PromptLookupProposer(), prompt_len=len(prompt) - 3)
    draft = proposer.propose(torch.tensor(prompt), 4, SamplingParams(), None)  # answer 60 61 62: lookup finds it
    assert draft.ids.tolist() == [63, 64, 65, 60]
    assert proposer.name == "prediction+prompt_lookup"


# ---------------------------------------------------------------- lossless end to end
PROMPTS = [[5, 17, 33, 2, 9, 60, 11], [40, 41, 42]]
N = 48


def edited(tokens: list[int], vocab: int) -> list[int]:
    """``tokens`` with an edit every 12 tokens: one replaced, one inserted, one deleted."""
    out = list(tokens)
    out[5] = (out[5] + 1) % vocab
    out.insert(20, (out[20] + 7) % vocab)
    del out[33]
    return out


@pytest.mark.parametrize("kind", ["same", "edited", "unrelated"])
@pytest.mark.parametrize("fallback", [False, True])
def test_greedy_equals_target_only(tiny_target, kind: str, fallback: bool) -> None:
    """Greedy output equals the target alone's with a prediction that agrees fully (the answer
    itself), partly (edited every 12 tokens) and never (tokens the answer has not), with and
    without prompt lookup drafting where the prediction has nothing. A prediction unrelated to the
    answer costs nothing: the request makes exactly the passes it makes without one."""
    V = tiny_target.config.vocab_size
    generator = SpeculativeGenerator(tiny_target, proposer=PromptLookupProposer() if fallback else None)
    sampling = SamplingParams(max_new_tokens=N)
    accepted, rates = [], []
    for prompt in PROMPTS:
        expected = target_only_greedy(tiny_target, prompt, N)
        prediction = {
            "same": expected,
            "edited": edited(expected, V),
            "unrelated": [t for t in range(V) if t not in expected][:40],
        }[kind]
        result = generator.generate(prompt, sampling, prediction=prediction, schedule="ungated")  # every draft sent
        assert result.token_ids == expected
        record = result.stats.prediction
        assert record.prediction_tokens == len(prediction)
        assert record.accepted_prediction_tokens + record.rejected_prediction_tokens == len(prediction)
        assert result.stats.num_speculative_tokens == PREDICTION_DEFAULT_K
        if kind == "unrelated":  # nothing drafted from it: the very passes of the request without one
            without = generator.generate(prompt, sampling, schedule="ungated")
            assert record.prediction_steps == 0
            assert result.stats.target_pass_widths == without.stats.target_pass_widths
        accepted.append(record.accepted_prediction_tokens / (N - 1))
        rates.append(result.stats.acceptance_rate)
    share = sum(accepted) / len(accepted)  # of the tokens after the prefill's first (the rest: bonus tokens)
    if kind == "same":
        assert rates == [1.0, 1.0] and share > 0.9, (rates, share)
    elif kind == "edited":
        assert 0.6 < share < 0.97, share
    else:
        assert share == 0.0


def test_prediction_is_refused_with_trees_and_ignored_without_speculation(tiny_target) -> None:
    generator = SpeculativeGenerator(tiny_target, proposer=PromptLookupProposer())
    expected = target_only_greedy(tiny_target, PROMPTS[0], 16)
    plain = generator.generate(PROMPTS[0], SamplingParams(max_new_tokens=16), speculative=False, prediction=expected)
    assert plain.token_ids == expected
    assert plain.stats.prediction.accepted_prediction_tokens == 0
    assert plain.stats.prediction.rejected_prediction_tokens == 16
    with pytest.raises(ValueError, match="chains only"):
        generator.generate(PROMPTS[0], SamplingParams(max_new_tokens=4), tree="tree8", prediction=expected)
    with pytest.raises(ValueError, match="prediction must be a string or a list of token ids"):
        generator.generate(PROMPTS[0], prediction=3.5)  # type: ignore[arg-type]


def test_string_prediction_and_record_in_to_dict(chat_models, tiny_tokenizer) -> None:
    generator = SpeculativeGenerator(chat_models[0], tokenizer=tiny_tokenizer, proposer=PromptLookupProposer())
    sampling = SamplingParams(max_new_tokens=24)
    plain = generator.generate("def add", sampling, speculative=False)
    assert generator.generate("def add", sampling, prediction=plain.text).token_ids == plain.token_ids
    # every draft sent: the default's gate decides from measured times (a tiny model's are noise)
    result = generator.generate("def add", sampling, prediction=plain.text, schedule="ungated")
    assert result.token_ids == plain.token_ids
    out = result.to_dict()
    # a random model's tokens need not be the text's canonical tokenization: part of them is drafted
    assert out["accepted_prediction_tokens"] >= 6
    assert out["accepted_prediction_tokens"] + out["rejected_prediction_tokens"] == out["prediction_tokens"]


# ---------------------------------------------------------------- sampled distribution
V_SMALL = 12
SAMPLED = SamplingParams(temperature=0.8, top_k=9, top_p=0.95, max_new_tokens=3)


def test_sampled_tokens_follow_the_target() -> None:
    """Temperature 0.8, top-k 9, top-p 0.95, k 2: each of the first three tokens with a prediction
    follows the exact target-only marginal (chi-square p > P_MIN, 1,500 seeded samples; with the
    pooling of stat_checks this detects a shift of about 0.05 in total variation at the likeliest
    tokens). The prediction starts with the two tokens likeliest at position 1 and then holds every
    token followed by them, so every step drafts two tokens (the second from the start, after a
    weak match: :func:`locate`), accepted part of the time (checked): positions 1 and 2 are
    accepted, recovered or bonus tokens."""
    target = make_tiny_model(vocab_size=V_SMALL, seed=5, init=0.3)
    prompt = [3, 1, 4]
    exact = exact_marginals(target, prompt, 3, SAMPLED)
    likely = [int(t) for t in exact[1].argsort(descending=True)[:2]]
    prediction = [*likely, *(t for v in range(V_SMALL) for t in (v, *likely))]
    generator = SpeculativeGenerator(target)
    samples = [
        generator.generate(
            prompt, SamplingParams(**{**SAMPLED.__dict__, "seed": s}), num_speculative_tokens=2, prediction=prediction
        )
        for s in range(1_500)
    ]
    rate = sum(r.stats.accepted_tokens for r in samples) / sum(r.stats.draft_tokens for r in samples)
    assert 0.2 < rate < 0.95, f"the prediction should agree only partly, acceptance {rate:.2f}"
    for pos in range(3):
        tokens = [r.token_ids[pos] for r in samples]
        assert chi_square_p(tokens, exact[pos]) > P_MIN, f"position {pos} differs from the target's"


def test_an_answer_that_opens_with_a_line_of_its_own_starts_the_prediction_after_it() -> None:
    """An answer that opens with a code fence (70, 71, then a newline 6 that recurs further into the
    prediction) continues at the prediction's start, not after the newline's weak match; a match no
    further than the answer's length (a copy with an edit) and any match once something is aligned
    stand."""
    prediction = ids(1, 2, 3, 4, 5, 6, 7, 8)
    fence = ids(70, 71, 6)
    assert locate(prediction, fence, 0, CONFIG) == (0, CONFIG.start_ngram)
    assert locate(prediction, fence, 0, CONFIG, start=False) == (6, 1)
    assert locate(prediction, ids(9, 2, 3), 0, CONFIG) == (3, 2)
    assert locate(prediction, fence, 2, CONFIG) == (6, 1)


def test_the_start_is_tried_once_and_a_copy_going_on_is_one_pass() -> None:
    greedy = SamplingParams()
    proposer = PredictionProposer(ids(1, 2, 3, 4, 5, 6, 7, 8, 9, 10), None, prompt_len=2)
    draft = proposer.propose(torch.tensor([60, 61, 70, 71, 6]), 4, greedy, None)
    assert draft.ids.tolist() == [1, 2, 3, 4] and draft.early_stop
    proposer.observe(VerifyResult(0, ids(80)))  # missed: the answer goes on with 80
    draft = proposer.propose(torch.tensor([60, 61, 70, 71, 6, 80, 6]), 4, greedy, None)
    assert draft.ids.tolist() == [7, 8, 9, 10]  # the start is not tried twice: the weak match stands

    copying = PredictionProposer(ids(1, 2, 3, 4, 5, 6, 7, 8, 9, 10), None, prompt_len=2)
    draft = copying.propose(torch.tensor([60, 61, 1, 2]), 3, greedy, None)
    assert draft.ids.tolist() == [3, 4, 5] and draft.early_stop
    copying.observe(VerifyResult(3, ids(3, 4, 5, 6)))  # all accepted, and the target's own token copies too
    draft = copying.propose(torch.tensor([60, 61, 1, 2, 3, 4, 5, 6]), 3, greedy, None)
    assert draft.ids.tolist() == [7, 8, 9] and not draft.early_stop  # one pass without the early stop
    copying.observe(VerifyResult(1, ids(7, 99)))  # a miss
    draft = copying.propose(torch.tensor([60, 61, 1, 2, 3, 4, 5, 6, 7, 99, 8]), 3, greedy, None)
    assert draft.ids.tolist() == [9, 10] and draft.early_stop

    off = PredictionProposer(ids(1, 2, 3, 4, 5, 6), None, 2, PredictionConfig(whole_after_copy=False))
    off.propose(torch.tensor([60, 61, 1]), 2, greedy, None)
    off.observe(VerifyResult(2, ids(2, 3, 4)))
    assert off.propose(torch.tensor([60, 61, 1, 2, 3, 4]), 2, greedy, None).early_stop


def test_after_two_misses_the_fallback_drafts_until_the_answer_follows_the_prediction_again() -> None:
    """Two prediction drafts rejected at their first token: the next steps draft with the fallback
    even where the prediction has a match; after a strong match (3+ tokens) the prediction's next
    token (6) is checked against the step's first decoded token, and once it agrees the prediction
    drafts again; a weak match's next token is not checked (an unrelated prediction's common tokens
    would reopen it)."""
    greedy = SamplingParams()
    prompt = [9, 8, 7, 9]
    for decoded, resumes in ((6, True), (1, False)):
        proposer = PredictionProposer(ids(1, 2, 3, 4, 5, 6, 7, 8), PromptLookupProposer(), prompt_len=len(prompt))
        assert proposer.propose(torch.tensor(prompt), 3, greedy, None).ids.tolist() == [1, 2, 3]
        proposer.observe(VerifyResult(0, ids(3)))  # miss 1
        assert proposer.propose(torch.tensor([*prompt, 3]), 3, greedy, None).ids.tolist() == [1, 2, 3]  # the start
        proposer.observe(VerifyResult(0, ids(4)))  # miss 2
        draft = proposer.propose(torch.tensor([*prompt, 3, 4]), 3, greedy, None)  # the prediction has (4, 2): weak
        assert draft.evidence is None or draft.evidence[0] != "prediction"
        proposer.observe(VerifyResult(0, ids(5)))  # 5: the prediction's next token, but after a weak match
        draft = proposer.propose(torch.tensor([*prompt, 3, 4, 5]), 3, greedy, None)  # (5, 3): strong, checked
        assert draft.evidence is None or draft.evidence[0] != "prediction"
        assert proposer.record.fallback_steps == 2
        proposer.observe(VerifyResult(0, ids(decoded)))
        draft = proposer.propose(torch.tensor([*prompt, 3, 4, 5, decoded]), 3, greedy, None)
        assert (draft.evidence is not None and draft.evidence[0] == "prediction") == resumes
        if resumes:
            assert draft.ids.tolist() == [7, 8]
    withheld = PredictionProposer(ids(1, 2, 3, 4, 5, 6, 7, 8), None, prompt_len=len(prompt))
    for step in range(3):  # the draft gate kept the draft back (nothing verified), yet the answer copies it
        assert withheld.propose(torch.tensor([*prompt, *range(1, step + 1)]), 3, greedy, None).ids.tolist()
        withheld.observe(VerifyResult(0, ids(step + 1)))
    assert withheld._misses == 0
    with pytest.raises(ValueError, match="max_misses"):
        PredictionConfig(max_misses=0)
