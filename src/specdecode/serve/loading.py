"""Load the models a server serves, from the flags of ``specdecode serve``.

One function for both ways of serving: ``specdecode serve`` loads in its own process, and each
replica on Ray Serve (:mod:`specdecode.serve.replicas`) loads the same way in its own. Every path
is checked, and the proposer is final, before any weights load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelSource:
    """What to load: the model flags of ``specdecode serve``.

    Attributes:
        target, draft: ``--target`` / ``--draft`` (a folder, a ``.gguf`` file, a packaged model's
            name, or None for the default pair's model).
        dtype: ``--dtype``.
        backend: ``--backend`` (``auto``, ``torch``, ``llamacpp``).
        threads, exact: ``--threads`` and ``--exact`` (llamacpp only).
    """

    target: str | None = None
    draft: str | None = None
    dtype: str = "auto"
    backend: str = "auto"
    threads: int | None = None
    exact: bool = True


@dataclass
class LoadedModels:
    """Loaded models and what loading them decided.

    Attributes:
        target, tokenizer, draft: the models (``draft`` None where the proposer needs none).
        name: the target's name (the API's model id unless ``--served-model-name`` is given).
        proposer: the default proposer that runs: the one asked for, or ``cross_tokenizer`` for a
            ``draft_model`` draft of another vocabulary (torch backend).
    """

    target: Any
    tokenizer: Any
    draft: Any
    name: str
    proposer: str | None


Check = Callable[[str | None, str], None]


def load_server_models(
    source: ModelSource, proposer: str | None, check: Check | None = None, announce: str = "specdecode serve"
) -> LoadedModels:
    """Load the target, its tokenizer and the draft on the backend ``source.backend`` resolves to.

    Args:
        source: the model flags.
        proposer: the default proposer (``--proposer``, ``auto`` already resolved), or None for none.
        check: called as ``check(proposer, name)`` once every path is checked and the proposer is
            final, before any weights load (``specdecode serve`` re-checks its flags there when the
            proposer changed); an exception it raises stops the loading.
        announce: prefix of the notice on stderr when the proposer switches to ``cross_tokenizer``.

    Raises:
        ValueError: a proposer the backend cannot serve (the message names both).
        ModelNotFoundError: a path does not exist or is not a model.
        IncompatibleModelsError: a draft of another vocabulary for a proposer that cannot switch.
    """
    from specdecode.models.backends import resolve_backend

    if resolve_backend(source.backend, source.target, source.dtype) == "llamacpp":
        return _load_llamacpp(source, proposer, check)
    return _load_torch(source, proposer, check, announce)


def _load_torch(source: ModelSource, proposer: str | None, check: Check | None, announce: str) -> LoadedModels:
    """The torch backend; a draft of another vocabulary switches ``draft_model`` to
    ``cross_tokenizer`` (as ``from_pretrained`` does)."""
    from specdecode.models.default import DEFAULT_TARGET
    from specdecode.models.loading import load_model, load_tokenizer, resolve_model_dir
    from specdecode.proposers import get_spec
    from specdecode.proposers.vocabulary import draft_proposer

    needs_draft = proposer is not None and get_spec(proposer).needs_draft
    target_dir = resolve_model_dir(source.target, "target")
    name = DEFAULT_TARGET.name if source.target is None else target_dir.name
    draft_dir = resolve_model_dir(source.draft, "draft") if needs_draft or source.draft else None
    final = draft_proposer(proposer, target_dir, draft_dir, announce=announce)  # as from_pretrained
    if check is not None:
        check(final, name)
    target = load_model(target_dir, "target", source.dtype, prepack_now=True)  # batched and verified passes
    draft = load_model(draft_dir, "draft", source.dtype) if draft_dir is not None else None
    return LoadedModels(target, load_tokenizer(target_dir), draft, name, final)


def _load_llamacpp(source: ModelSource, proposer: str | None, check: Check | None) -> LoadedModels:
    """The llamacpp backend (GGUF files)."""
    from specdecode.models.backends import gguf_path, load_llamacpp, load_llamacpp_tokenizer
    from specdecode.models.default import DEFAULT_TARGET
    from specdecode.models.llamacpp import LlamaCppOptions
    from specdecode.proposers import get_spec

    spec = get_spec(proposer) if proposer is not None else None
    if spec is not None and "llamacpp" not in spec.backends:
        raise ValueError(
            f"--proposer {proposer}: not available on the llamacpp backend (it runs on "
            f"{', '.join(spec.backends)}); use --backend torch"
        )
    if spec is not None and spec.needs_target_features:  # LlamaCppBatchedRunner.returns_hidden is False
        raise ValueError(
            f"--proposer {proposer}: the llamacpp server's batched runner returns no hidden states, which "
            f"{proposer} reads (specdecode generate runs it on llama.cpp); use --backend torch to serve it"
        )
    options = LlamaCppOptions(threads=source.threads, exact=source.exact)
    target_path = gguf_path(source.target, "target")  # every path checked before any weights load
    needs_draft = spec is not None and spec.needs_draft
    draft_path = gguf_path(source.draft, "draft") if needs_draft or source.draft else None
    name = DEFAULT_TARGET.name if source.target is None else target_path.stem
    if check is not None:
        check(proposer, name)
    target = load_llamacpp(target_path, "target", options)
    draft = load_llamacpp(draft_path, "draft", options) if draft_path is not None else None
    return LoadedModels(target, load_llamacpp_tokenizer(target), draft, name, proposer)
