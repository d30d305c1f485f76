"""SamplingParams validation and the logits -> probabilities transform."""

from __future__ import annotations

import pytest
import torch

from specdecode.sampling import SamplingParams, argmax_ids, argmax_on_device, logits_to_probs


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


def test_argmax_ids_is_torch_argmax() -> None:
    """numpy's argmax on the CPU takes torch's rule: the first index of the maximum, a NaN first."""
    g = torch.Generator().manual_seed(0)
    nan, inf = float("nan"), float("inf")
    rows = [
        torch.randint(0, 8, (3, 5000), generator=g).float(),  # many ties
        torch.tensor([[1.0, nan, 3.0, nan], [nan, 5.0, nan, 0.0], [-inf, -inf, -inf, -inf], [inf, 1.0, inf, 0.0]]),
        torch.tensor([[-0.0, 0.0], [0.0, -0.0]]),
        torch.randn(2, 7, 11, generator=g, dtype=torch.float64),
        torch.randn(9, generator=g),  # one row: a 0-d result
        torch.randn(2, 9, generator=g).to(torch.bfloat16),  # torch's own argmax
        torch.randn(4, 9, generator=g)[:, ::2],  # not contiguous
    ]
    for logits in rows:
        got = argmax_ids(logits)
        assert got.dtype == torch.int64 and got.device.type == "cpu"
        assert torch.equal(got, logits.argmax(dim=-1)), logits
    grad = torch.randn(2, 9, generator=g, requires_grad=True)
    assert torch.equal(argmax_ids(grad), grad.argmax(dim=-1))


def test_argmax_on_device_keeps_the_device() -> None:
    """argmax_on_device: argmax_ids' ids on the CPU; elsewhere torch's argmax, left on that device."""
    g = torch.Generator().manual_seed(1)
    nan = float("nan")
    for logits in (
        torch.randint(0, 4, (6, 300), generator=g).float(),  # ties
        torch.tensor([[0.0, nan, 2.0, nan], [3.0, 3.0, 1.0, 0.0]]),
        torch.randn(50, generator=g),
    ):
        got = argmax_on_device(logits)
        assert got.dtype == torch.int64 and got.device.type == "cpu"
        assert torch.equal(got, logits.argmax(dim=-1))
    meta = torch.empty(3, 7, device="meta")  # stands for a GPU: no host copy, the result stays there
    out = argmax_on_device(meta)
    assert out.device.type == "meta" and out.shape == (3,) and out.dtype == torch.int64


def _reference_outside_nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p by a full sort of each row (the definition; what logits_to_probs did before)."""
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    sorted_p = torch.softmax(sorted_x, dim=-1)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    return torch.zeros_like(sorted_x, dtype=torch.bool).scatter(-1, order, mass_before >= top_p)


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # flat rows (large nuclei, the window grows) to peaked ones
def test_the_windowed_nucleus_drops_what_a_full_sort_drops(scale: float) -> None:
    from specdecode.sampling import _outside_nucleus

    g = torch.Generator().manual_seed(int(scale * 10))
    for V in (5, 300, 5000):
        for top_p in (0.05, 0.5, 0.9, 0.99, 0.999):
            x = torch.randn(3, V, generator=g) * scale
            x[1, : V // 3] = float("-inf")  # as after top-k
            got, want = _outside_nucleus(x, top_p), _reference_outside_nucleus(x, top_p)
            assert torch.equal(got, want), (V, top_p, int((got != want).sum()))
            assert not got.gather(-1, x.argmax(-1, keepdim=True)).any()  # the top token always stays
