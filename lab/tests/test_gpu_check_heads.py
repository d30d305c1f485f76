"""lab/gpu/gpu_check.py's drafter-heads stage on the CPU: the shipped drafters' configuration, the
timings' shape and the cost-table fragment (docs/gpu.md)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", ROOT / "lab" / "gpu" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


TINY = {
    "eagle": dict(kind="eagle", hidden_size=32, vocab_size=300, draft_vocab_size=64, num_heads=4,
                  intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=512),
    "medusa": dict(kind="medusa", hidden_size=32, vocab_size=300, draft_vocab_size=64, num_heads=3),
}


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_shipped_config_is_read_and_matches_the_fallback(gpu_check, kind):
    config, source = gpu_check.shipped_drafter_config(kind)
    assert source.endswith("drafter.json"), source
    assert config["kind"] == kind and "target" not in config and "training" not in config
    fallback = gpu_check.SHIPPED_DRAFTER_CONFIGS[kind]
    keys = ["hidden_size", "vocab_size", "draft_vocab_size", "num_heads"]
    if kind == "eagle":
        keys += ["intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"]
    for key in keys:
        assert config[key] == fallback[key], key


def test_fallback_without_drafter_json(gpu_check, monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    config, source = gpu_check.shipped_drafter_config("eagle")
    assert config == gpu_check.SHIPPED_DRAFTER_CONFIGS["eagle"]
    assert "constants" in source


def test_time_drafter_heads_tiny(gpu_check):
    import torch

    from specdecode.models.torch.static_runner import StaticCacheSettings

    saves = []
    res = gpu_check.time_drafter_heads(TINY, torch.device("cpu"), torch.float32, depth=12, reps=1, warmups=1,
                                       widths=(1, 2, 4), embed_rows=100, save=lambda: saves.append(1),
                                       graphs=StaticCacheSettings(stand_in=True))
    assert res["errors"] == {}
    assert set(res["eagle_graphs_chain_ms"]) == set(res["eagle_graphs_step_ms"]) == {"1", "2", "4"}
    assert set(res["medusa_graphs_ms"]) == {"1", "2", "3"}  # k = 1 .. the tiny drafter's 3 heads
    assert res["graphs_failed"] == {"eagle": None, "medusa": None}
    assert res["graphs_captured"] == {"eagle": ["('chain', 1)", "('chain', 2)", "('chain', 4)", "('sync', 1)"],
                                      "medusa": ["1", "2", "3"]}
    assert set(res["eagle_ms"]) == {"1", "2", "4", str(gpu_check.EAGLE_PROMPT_WIDTH)}  # and a prompt's first forward
    assert set(res["eagle_tree_mask_ms"]) == {"2", "4"}
    assert set(res["medusa_ms"]) == {"1"}
    assert res["eagle_cache_entries_after"] == 12  # cut back to the cached pairs after every pass
    assert res["medusa_logits_shape"] == [3, 64]
    assert all(v >= 0 for row in ("eagle_ms", "medusa_ms") for v in res[row].values())
    assert res["cost_table_fragment"] == {"eagle": res["eagle_ms"], "medusa": res["medusa_ms"]}
    assert saves
    from specdecode.cost import table as cost_table

    if "eagle" in getattr(cost_table, "DRAFT_KINDS", ()):  # the table format with the drafters' curves
        table = cost_table.parse_cost_table({"device": "test", "target": {"1": 1.0}, **res["cost_table_fragment"]})
        assert table.eagle is not None and table.medusa is not None


def test_one_drafter_failing_keeps_the_other(gpu_check):
    import torch

    bad = {**TINY, "eagle": {**TINY["eagle"], "draft_vocab_size": 10_000}}  # more than the vocabulary
    res = gpu_check.time_drafter_heads(bad, torch.device("cpu"), torch.float32, depth=4, reps=1, warmups=0,
                                       widths=(1,), embed_rows=100)
    assert "eagle" in res["errors"]
    assert res["cost_table_fragment"] == {"medusa": res["medusa_ms"]}


def test_summary_shows_heads_and_fragments(gpu_check):
    heads = {"status": "ok", "dtype": "bfloat16", "settings": {"reps": 10, "mode": "eager", "cache_entries": 400},
             "drafter_configs": {"medusa": {"num_heads": 4}},
             "eagle_ms": {"1": 0.5, "2": 0.6}, "eagle_tree_mask_ms": {"2": 0.7}, "medusa_ms": {"1": 0.2},
             "eagle_graphs_chain_ms": {"1": 0.1, "2": 0.2}, "medusa_graphs_ms": {"1": 0.05},
             "graphs_failed": {"eagle": None, "medusa": "RuntimeError: no"},
             "cost_table_fragment": {"eagle": {"1": 0.5, "2": 0.6}, "medusa": {"1": 0.2}}}
    llama = {"status": "ok", "cost_table_fragment": {"target": {"1": 2.3}, "draft": {"1": 1.1}}}
    text = gpu_check.summary_markdown({"stages": {"heads": heads, "llamacpp": llama}})
    assert "| EAGLE head + logits (chain step / sync: causal) | 0.500 | 0.600 |" in text
    assert "| Medusa, 4 heads + logits | 0.200 | — |" in text
    assert "| EAGLE graphs: chain of W drafts + host copy (aim: W=4 <= 0.6) | 0.100 | 0.200 |" in text
    assert "| Medusa graphs: W drafts + host copy (aim <= 0.15) | 0.050 | — |" in text
    assert 'not captured (timed eagerly instead): `{"medusa": "RuntimeError: no"}`' in text
    assert json.dumps(heads["cost_table_fragment"]) in text
    assert json.dumps(llama["cost_table_fragment"]) in text
    torch_stage = {"status": "ok", "cost_table_fragment": {"step_ms": 0.43}}  # merged with the heads' fragment
    merged = gpu_check.cost_table_fragments({"torch": torch_stage, "heads": heads, "llamacpp": llama})
    assert merged["h100-torch-graphs-bf16.json"] == {"step_ms": 0.43, **heads["cost_table_fragment"]}
    text = gpu_check.summary_markdown({"stages": {"torch": torch_stage, "heads": heads}})
    assert json.dumps(merged["h100-torch-graphs-bf16.json"]) in text
