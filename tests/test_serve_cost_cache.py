"""The server's start-up cost model as data: :meth:`CostModel.from_dict` reads back what
:meth:`CostModel.to_dict` wrote (through JSON), checked field by field."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from specdecode.serve.cost import CostModel


def random_cost(seed: int) -> CostModel:
    rng = random.Random(seed)
    batch_sizes = sorted(rng.sample(range(1, 65), 4))
    tokens = sorted(rng.sample(range(1, 17), 3))
    return CostModel(
        batch_sizes,
        tokens,
        [[rng.uniform(1e-3, 1.0) for _ in tokens] for _ in batch_sizes],
        draft_s_per_token={"draft_model": rng.uniform(0, 0.1), "prompt_lookup": rng.uniform(0, 1e-4)},
        scale=[rng.uniform(0.5, 2.0) for _ in batch_sizes],
        catchup_s_per_token={"draft_model": rng.uniform(0, 0.01)},
    )


# ------------------------------------------------------------------------------ CostModel.from_dict
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_cost_model_round_trips_through_json(seed: int) -> None:
    cost = random_cost(seed)
    back = CostModel.from_dict(json.loads(json.dumps(cost.to_dict())))
    assert back == cost
    for b in (1, 3, 64):
        for t in (1, 5, 16):
            assert back.target_time(b, t) == cost.target_time(b, t)
    assert CostModel.from_dict({k: cost.to_dict()[k] for k in ("batch_sizes", "tokens", "target_s")}).scale == [
        1.0
    ] * len(cost.batch_sizes)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d.pop("target_s"), "target_s"),
        (lambda d: d.update(batch_sizes=[2, 1]), "batch_sizes"),
        (lambda d: d.update(batch_sizes=[0, 1]), "batch_sizes"),
        (lambda d: d.update(tokens=[1, True]), "tokens"),
        (lambda d: d.update(tokens=[]), "tokens"),
        (lambda d: d.update(target_s=[[0.1, 0.2]]), "target_s"),
        (lambda d: d.update(target_s=[[0.1, 0.2], [0.3, float("nan")]]), r"target_s\[1\]\[1\]"),
        (lambda d: d.update(target_s=[[0.1, 0.0], [0.3, 0.4]]), r"target_s\[0\]\[1\]"),
        (lambda d: d.update(target_s=[[0.1, "x"], [0.3, 0.4]]), r"target_s\[0\]\[1\]"),
        (lambda d: d.update(scale=[1.0]), "scale"),
        (lambda d: d.update(scale=[1.0, -1.0]), r"scale\[1\]"),
        (lambda d: d.update(draft_s_per_token={"draft_model": -0.1}), "draft_s_per_token"),
        (lambda d: d.update(catchup_s_per_token=[0.1]), "catchup_s_per_token"),
        (lambda d: d.update(colour="red"), "colour"),
    ],
)
def test_from_dict_names_the_bad_field(change: Any, field: str) -> None:
    data = CostModel([1, 2], [1, 3], [[0.1, 0.2], [0.3, 0.4]], {"draft_model": 0.01}).to_dict()
    change(data)
    with pytest.raises(ValueError, match=field):
        CostModel.from_dict(data)
    with pytest.raises(ValueError, match="mapping"):
        CostModel.from_dict([data])
