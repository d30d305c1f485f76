"""The product and the lab beside it (docs/design.md §3): the wheel holds ``src/specdecode`` only, no
file of ``lab/``; ``scripts/`` holds the product's set-up, test and demo only.

The wheel is built as a user's ``pip install .`` builds it (setuptools, no network), from a copy of
the checkout with ``lab/`` in it, so that nothing is written into the checkout itself.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_SCRIPTS = {"setup.sh", "test.sh", "demo.sh"}
NOT_COPIED = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                    ".ruff_cache", "bench-results", ".gpu", ".gpu-parts", ".whl", ".gl")  # fmt: skip


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> dict[str, bytes]:
    """Every file of the wheel built from the checkout: path inside the wheel -> bytes."""
    pytest.importorskip("setuptools")
    assert (ROOT / "lab").is_dir(), "the checkout has no lab/: nothing to check against"
    tmp = tmp_path_factory.mktemp("wheel")
    tree = tmp / "checkout"
    shutil.copytree(ROOT, tree, ignore=NOT_COPIED)
    args = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
            "--disable-pip-version-check", "-w", str(tmp / "out"), str(tree)]  # fmt: skip
    built = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-4000:]
    (wheel,) = (tmp / "out").glob("specdecode-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return {name: archive.read(name) for name in archive.namelist() if not name.endswith("/")}


def test_the_wheel_holds_the_package_only(wheel_files):
    tops = {name.split("/")[0] for name in wheel_files}
    metadata = {top for top in tops if top.startswith("specdecode-") and top.endswith(".dist-info")}
    assert tops - metadata == {"specdecode"}, tops
    assert not [name for name in wheel_files if name.startswith("lab/") or "/lab/" in name]


def test_no_lab_file_is_in_the_wheel(wheel_files):
    """No file of ``lab/`` (scripts, the GPU check, tests, notes, raw records) travels in the wheel,
    under any name: compared by content."""
    in_wheel = {_digest(data): name for name, data in wheel_files.items() if data}
    lab_files = [path for path in (ROOT / "lab").rglob("*") if path.is_file() and path.stat().st_size]
    assert lab_files
    leaked = {str(path.relative_to(ROOT)): in_wheel[digest] for path in lab_files
              if (digest := _digest(path.read_bytes())) in in_wheel}  # fmt: skip
    assert not leaked, leaked


def test_the_package_is_found_under_src_only():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["tool"]["setuptools"]["packages"]["find"]["where"] == ["src"]
    assert config["tool"]["pytest"]["ini_options"]["testpaths"] == ["tests"]  # lab/tests runs only when asked


def test_scripts_are_the_products_own():
    """``scripts/`` is the README's set-up, test and demo; experiments live in ``lab/``."""
    assert {path.name for path in (ROOT / "scripts").iterdir()} == PRODUCT_SCRIPTS
