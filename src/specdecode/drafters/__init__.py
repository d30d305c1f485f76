"""Trained drafters (Medusa heads, an EAGLE-style head) and their training (``specdecode train-drafter``).

- :mod:`~specdecode.drafters.heads`: the drafters' modules, their config and files;
- this package: where a target's drafter is saved and found (the user's own, or a shipped one);
- training: :mod:`~specdecode.drafters.corpus` (the training text),
  :mod:`~specdecode.drafters.features` (the target's features and predictions, in shards),
  :mod:`~specdecode.drafters.losses`, :mod:`~specdecode.drafters.validation` (agreement with the
  target on held-out sequences) and :mod:`~specdecode.drafters.train` (the loop, checkpoints, the
  report).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.drafters.heads import (
    KINDS,
    DrafterConfig,
    EagleHead,
    MedusaHeads,
    build_drafter,
    check_target,
    load_drafter,
    save_drafter,
    target_identity,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def target_name(target: PreTrainedModel | str | Path) -> str:
    """A file-name-safe name of a target: the last component of its folder (``name_or_path``), or of
    the given string / path; characters other than letters, digits, ``.``, ``_`` and ``-`` become
    ``-``. A model without a name (built in memory) is named after its :func:`target_identity`
    config hash (``target-<hash>``)."""
    if isinstance(target, str | Path):
        name = str(target)
    else:
        name = str(getattr(target.config, "_name_or_path", "") or getattr(target, "name_or_path", "") or "")
    last = Path(name.rstrip("/\\")).name if name else ""
    clean = re.sub(r"[^A-Za-z0-9._-]+", "-", last).strip("-.")
    if clean:
        return clean
    if isinstance(target, str | Path):
        raise ValueError(f"target name must not be empty, got {str(target)!r}")
    return f"target-{target_identity(target)['config_hash']}"


def default_drafter_dir(kind: str, target: PreTrainedModel | str | Path) -> Path:
    """Where ``specdecode train-drafter --kind KIND`` saves the drafter of ``target`` by default, and
    where the ``medusa`` / ``eagle`` proposers look for it without ``--drafter``:
    ``<cache dir>/drafters/<kind>-<target name>`` (:func:`specdecode.models.default.cache_dir`,
    :func:`target_name`). Nothing is created.

    Raises:
        ValueError: ``kind`` is not one of :data:`KINDS`.
    """
    from specdecode.models.default import cache_dir

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    return cache_dir() / "drafters" / f"{kind}-{target_name(target)}"


def shipped_drafters_root() -> Path:
    """The folder of the drafters that ship with specdecode (``specdecode/data/drafters``): the ones
    the project trained for its default target (docs/training.md)."""
    return Path(__file__).resolve().parent.parent / "data" / "drafters"


def shipped_drafter_dir(kind: str, target: PreTrainedModel | str | Path) -> Path:
    """Where a drafter of ``kind`` for ``target`` that ships with specdecode would be:
    ``<shipped_drafters_root()>/<kind>-<target name>``. Nothing is created; the folder may not exist.

    Raises:
        ValueError: ``kind`` is not one of :data:`KINDS`.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    return shipped_drafters_root() / f"{kind}-{target_name(target)}"


def find_drafter_dir(kind: str, target: PreTrainedModel | str | Path) -> Path:
    """The drafter folder that ``--proposer KIND`` uses without ``--drafter``: the user's own
    (:func:`default_drafter_dir`, written by ``specdecode train-drafter``) when it holds a drafter,
    else the shipped one (:func:`shipped_drafter_dir`) when there is one, else (``target`` a
    loaded model) a shipped drafter of ``kind`` whose ``drafter.json`` names the target's config
    and weights hashes (:func:`check_target` passes: the same weights loaded from another folder
    or file), else :func:`default_drafter_dir` (which then holds none: the proposers say how to
    train one).

    A folder found by the target's name is still checked on load against the target's identity
    (hidden size, vocabulary, config and weights hashes), so a same-named other model is a clear
    :class:`~specdecode.errors.IncompatibleModelsError`, never a silent mismatch.

    Raises:
        ValueError: ``kind`` is not one of :data:`KINDS`.
    """
    from specdecode.drafters.heads import CONFIG_FILE, WEIGHTS_FILE, read_drafter_config
    from specdecode.errors import IncompatibleModelsError

    def holds(folder: Path) -> bool:
        return (folder / CONFIG_FILE).is_file() and (folder / WEIGHTS_FILE).is_file()

    own = default_drafter_dir(kind, target)
    if holds(own):
        return own
    shipped = shipped_drafter_dir(kind, target)
    if holds(shipped):
        return shipped
    from transformers import PreTrainedModel  # here: only this search needs the class (and its model code)

    if isinstance(target, PreTrainedModel):  # the same weights under another name: the load-time identity check
        for folder in sorted(shipped_drafters_root().glob(f"{kind}-*")):
            if holds(folder):
                try:
                    check_target(read_drafter_config(folder), target)
                except (ValueError, IncompatibleModelsError):
                    continue
                return folder
    return own


__all__ = [
    "KINDS",
    "DrafterConfig",
    "EagleHead",
    "MedusaHeads",
    "build_drafter",
    "check_target",
    "default_drafter_dir",
    "find_drafter_dir",
    "load_drafter",
    "save_drafter",
    "shipped_drafter_dir",
    "shipped_drafters_root",
    "target_identity",
    "target_name",
]
