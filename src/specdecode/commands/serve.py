"""``specdecode serve``: the command line of the server.

Example::

    specdecode serve --speculation adaptive --max-batch-size 8 --audit-log audit.jsonl
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "Qwen2.5-Coder-1.5B-Instruct", "prompt": "def add(a, b):", "max_tokens": 32, "temperature": 0}'

    specdecode serve --replicas 2 --replica-cpus 1   # two replicas on Ray Serve (pip install 'specdecode[ray]')

Heavy imports (torch, transformers, FastAPI, uvicorn; Ray with ``--replicas``) happen inside the command.
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
    given_proposer_options,
)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    s = add_command_parser(
        subparsers,
        "serve",
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
    s.add_argument(
        "--remeasure-costs",
        action="store_true",
        help="adaptive: measure the cost model even when one measured with the same models, build, grid "
        "and machine is cached ($SPECDECODE_SERVE_COST_CACHE, else serve-cost/ of $SPECDECODE_CACHE or "
        "~/.cache/specdecode); the new one "
        "replaces it (--replicas: every replica, each in its own machine's cache)",
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
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep what finished requests read, so a request that re-sends a history prefills only its "
        "new tokens (llama.cpp; exact in exact mode; default on)",
    )
    s.add_argument(
        "--prefix-cache-scope",
        choices=["global", "user"],
        default="global",
        help="who may reuse a cached prefix: any request, or requests with the same 'user' field "
        "(a shared cache is a timing side channel: docs/serving.md; default global)",
    )
    s.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="run N replicas on Ray Serve behind one endpoint on --host/--port (needs "
        "pip install 'specdecode[ray]'; default: one server, no Ray); see docs/serving.md",
    )
    s.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="with --replicas: join this Ray cluster ('auto': the one 'ray start' runs here; "
        "default: start a local one)",
    )
    s.add_argument(
        "--replica-cpus",
        type=float,
        default=1.0,
        metavar="N",
        help="with --replicas: CPUs Ray reserves per replica (default 1; torch threads follow it)",
    )
    s.add_argument(
        "--replica-gpus",
        type=float,
        default=0.0,
        metavar="N",
        help="with --replicas: GPUs Ray reserves per replica (default 0)",
    )
    s.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="server log level (default info)",
    )
    s.set_defaults(func=cmd_serve)
    return s


def settings_from_args(
    args: argparse.Namespace, model_name: str, proposer: str | None = None, options: dict[str, Any] | None = None
) -> Any:
    """:class:`ServeSettings` from the parsed flags and the default ``proposer`` with its ``options``
    as the load path chose them (:func:`specdecode.load.plan_models`; validated: ValueError names the flag)."""
    from specdecode.serve.config import ServeSettings

    return ServeSettings(
        model_name=args.served_model_name or model_name,
        proposer=proposer,
        proposer_options=options or {},
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
        prefix_cache=args.prefix_cache,
        prefix_cache_scope=args.prefix_cache_scope,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve: plan the load (every flag and path checked, the backend resolved once), load, run."""
    import dataclasses
    import logging

    from specdecode.load import ModelSource, load_models, plan_models

    options = backend_options(args)
    if args.replicas is not None and args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if args.replicas is None and args.ray_address is not None:
        raise ValueError("--ray-address needs --replicas N")
    if args.remeasure_costs and args.speculation != "adaptive":
        raise ValueError(f"--remeasure-costs needs --speculation adaptive (got --speculation {args.speculation})")
    source = ModelSource(
        target=args.target,
        draft=args.draft,
        dtype=args.dtype,
        backend=args.backend,
        threads=options["threads"],
        exact=options["exact"],
        device=args.device,
        cuda_graphs=args.cuda_graphs,
    )
    log_format = "%(asctime)s %(name)s %(levelname)s %(message)s"
    if args.replicas is not None:
        logging.basicConfig(level=args.log_level.upper(), format=log_format)
        return _serve_replicas(args, source)

    import uvicorn

    from specdecode.cost.cache import default_folder
    from specdecode.serve.server import build_app

    settings = settings_from_args(args, "specdecode")  # the server's own flags first
    given = given_proposer_options(args)
    plan = plan_models(
        **dataclasses.asdict(source), proposer=args.proposer, server=True, announce="specdecode serve", **given
    )
    name = args.served_model_name or plan.name  # every flag and path checked before any weights load
    settings = dataclasses.replace(settings, model_name=name, proposer=plan.proposer, proposer_options=plan.options)
    loaded = load_models(plan)
    if loaded.proposer != settings.proposer:  # two GGUF files of other vocabularies: cross_tokenizer
        settings = dataclasses.replace(settings, proposer=loaded.proposer)
    logging.basicConfig(level=args.log_level.upper(), format=log_format)
    app, scheduler = build_app(loaded.target, loaded.tokenizer, settings, draft=loaded.draft, vocabulary_checked=True)
    # before uvicorn's signal handlers: SIGTERM meanwhile stops the process at once
    scheduler.measure_cost_model(cache_folder=default_folder(), remeasure=args.remeasure_costs)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _serve_replicas(args: argparse.Namespace, source: Any) -> int:
    """``--replicas N``: N replicas on Ray Serve behind one endpoint on --host/--port. The proposer
    and its options are chosen here (:func:`specdecode.load.choose`, the flags checked); each replica
    plans and loads ``source`` (a :class:`~specdecode.load.ModelSource`) itself with them, paths
    that exist here made absolute first (a replica checks its paths on its own machine)."""
    import dataclasses

    from specdecode.cost.cache import default_folder
    from specdecode.load import choose
    from specdecode.models.torch.hf_loading import parse_dtype
    from specdecode.serve.replicas import ReplicaConfig, run_replicas

    parse_dtype(args.dtype)
    given = given_proposer_options(args)
    _, proposer, options, _ = choose(
        args.proposer, args.backend, args.target, args.draft, args.dtype, server=True, **given
    )

    def absolute(path: str | None) -> str | None:
        return os.path.abspath(path) if path is not None and os.path.exists(path) else path

    source = dataclasses.replace(source, target=absolute(source.target), draft=absolute(source.draft))
    settings = settings_from_args(args, args.served_model_name or "specdecode", proposer, options)
    if settings.audit_log:
        settings = dataclasses.replace(settings, audit_log=os.path.abspath(settings.audit_log))
    config = ReplicaConfig(
        source=source,
        settings=settings,
        served_model_name=args.served_model_name,
        num_cpus=args.replica_cpus,
        num_gpus=args.replica_gpus,
        cost_cache_folder=str(default_folder()),
        remeasure_costs=args.remeasure_costs,
    )
    run_replicas(config, args.replicas, host=args.host, port=args.port, ray_address=args.ray_address)
    return 0
