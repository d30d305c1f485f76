"""The lab's tests use the product's test fixtures: tests/conftest.py's tiny models and tokenizer, and
its autouse fixtures (one torch thread, the server's cost cache in a temporary folder).

Run them explicitly, ``pytest lab/tests``; the default ``pytest`` run collects ``tests/`` only
(pyproject's ``testpaths``), so they are not part of the product's suite.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PRODUCT_CONFTEST = Path(__file__).resolve().parents[2] / "tests" / "conftest.py"
_spec = importlib.util.spec_from_file_location("specdecode_tests_conftest", _PRODUCT_CONFTEST)
_module = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _module
_spec.loader.exec_module(_module)
globals().update({name: value for name, value in vars(_module).items() if not name.startswith("_")})
