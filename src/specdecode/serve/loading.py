"""Load the models a server serves: the one load path (:mod:`specdecode.load`) planned for the server.

``specdecode serve`` and each replica on Ray Serve (:mod:`specdecode.serve.replicas`) load through
:func:`specdecode.load.plan_models` with ``server=True`` and :func:`specdecode.load.load_models`;
this module keeps the names they used to import from here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specdecode.load import LoadedModels, ModelSource, load_models, plan_models

__all__ = ["LoadedModels", "ModelSource", "load_server_models"]


def load_server_models(
    source: ModelSource, proposer: str | None, announce: str = "specdecode serve", **options: Any
) -> LoadedModels:
    """Plan (``server=True``) and load ``source`` with the default proposer ``proposer`` (a name,
    ``"auto"`` or None) and its ``options``.

    Raises:
        ValueError, ModelNotFoundError, IncompatibleModelsError: see :func:`specdecode.load.plan_models`
            and :func:`specdecode.load.load_models`.
    """
    plan = plan_models(**dataclasses.asdict(source), proposer=proposer, server=True, announce=announce, **options)
    return load_models(plan)
