"""Assemble a server from model objects, and run one in a background thread (tests, notebooks)."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from specdecode.cost.serve_model import CostModel
from specdecode.proposers.vocabulary import draft_proposer
from specdecode.serve.audit import AuditLog
from specdecode.serve.config import ServeSettings
from specdecode.serve.prometheus import ServeMetrics
from specdecode.serve.scheduler import Scheduler

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def build_app(
    target: PreTrainedModel,
    tokenizer: Any,
    settings: ServeSettings | None = None,
    draft: PreTrainedModel | None = None,
    cost: CostModel | None = None,
    *,
    vocabulary_checked: bool = False,
) -> tuple[FastAPI, Scheduler]:
    """The FastAPI app and its scheduler for loaded models (the scheduler starts with the app).

    Args:
        target: the target causal LM.
        tokenizer: the target's tokenizer.
        settings: :class:`ServeSettings` (defaults if None).
        draft: the draft model, for proposers that need one. One of another vocabulary drafts only
            through ``cross_tokenizer``: a default proposer ``draft_model`` becomes ``cross_tokenizer``
            (a notice on stderr), as in ``specdecode serve`` and ``from_pretrained``.
        cost: a measured cost model (None: measured at start-up in ``adaptive`` mode).
        vocabulary_checked: ``settings.proposer`` is the one :func:`specdecode.load.load_models`
            decided for these models (``specdecode serve``, replicas): the vocabulary rule is not
            asked again.

    Raises:
        IncompatibleModelsError: the default proposer needs a draft of the target's vocabulary and
            cannot switch to ``cross_tokenizer`` (:func:`~specdecode.proposers.vocabulary.draft_proposer`).
        ValueError: bad settings (the message names the flag).
        OSError: the audit log cannot be opened.
    """
    from specdecode.serve.app import create_app

    settings = settings or ServeSettings()
    proposer = settings.proposer
    if not vocabulary_checked:
        proposer = draft_proposer(settings.proposer, target, draft, announce="specdecode serve")
    if proposer != settings.proposer:
        settings = dataclasses.replace(settings, proposer=proposer)
    audit = AuditLog(settings.audit_log, settings.audit_log_prompts) if settings.audit_log else None
    scheduler = Scheduler(target, tokenizer, settings, draft=draft, metrics=ServeMetrics(), audit=audit, cost=cost)
    return create_app(scheduler, settings, tokenizer), scheduler


class BackgroundServer:
    """``uvicorn`` serving ``app`` in a daemon thread on a loopback port; a context manager.

    Args:
        app: the ASGI app.
        host: interface to bind (default loopback).
        port: 0 picks a free port.
        startup_timeout_s: how long to wait for start-up (the cost model is measured then).

    Attributes:
        url: ``http://host:port`` once entered.

    Raises:
        RuntimeError: the server did not start in time.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 120.0) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.startup_timeout_s = startup_timeout_s
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
