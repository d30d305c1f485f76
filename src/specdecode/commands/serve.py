"""``specdecode serve``: the command line of the server.

Example::

    specdecode serve --speculation adaptive --max-batch-size 8 --audit-log audit.jsonl
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "Qwen2.5-Coder-1.5B-Instruct", "prompt": "def add(a, b):", "max_tokens": 32, "temperature": 0}'

Heavy imports (torch, transformers, FastAPI, uvicorn) happen inside the command.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from specdecode.commands.common import (
    PROPOSER_KS,
    add_backend_args,
    add_command_parser,
    add_model_args,
    add_proposer_args,
    backend_options,
    proposer_options,
    resolve_auto_proposer,
)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    s = add_command_parser(
        subparsers,
        "serve",
        "serve an OpenAI-compatible API (batched speculation)",
        "serve an OpenAI-compatible API with batched speculative decoding",
    )
    add_model_args(s)
    add_backend_args(s)
    add_proposer_args(s, auto=True)
    s.add_argument(
        "-k",
        "--num-speculative-tokens",
        type=int,
        default=None,
        metavar="K",
        help=f"default k of requests (default: the proposer's own k: {PROPOSER_KS})",
    )
    s.add_argument(
        "--speculation",
        choices=["on", "off", "adaptive"],
        default="adaptive",
        help="on: always draft k; off: never; adaptive (default): per step, from the cost model measured at start-up",
    )
    s.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument("--served-model-name", metavar="NAME", help="the API's model id (default: the target's folder name)")
    s.add_argument(
        "--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECDECODE_API_KEY)"
    )
    s.add_argument("--audit-log", metavar="PATH", help="append a JSON line per request to PATH (default: none)")
    s.add_argument("--audit-log-prompts", action="store_true", help="also write prompts into the audit log")
    s.add_argument(
        "--max-batch-size", type=int, default=8, metavar="N", help="most sequences decoding together (default 8)"
    )
    s.add_argument(
        "--kv-budget-tokens",
        type=int,
        default=65536,
        metavar="N",
        help="KV-cache tokens reserved at most; llamacpp reserves them at start-up, "
        "split evenly over --max-batch-size rows: a row's most tokens (default 65536)",
    )
    s.add_argument(
        "--max-queue", type=int, default=64, metavar="N", help="most waiting requests; more get HTTP 429 (default 64)"
    )
    s.add_argument(
        "--request-timeout", type=float, default=600.0, metavar="SECONDS", help="seconds per request (default 600)"
    )
    s.add_argument(
        "--max-body-bytes", type=int, default=1 << 20, metavar="N", help="largest request body, bytes (default 1 MiB)"
    )
    s.add_argument(
        "--default-max-tokens",
        type=int,
        default=512,
        metavar="N",
        help="max_tokens of chat requests without one (default 512)",
    )
    s.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="server log level (default info)",
    )
    s.set_defaults(func=cmd_serve)
    return s


def settings_from_args(args: argparse.Namespace, model_name: str) -> Any:
    """:class:`ServeSettings` from the parsed flags (validated: ValueError names the flag)."""
    from specdecode.serve.config import ServeSettings

    return ServeSettings(
        model_name=args.served_model_name or model_name,
        proposer=args.proposer,
        proposer_options=proposer_options(args),
        num_speculative_tokens=args.num_speculative_tokens,
        speculation=args.speculation,
        max_batch_size=args.max_batch_size,
        kv_budget_tokens=args.kv_budget_tokens,
        max_queue=args.max_queue,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        api_key=args.api_key or os.environ.get("SPECDECODE_API_KEY") or None,
        audit_log=args.audit_log,
        audit_log_prompts=args.audit_log_prompts,
        default_max_tokens=args.default_max_tokens,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from specdecode.models.backends import resolve_backend
    from specdecode.models.loading import parse_dtype
    from specdecode.serve.server import build_app

    parse_dtype(args.dtype)
    options = backend_options(args)
    resolve_auto_proposer(args)
    settings_from_args(args, "check")  # every flag checked before any weights load
    if resolve_backend(args.backend, args.target, args.dtype) == "llamacpp":
        target, tokenizer, draft, name = _load_llamacpp(args, options["threads"], options["exact"])
    else:
        target, tokenizer, draft, name = _load_torch(args)
    settings = settings_from_args(args, name)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app, _ = build_app(target, tokenizer, settings, draft=draft)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _load_torch(args: argparse.Namespace) -> tuple[Any, Any, Any, str]:
    """``(target, tokenizer, draft or None, model name)`` on the torch backend; a draft of another
    vocabulary switches ``args.proposer`` to ``cross_tokenizer`` (as ``from_pretrained`` does)."""
    from specdecode.models.default import DEFAULT_TARGET
    from specdecode.models.loading import load_model, load_tokenizer, resolve_model_dir
    from specdecode.proposers import get_spec
    from specdecode.proposers.vocabulary import draft_proposer

    spec = get_spec(args.proposer)
    target_dir = resolve_model_dir(args.target, "target")
    name = DEFAULT_TARGET.name if args.target is None else target_dir.name
    draft_dir = resolve_model_dir(args.draft, "draft") if spec.needs_draft or args.draft else None
    proposer = draft_proposer(args.proposer, target_dir, draft_dir, announce="specdecode serve")  # as from_pretrained
    if proposer != args.proposer:  # a draft of another vocabulary: its options checked before any weights load
        args.proposer = proposer
        settings_from_args(args, name)
    target = load_model(target_dir, "target", args.dtype, prepack_now=True)  # batched and verified passes: many rows
    draft = load_model(draft_dir, "draft", args.dtype) if draft_dir is not None else None
    return target, load_tokenizer(target_dir), draft, name


def _load_llamacpp(args: argparse.Namespace, threads: int | None, exact: bool) -> tuple[Any, Any, Any, str]:
    """``(target, tokenizer, draft or None, model name)`` on the llamacpp backend (GGUF files).

    Raises:
        ValueError: a proposer the backend cannot serve (the message names both).
        ModelNotFoundError: a path is not a ``.gguf`` file or does not exist.
    """
    from specdecode.models.backends import gguf_path, load_llamacpp, load_llamacpp_tokenizer
    from specdecode.models.default import DEFAULT_TARGET
    from specdecode.models.llamacpp import LlamaCppOptions
    from specdecode.proposers import get_spec

    spec = get_spec(args.proposer)
    if "llamacpp" not in spec.backends:
        raise ValueError(
            f"--proposer {args.proposer}: not available on the llamacpp backend (it runs on "
            f"{', '.join(spec.backends)}); use --backend torch"
        )
    options = LlamaCppOptions(threads=threads, exact=exact)
    target_path = gguf_path(args.target, "target")  # every path checked before any weights load
    draft_path = gguf_path(args.draft, "draft") if spec.needs_draft or args.draft else None
    name = DEFAULT_TARGET.name if args.target is None else target_path.stem
    target = load_llamacpp(target_path, "target", options)
    draft = load_llamacpp(draft_path, "draft", options) if draft_path is not None else None
    return target, load_llamacpp_tokenizer(target), draft, name
