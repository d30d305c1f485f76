"""Admission: every check a request passes before it may wait for a batch row, in one place.

One :class:`Admission` is built when the server starts, from its settings
(:class:`~specdecode.serve.config.ServeSettings`) and the limits of its models and batched runner:
a sequence's context (``max_length``), the vocabulary, the KV budget, and the proposers this server
can run. Those proposers are found **once**, at start (:func:`available_proposers`: a draft model's
vocabulary compared, trained drafters' folders looked up on disk), never per request; a drafter
trained after the start is offered after a restart.

Both the HTTP layer (``prepare`` in :mod:`specdecode.serve.app`) and
:meth:`Scheduler.submit <specdecode.serve.scheduler.Scheduler.submit>` call :meth:`Admission.admit`;
it stamps the request, so a request the HTTP layer admitted is not checked again at submit, and one
built in code (tests, notebooks) is checked there. Every refusal is an
:class:`~specdecode.serve.request.InvalidRequestError` whose ``param`` names the request field
(the HTTP layer answers 400).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from specdecode.limits import check_num_speculative_tokens
from specdecode.serve.config import ServeSettings
from specdecode.serve.request import InvalidRequestError, ServeRequest


def has_drafter(name: str, settings: ServeSettings, target: Any) -> bool:
    """A trained drafter of kind ``name`` for ``target`` is at hand (files only; loading checks the
    rest): the server's ``drafter`` option when ``name`` is its default proposer, else the target's
    default drafter folder (:func:`~specdecode.drafters.find_drafter_dir`, which may hash the
    target's weights: call it once per server, not per request)."""
    from specdecode.drafters import find_drafter_dir
    from specdecode.proposers.trained_drafters import check_drafter_dir

    options = settings.proposer_options if name == settings.proposer else {}
    try:
        check_drafter_dir(Path(options.get("drafter") or find_drafter_dir(name, target)), name)
    except FileNotFoundError:
        return False
    return True


def drafts_as_itself(name: str, target: Any, draft: Any) -> bool:
    """The loaded ``draft`` can serve proposer ``name`` (another vocabulary: only ``cross_tokenizer``)."""
    from specdecode.errors import IncompatibleModelsError
    from specdecode.proposers.vocabulary import draft_proposer

    try:
        return draft_proposer(name, target, draft) == name
    except IncompatibleModelsError:
        return False


def available_proposers(
    settings: ServeSettings, target: Any, draft: Any, backend: str, returns_hidden: bool
) -> tuple[str, ...]:
    """Names of the proposers a request may ask for, sorted: those of ``backend`` whose models are
    loaded (with a draft of another vocabulary, ``cross_tokenizer`` is its only draft proposer),
    and those that read the target's features (Medusa, EAGLE) when the batched runner returns them
    (``returns_hidden``; llama.cpp's does not) and a trained drafter for the target is found.

    Looks at the draft's vocabulary and the drafters' folders: call it once, at start.
    """
    from specdecode.proposers import PROPOSERS

    return tuple(
        sorted(
            name
            for name, spec in PROPOSERS.items()
            if backend in spec.backends
            and (not spec.needs_draft or (draft is not None and drafts_as_itself(name, target, draft)))
            and (not spec.needs_target_features or (returns_hidden and has_drafter(name, settings, target)))
        )
    )


class Admission:
    """The checks of a server's requests, built once at start.

    Args:
        settings: the server's settings.
        max_length: a sequence's context in tokens (the batched runner's ``max_length``).
        vocab_size: the target's vocabulary (prompt token ids must be below it).
        proposers: the names of the proposers this server runs (:func:`available_proposers`).

    Attributes:
        proposers: as given, sorted (``GET /v1/models`` lists them).

    Raises:
        InvalidRequestError: the server's default proposer cannot run here (``param="proposer"``).
        ValueError / TypeError: its ``proposer_options`` are not options of that proposer.
    """

    def __init__(self, settings: ServeSettings, max_length: int, vocab_size: int, proposers: Iterable[str]) -> None:
        self.settings = settings
        self.max_length = max_length
        self.vocab_size = vocab_size
        self.proposers: tuple[str, ...] = tuple(sorted(proposers))
        if settings.proposer is not None:
            from specdecode.proposers import get_spec

            self.check_proposer(settings.proposer)
            get_spec(settings.proposer).make_config(**settings.proposer_options)  # bad options fail here

    # ------------------------------------------------------------------ one request
    def admit(self, req: ServeRequest) -> ServeRequest:
        """Check ``req`` (once: a request this object admitted already passes unchecked) and stamp it.

        Checks, in order: the proposer (one is configured and runs here), the speculation mode, k
        (``num_speculative_tokens`` in :data:`~specdecode.limits.K_RANGE` when speculative), the
        prompt (not empty, shorter than a sequence's context, ids in the vocabulary), ``max_tokens``
        (prompt + max_tokens within the context), ``logprobs`` (None or 0 .. 20), and the KV
        reservation within the server's budget.

        Returns:
            ``req``, admitted.

        Raises:
            InvalidRequestError: the first check that fails; ``param`` names the request field.
        """
        if req.admitted_by is self:
            return req
        self._check(req)
        req.admitted_by = self
        return req

    def _check(self, req: ServeRequest) -> None:
        if req.speculative:
            if req.proposer is None:
                raise InvalidRequestError("speculative decoding needs a proposer; none is configured", "proposer")
            self.check_proposer(req.proposer)
        self.check_speculation(req.speculation)
        if req.speculative:
            try:
                check_num_speculative_tokens(req.num_speculative_tokens)
            except ValueError as error:
                raise InvalidRequestError(str(error), "num_speculative_tokens") from None
        P = len(req.prompt_ids)
        if P == 0:
            raise InvalidRequestError("the prompt must contain at least one token", "prompt")
        if P >= self.max_length:
            raise InvalidRequestError(
                f"the prompt has {P} tokens; a sequence's context on this server is {self.max_length} tokens", "prompt"
            )
        if P + req.sampling.max_new_tokens > self.max_length:
            raise InvalidRequestError(
                f"the prompt ({P} tokens) plus max_tokens ({req.sampling.max_new_tokens}) exceeds a sequence's "
                f"context of {self.max_length} tokens: lower max_tokens",
                "max_tokens",
            )
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= self.vocab_size:
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        if req.logprobs is not None:
            from specdecode.logprobs import check_num_logprobs

            try:
                check_num_logprobs(req.logprobs, "logprobs")
            except ValueError as error:
                raise InvalidRequestError(str(error), "logprobs") from None
        need = self.reservation(req)
        if need > self.settings.kv_budget_tokens:
            raise InvalidRequestError(
                f"the request needs {need} tokens of KV cache (prompt {P} + max_tokens "
                f"{req.sampling.max_new_tokens} + draft {req.max_k + 1}); the server's budget is "
                f"{self.settings.kv_budget_tokens}: lower max_tokens",
                "max_tokens",
            )

    def check_proposer(self, name: str) -> None:
        """Raises InvalidRequestError(param="proposer") unless ``name`` can run on this server."""
        if name in self.proposers:
            return
        from specdecode.proposers import PROPOSERS

        hint = ""
        if name in PROPOSERS and PROPOSERS[name].needs_target_features:
            hint = f" ({name!r} needs a drafter trained for this target: specdecode train-drafter --kind {name})"
        raise InvalidRequestError(
            f"proposer must be one of {list(self.proposers)} on this server, got {name!r}{hint}", "proposer"
        )

    def check_speculation(self, mode: str | None) -> None:
        """Raises InvalidRequestError(param="speculation") unless a request may ask for ``mode``.

        ``"off"`` and None are always allowed; ``"on"`` and ``"adaptive"`` not on a server started
        with ``--speculation off``; ``"adaptive"`` only on one started with ``--speculation adaptive``
        (the cost model is measured at start-up).
        """
        server = self.settings.speculation
        if mode in (None, "off") or mode == server:
            return
        if mode not in ("on", "adaptive"):
            raise InvalidRequestError(
                f"speculation must be one of 'on', 'off', 'adaptive', got {mode!r}", "speculation"
            )
        if server == "off":
            raise InvalidRequestError(
                f"speculation {mode!r}: this server runs with --speculation off (target alone for every request)",
                "speculation",
            )
        if mode == "adaptive":
            raise InvalidRequestError(
                "speculation 'adaptive' needs the cost model measured at start-up: this server runs with "
                "--speculation on (start it with --speculation adaptive)",
                "speculation",
            )

    def mode(self, req: ServeRequest) -> str:
        """The speculation mode ``req`` decodes with: ``"off"`` when it does not speculate, else its
        own ``speculation`` or the server's ``--speculation``."""
        if not req.speculative or req.speculation == "off":
            return "off"
        return req.speculation or self.settings.speculation

    @staticmethod
    def reservation(req: ServeRequest) -> int:
        """KV-cache tokens ``req`` reserves while it runs: ``prompt + max_tokens + k + 1``."""
        return len(req.prompt_ids) + req.sampling.max_new_tokens + req.max_k + 1
