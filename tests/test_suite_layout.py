"""The test run's own layout: every test file that loads the real default models is one that
``scripts/test.sh``'s workers keep together (``conftest.REAL_MODEL_FILES``), so a new one cannot end up
running beside another in the second worker (two sets of models in memory, two llama.cpp thread
pools on two cores)."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import FIRST_FILES, REAL_MODEL_FILES

TESTS = Path(__file__).resolve().parent
LOADS_REAL_MODELS = re.compile(
    r"load_default_gguf|real_pair|real_bf16_pair|require_default_gguf|require_default_pair|from_pretrained\(\)"
    r"|target_gguf\(None\)"  # the build's smoke test on the default target (a llama.cpp child)
)


def test_every_file_that_loads_the_real_models_runs_in_the_real_models_worker() -> None:
    loading = {p.name for p in TESTS.glob("test_*.py") if LOADS_REAL_MODELS.search(p.read_text(encoding="utf-8"))}
    loading.discard(Path(__file__).name)
    assert loading, "no test file loads the real models: the pattern is stale"
    assert loading <= REAL_MODEL_FILES, f"add to conftest.REAL_MODEL_FILES: {sorted(loading - REAL_MODEL_FILES)}"
    missing = {name for name in REAL_MODEL_FILES if not (TESTS / name).exists()}
    assert not missing, f"conftest.REAL_MODEL_FILES names files that are gone: {sorted(missing)}"


def test_the_files_run_first_exist_and_share_a_module_fixture() -> None:
    """``conftest.FIRST_FILES``: each names a file that is there and has a module-scoped fixture
    (what keeping its tests together saves), and none is a real-model file (those keep their order)."""
    for name in FIRST_FILES:
        text = (TESTS / name).read_text(encoding="utf-8")
        assert '@pytest.fixture(scope="module")' in text, f"{name} has no module fixture to share"
    assert not FIRST_FILES & REAL_MODEL_FILES
