"""Does a draft share the target's vocabulary, and which proposer drafts with it: the one rule.

A draft model that shares the target's vocabulary (the same embedding rows and a tokenizer that maps
text to the same ids) drafts target ids directly (``draft_model``); one with another vocabulary
drafts only through ``cross_tokenizer``, which re-tokenises its text. ``SpeculativeGenerator``
(``from_pretrained`` and the constructor), ``specdecode serve`` and the server's
``build_app`` and scheduler all ask :func:`draft_proposer` / :func:`check_shared_vocabulary`.

Models are given either as model folders (``config.json`` and tokenizer files are read, no weights:
the answer is known before anything loads) or as loaded models (their embedding rows; and, when
both were loaded from folders, the same folder check, so that both forms agree). Proposer objects
and runners count by their ``vocab_size``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from specdecode.errors import IncompatibleModelsError
from specdecode.proposers.cross_tokenizer import vocabularies_differ

CROSS_TOKENIZER = "cross_tokenizer"  # the proposer that takes a draft of any vocabulary
SWITCHES = {"draft_model": CROSS_TOKENIZER}  # asked for -> what a draft of another vocabulary runs instead


def vocab_size_of(model: Any) -> int | None:
    """Rows of a loaded model's output embedding, else its (a runner's, a proposer's) ``vocab_size``;
    None if it has neither."""
    embeddings = getattr(model, "get_output_embeddings", None)
    head = embeddings() if callable(embeddings) else None
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    size = getattr(model, "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def _folder(model: Any) -> Path | None:
    """The model folder ``model`` was loaded from (``name_or_path``), if it is one on disk."""
    path = str(getattr(model, "name_or_path", "") or "")
    return Path(path) if path and (Path(path) / "config.json").is_file() else None


@functools.lru_cache(maxsize=16)
def _folders_differ(target_dir: str, draft_dir: str) -> bool:
    return vocabularies_differ(Path(target_dir), Path(draft_dir))


def shares_vocabulary(target: Any, draft: Any) -> bool:
    """True if ``draft`` drafts in ``target``'s token ids.

    Args:
        target, draft: two model folders (``str`` / ``Path``: :func:`.cross_tokenizer.vocabularies_differ`,
            no weights read), or loaded models / runners / proposers (sizes as :func:`vocab_size_of`;
            two models loaded from folders are also compared as folders). A size that is unknown
            (None) does not count as a difference.
    """
    if isinstance(target, (str, Path)) and isinstance(draft, (str, Path)):
        return not vocabularies_differ(Path(target), Path(draft))
    sizes = vocab_size_of(target), vocab_size_of(draft)
    if None not in sizes and sizes[0] != sizes[1]:
        return False
    folders = _folder(target), _folder(draft)
    if folders[0] is not None and folders[1] is not None and folders[0] != folders[1]:
        return not _folders_differ(str(folders[0]), str(folders[1]))
    return True


def _mismatch(target: Any, draft: Any, proposer: str = "draft_model") -> IncompatibleModelsError:
    sizes = vocab_size_of(target), vocab_size_of(draft)
    what = (
        f"draft vocabulary size {sizes[1]} differs from the target's {sizes[0]}"
        if None not in sizes and sizes[0] != sizes[1]
        else "the draft's tokenizer maps text to other ids than the target's"
    )
    return IncompatibleModelsError(
        f"{what}; proposer {proposer!r} needs a draft that shares the target's tokenizer (for a draft with "
        f"another tokenizer use proposer '{CROSS_TOKENIZER}' / CrossTokenizerProposer, which from_pretrained "
        "and specdecode serve pick by themselves)"
    )


def check_shared_vocabulary(target: Any, draft: Any) -> None:
    """Raises :class:`IncompatibleModelsError` unless ``draft`` shares ``target``'s vocabulary
    (:func:`shares_vocabulary`); the message names both sizes and the way out (``cross_tokenizer``)."""
    if not shares_vocabulary(target, draft):
        raise _mismatch(target, draft)


def draft_proposer(proposer: str | None, target: Any, draft: Any, announce: str | None = None) -> str | None:
    """The proposer that runs when ``proposer`` is asked for with this target and draft.

    - no proposer, no draft, or a proposer that needs no draft model: ``proposer`` itself;
    - ``cross_tokenizer``: ``proposer`` itself (any draft);
    - a draft that shares the target's vocabulary (:func:`shares_vocabulary`): ``proposer`` itself;
    - ``draft_model`` with a draft of another vocabulary: ``"cross_tokenizer"``.

    Args:
        proposer: a registered proposer name, or None.
        target, draft: model folders or loaded models (see :func:`shares_vocabulary`); ``draft``
            may be None.
        announce: when given and the proposer changes, a notice ``"{announce}: the draft has another
            vocabulary; using --proposer cross_tokenizer"`` goes to stderr.

    Raises:
        ValueError: an unknown proposer name.
        IncompatibleModelsError: another proposer that needs a draft model, with a draft of another
            vocabulary.
    """
    from specdecode.proposers import get_spec

    if proposer is None or draft is None or proposer == CROSS_TOKENIZER or not get_spec(proposer).needs_draft:
        return proposer
    if shares_vocabulary(target, draft):
        return proposer
    if proposer not in SWITCHES:
        raise _mismatch(target, draft, proposer)
    if announce:
        import sys

        print(f"{announce}: the draft has another vocabulary; using --proposer {SWITCHES[proposer]}", file=sys.stderr)
    return SWITCHES[proposer]
