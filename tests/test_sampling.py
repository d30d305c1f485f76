"""SamplingParams validation and the logits -> probabilities transform."""

from __future__ import annotations

import pytest
import torch

from specdecode.sampling import SamplingParams, logits_to_probs


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 10**9}, "max_new_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string() -> None:
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)


def test_temperature_top_k_top_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    torch.testing.assert_close(
        logits_to_probs(logits, SamplingParams(temperature=1.0)), torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    )
    top2 = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(top2, torch.tensor([5 / 7, 2 / 7, 0.0, 0.0, 0.0]))
    # top_p = 0.8: 0.5 + 0.2 = 0.7 < 0.8, so the third token (mass before it 0.7) stays; the fourth goes
    nucleus = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(nucleus, torch.tensor([0.5, 0.2, 0.15, 0.0, 0.0]) / 0.85)
    # the top token always survives
    assert logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.01))[0] == 1.0
    hot = logits_to_probs(logits, SamplingParams(temperature=2.0))
    torch.testing.assert_close(hot, torch.softmax(logits / 2.0, -1))


def test_greedy_has_no_probabilities() -> None:
    with pytest.raises(ValueError, match="greedy"):
        logits_to_probs(torch.zeros(3), SamplingParams())
