"""lab/gpu/gpu_check.py's fit of the host's work per decoding step (a cost table's ``step_ms``): the
target alone's measured time minus its passes' price, over its steps, checked on the other methods."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from specdecode.cost.table import parse_cost_table, price

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_steps_under_test", ROOT / "lab" / "gpu" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_step_fit_closes_the_gap_on_the_methods_it_did_not_see(gpu_check):
    # 381 one-token steps at 4.33 ms priced 1.743 s and took 1.908 s: 0.433 ms of host work a step
    methods = {
        "specdecode_target_graphs": {"seconds": 1.908, "predicted_s": 1.743, "decode_steps": 381},
        "specdecode_prompt_lookup_graphs": {"seconds": 1.972, "predicted_s": 1.739, "decode_steps": 350},
        "specdecode_draft_model_graphs": {"seconds": 6.585, "predicted_s": 6.43, "decode_steps": 381},
        "hf_generate": {"seconds": 16.0},  # no price: left alone
    }
    step = gpu_check.fit_step_ms(methods, "specdecode_target_graphs")
    assert step == pytest.approx((1.908 - 1.743) * 1000 / 381, abs=1e-4)
    assert methods["specdecode_target_graphs"]["step_ms"] == step
    lookup = methods["specdecode_prompt_lookup_graphs"]
    assert lookup["predicted_with_steps_s"] == pytest.approx(1.739 + 350 * step / 1000, abs=1e-3)
    assert lookup["measured_over_predicted_with_steps"] == pytest.approx(1.972 / lookup["predicted_with_steps_s"],
                                                                          abs=1e-3)  # fmt: skip
    assert abs(methods["specdecode_draft_model_graphs"]["measured_over_predicted_with_steps"] - 1) < 0.01
    assert "predicted_with_steps_s" not in methods["hf_generate"]


def test_step_fit_agrees_with_the_cost_tables_pricing(gpu_check):
    """A table given the fitted ``step_ms`` prices the target alone's passes at its measured time."""
    curve = {"1": 4.0, "256": 30.0}
    passes = [[256] + [1] * 127 for _ in range(3)]  # three prompts: a prefill, then 127 steps each
    passes_price = sum(parse_cost_table({"device": "x", "target": curve}).target(w) for p in passes for w in p) / 1000
    methods = {"t": {"seconds": passes_price + 0.2, "predicted_s": passes_price, "decode_steps": 381}}
    step = gpu_check.fit_step_ms(methods, "t")
    table = parse_cost_table({"device": "x", "target": curve, "step_ms": step})
    priced = sum(price({"passes": {"target": p, "draft": []}}, table) for p in passes)
    assert priced == pytest.approx(passes_price + 0.2, abs=1e-4)


def test_no_fit_without_a_priced_baseline_and_never_negative(gpu_check):
    assert gpu_check.fit_step_ms({"t": {"seconds": 1.0}}, "t") is None
    assert gpu_check.fit_step_ms({}, "t") is None
    faster = {"t": {"seconds": 1.0, "predicted_s": 1.1, "decode_steps": 10}, "m": {"seconds": 1, "predicted_s": 1,
                                                                                    "decode_steps": 5}}  # fmt: skip
    assert gpu_check.fit_step_ms(faster, "t") == 0.0 and faster["m"]["measured_over_predicted_with_steps"] == 1.0


def test_a_plain_decoding_is_priced_as_one_prefill_then_one_token_passes(gpu_check):
    entry = {"seconds": 1.2, "new_tokens": 256}
    gpu_check.price_plain(entry, {"1": 4.0, "9": 6.0, "256": 40.0}, prompts=2, prompt_len=256)
    assert entry["decode_steps"] == 254 and entry["predicted_s"] == pytest.approx((2 * 40 + 254 * 4) / 1000, abs=1e-3)
    assert entry["measured_over_predicted"] == pytest.approx(1.2 / entry["predicted_s"], abs=1e-3)
    failed, unpriced = {"error": "boom"}, {"seconds": 1.0, "new_tokens": 8}
    gpu_check.price_plain(failed, {"1": 4.0, "256": 40.0}, 2, 256)
    gpu_check.price_plain(unpriced, {"1": 4.0}, 2, 256)  # no prefill width measured
    assert failed == {"error": "boom"} and "predicted_s" not in unpriced
