"""Replicas of ``specdecode serve`` on Ray Serve: N servers behind one OpenAI endpoint.

``specdecode serve --replicas N`` (or :func:`build_replicas_app` for your own ``serve.run``) runs N
copies of the server as one Ray Serve application. Each replica is a Ray actor that loads the
models with the flags of ``specdecode serve`` through the one load path (:mod:`specdecode.load`,
as the command loads) and serves the same FastAPI app (:func:`specdecode.serve.server.build_app`:
scheduler, batching, limits, audit log, metrics), mounted with Ray Serve's ``@serve.ingress``. Ray
Serve's HTTP proxy listens on one host and port and forwards each request to a replica; a replica
that dies is started again by Ray Serve. Needs ``pip install 'specdecode[ray]'``; nothing else in
specdecode imports Ray.

**Routing.** A conversation stays on one replica where that is cheap: the replica is chosen by a
consistent hash of the request's session key (Ray Serve's ``ConsistentHashRouter``), so every
request with the same key goes to the same replica while the set of replicas is unchanged, and
when a replica comes or goes only the keys of that replica move. The key is the ``X-Session-Id``
header when the client sends one (Ray Serve's own session header, ``RAY_SERVE_SESSION_ID_HEADER_KEY``
renames it); otherwise :class:`SessionKeyMiddleware`, run in Ray Serve's HTTP proxy, derives one
from the body: ``user`` when the request names one, else for a chat request a hash of its messages
up to and including the first user message (the part every later turn of the conversation repeats).
A request with neither (a completion without ``user``) is spread evenly. A replica at its limit
(``max_ongoing_requests`` = ``--max-batch-size`` + ``--max-queue``) passes the request to the next
replica on the ring.

**Which replica answered.** Every response carries the ``X-Specdecode-Replica`` header (the
replica's id). Routes added to the server's own: ``GET /replicas`` (the replicas that reported
in the last seconds: id, Ray actor name, node, age of the report), ``GET /replicas/metrics`` (every
replica's Prometheus metrics in one exposition, each sample labelled ``replica="<id>"``: one scrape
target for the whole deployment) and ``GET /replicas/{id}/metrics`` (one replica's own metrics, as
its ``/metrics`` gives them). ``GET /metrics`` answers for whichever replica the request reached.
Replicas send their metrics every second to a small deployment of this application
(:class:`MetricsBoard`), which forgets a replica that stopped sending for 15 seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from specdecode.errors import MissingDependencyError
from specdecode.load import ModelSource
from specdecode.serve.config import ServeSettings

logger = logging.getLogger(__name__)

APP_NAME = "specdecode"
"""The Ray Serve application's name."""
REPLICA_DEPLOYMENT = "SpecdecodeReplica"
BOARD_DEPLOYMENT = "SpecdecodeMetricsBoard"
REPLICA_HEADER = "x-specdecode-replica"
"""Response header naming the replica that answered."""
SESSION_HEADER_ENV = "RAY_SERVE_SESSION_ID_HEADER_KEY"
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "specdecode.serve.replicas:proxy_middlewares"
"""What ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` names so that Ray Serve's proxies derive
session keys from request bodies (:class:`SessionKeyMiddleware`)."""
CONSISTENT_HASH_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
METRICS_PUSH_INTERVAL_S = 1.0
METRICS_STALE_S = 15.0
INSTALL = "pip install 'specdecode[ray]'"

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def require_ray() -> tuple[Any, Any]:
    """``(ray, ray.serve)``.

    Raises:
        MissingDependencyError: Ray Serve is not installed (the message gives the pip command).
    """
    try:
        import ray
        from ray import serve
    except ImportError as error:
        raise MissingDependencyError(
            f"replicas run on Ray Serve, which is not installed here ({error}); install it with: {INSTALL}"
        ) from None
    return ray, serve


@dataclass(frozen=True)
class ReplicaConfig:
    """What every replica loads and how it serves (pickled to each replica).

    Attributes:
        source: the model flags; paths must exist on every machine that runs a replica.
        settings: the server settings (``model_name`` is replaced by ``served_model_name`` or the
            loaded target's name; the proposer by the one loading decides).
        served_model_name: ``--served-model-name`` (None: the target's name, as ``specdecode serve``).
        num_cpus, num_gpus: what Ray reserves per replica (``--replica-cpus``, ``--replica-gpus``);
            Ray sets a replica's thread count (``OMP_NUM_THREADS``, torch's threads) to its CPUs,
            and a llamacpp replica without ``--threads`` uses as many.
        session_affinity: route by session key (consistent hashing); False: Ray Serve's default
            router (the less loaded of two random replicas).
        cost_cache_folder: where a replica in ``adaptive`` mode loads its start-up cost model from,
            or stores the one it measured (:mod:`specdecode.cost.cache`; the key includes the
            replica's threads and its machine, so each node keeps its own); None: measure, store
            nothing.
        remeasure_costs: measure even where ``cost_cache_folder`` holds a model for the key
            (``--remeasure-costs``).

    Raises:
        ValueError: ``num_cpus`` not above 0 or ``num_gpus`` below 0 (the message names the flag).
    """

    source: ModelSource = field(default_factory=ModelSource)
    settings: ServeSettings = field(default_factory=ServeSettings)
    served_model_name: str | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    session_affinity: bool = True
    cost_cache_folder: str | None = None
    remeasure_costs: bool = False

    def __post_init__(self) -> None:
        if not self.num_cpus > 0:
            raise ValueError(f"--replica-cpus must be > 0, got {self.num_cpus!r}")
        if not self.num_gpus >= 0:
            raise ValueError(f"--replica-gpus must be >= 0, got {self.num_gpus!r}")


def prepare_cost_model(scheduler: Any, config: ReplicaConfig) -> None:
    """Give a replica's scheduler its start-up cost model from ``config.cost_cache_folder`` (loaded
    when stored under this replica's key, else measured and stored;
    :meth:`~specdecode.serve.scheduler.Scheduler.measure_cost_model`). Without a folder, nothing:
    the scheduler measures when the app starts, as before."""
    if config.cost_cache_folder is not None:
        scheduler.measure_cost_model(cache_folder=config.cost_cache_folder, remeasure=config.remeasure_costs)


# ------------------------------------------------------------------------------------ routing
def session_header() -> str:
    """The request header Ray Serve routes sessions by (``x-session-id`` unless
    ``RAY_SERVE_SESSION_ID_HEADER_KEY`` says otherwise), lower case."""
    return os.environ.get(SESSION_HEADER_ENV, "x-session-id").lower()


def _is_session_header(name: bytes) -> bool:
    """As Ray Serve's proxy compares: case-insensitive, ``-`` and ``_`` alike."""
    return name.decode("latin-1").lower().replace("-", "_") == session_header().replace("-", "_")


def session_key(body: bytes) -> str | None:
    """The routing key of a request body without a session header, or None.

    ``user:<user>`` when the body names a ``user``; else, for a chat request (``messages``), ``chat:``
    and a SHA-256 of the messages up to and including the first ``user`` message (every later turn
    of a conversation starts with them); else None (not JSON, not an object, a completion without
    ``user``).
    """
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    user = data.get("user")
    if isinstance(user, str) and user:
        return "user:" + user
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    head = []
    for message in messages:
        head.append(message)
        if isinstance(message, dict) and message.get("role") == "user":
            break
    text = json.dumps(head, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "chat:" + hashlib.sha256(text.encode()).hexdigest()[:32]


class SessionKeyMiddleware:
    """ASGI middleware for Ray Serve's HTTP proxy: a POST to ``.../completions`` without a session
    header gets one, :func:`session_key` of its body, before the proxy picks a replica.

    The body is read (at most ``max_bytes``; a larger one is passed on without a key) and replayed
    to the app unchanged. Installed by :func:`proxy_middlewares` through
    ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` (:func:`ray_runtime_env`).
    """

    def __init__(self, app: Any, max_bytes: int = 1 << 20) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or not str(scope.get("path", "")).endswith("completions")
            or any(_is_session_header(name) for name, _ in scope.get("headers") or [])
        ):
            await self.app(scope, receive, send)
            return
        received: deque[Message] = deque()
        size, complete = 0, False
        while size <= self.max_bytes:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                complete = True
                break
        if complete and size <= self.max_bytes:
            key = session_key(b"".join(m.get("body", b"") for m in received))
            if key is not None:
                scope = dict(scope)
                scope["headers"] = [*scope.get("headers", []), (session_header().encode(), key.encode())]

        async def replay() -> Message:
            return received.popleft() if received else await receive()

        await self.app(scope, replay, send)


def proxy_middlewares() -> list[Any]:
    """The middlewares Ray Serve's HTTP proxy adds when ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``
    names this function (:data:`PROXY_CALLBACK`)."""
    from starlette.middleware import Middleware

    return [Middleware(SessionKeyMiddleware)]


def ray_runtime_env() -> dict[str, Any]:
    """The ``runtime_env`` for ``ray.init``: Ray Serve's processes started by this job (controller,
    proxies, replicas) get :data:`PROXY_CALLBACK`, so that proxies derive session keys. A cluster
    whose Serve already runs keeps its proxies: set the variable before ``ray start`` there."""
    return {"env_vars": {PROXY_CALLBACK_ENV: PROXY_CALLBACK}}


# ------------------------------------------------------------------------------------ metrics
class MetricsBoard:
    """The latest metrics of every replica (one actor of the application, no CPU reserved)."""

    def __init__(self) -> None:
        self.reports: dict[str, dict[str, Any]] = {}

    def push(self, replica: str, info: dict[str, Any], text: str) -> None:
        """``replica``'s metrics (Prometheus text) and what it says about itself, now."""
        self.reports[replica] = {**info, "time": time.time(), "metrics": text}

    def collect(self) -> dict[str, dict[str, Any]]:
        """Replica id -> its last report (``time``, ``metrics`` and its own fields), for the
        replicas that reported in the last :data:`METRICS_STALE_S` seconds."""
        now = time.time()
        for replica in [r for r, report in self.reports.items() if now - report["time"] > METRICS_STALE_S]:
            del self.reports[replica]
        return dict(self.reports)


def merge_metrics(texts: dict[str, str]) -> str:
    """One Prometheus exposition of several replicas' metrics, each sample labelled
    ``replica="<id>"`` (metric families merged by name; help and type from the first)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labels = {"replica": replica, **sample.labels}
                merged.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)

    class _Merged:
        def collect(self) -> list[Metric]:
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())  # type: ignore[arg-type]
    return generate_latest(registry).decode()


# ------------------------------------------------------------------------------------ replica
class _ReplicaHeader:
    """ASGI middleware: every HTTP response names the replica (:data:`REPLICA_HEADER`)."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named)


class SpecdecodeReplica:
    """One replica: the models loaded as ``specdecode serve`` loads them, the server's FastAPI app
    (Ray Serve mounts it through :meth:`__serve_build_asgi_app__`), plus the ``/replicas`` routes.

    Args:
        config: what to load and serve.
        board: a handle to the application's :class:`MetricsBoard` (None: no ``/replicas`` data).
    """

    async def __init__(self, config: ReplicaConfig, board: Any = None) -> None:
        import ray
        from ray import serve

        from specdecode.load import load_models, plan_models
        from specdecode.serve.server import build_app

        context = serve.get_replica_context()
        self.replica_id: str = context.replica_id.unique_id
        self.info = {
            "replica": self.replica_id,
            "actor_name": ray.get_runtime_context().get_actor_name() or context.replica_id.to_full_id_str(),
            "node": socket.gethostname(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
        }
        source, settings = config.source, config.settings
        if source.threads is None:  # llamacpp: the replica's share of the machine, not every core
            source = dataclasses.replace(source, threads=max(1, int(config.num_cpus)))

        plan = plan_models(  # the one load path, as specdecode serve: every path checked before any weights load
            **dataclasses.asdict(source),
            proposer=settings.proposer,
            server=True,
            announce=f"specdecode replica {self.replica_id}",
            **settings.proposer_options,
        )
        loaded = await asyncio.to_thread(load_models, plan)
        settings = dataclasses.replace(
            settings,
            model_name=config.served_model_name or loaded.name,
            proposer=loaded.proposer,
            proposer_options=loaded.options,
        )
        self.server_app, self.scheduler = build_app(
            loaded.target, loaded.tokenizer, settings, draft=loaded.draft, vocabulary_checked=True
        )
        await asyncio.to_thread(prepare_cost_model, self.scheduler, config)
        self.board = board
        self._add_routes()
        self._pusher = asyncio.get_running_loop().create_task(self._push_metrics()) if board is not None else None
        logger.info("replica %s serves %s (proposer %s)", self.replica_id, settings.model_name, settings.proposer)

    def __serve_build_asgi_app__(self) -> Any:  # noqa: N807 (Ray Serve's name)
        return _ReplicaHeader(self.server_app, self.replica_id)

    def check_health(self) -> None:
        """Ray Serve's periodic health check: the scheduler thread must be running (once started)."""
        if self.scheduler.started and not self.scheduler.is_alive:
            raise RuntimeError(f"replica {self.replica_id}: the scheduler thread is not running")

    async def _push_metrics(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # the board restarting: the next push fills it again
                text = self.scheduler.metrics.render().decode()
                await self.board.push.remote(self.replica_id, self.info, text)
            await asyncio.sleep(METRICS_PUSH_INTERVAL_S)

    async def _reports(self) -> dict[str, dict[str, Any]]:
        if self.board is None:
            text = self.scheduler.metrics.render().decode()
            return {self.replica_id: {**self.info, "time": time.time(), "metrics": text}}
        return await self.board.collect.remote()

    def _add_routes(self) -> None:
        from fastapi.responses import JSONResponse, Response
        from prometheus_client import CONTENT_TYPE_LATEST

        async def replicas() -> JSONResponse:
            now = time.time()
            reports = await self._reports()
            data = [
                {
                    **{k: v for k, v in report.items() if k not in ("metrics", "time")},
                    "age_s": round(now - report["time"], 3),
                }
                for _, report in sorted(reports.items())
            ]
            return JSONResponse({"object": "list", "answered_by": self.replica_id, "data": data})

        async def all_metrics() -> Response:
            reports = await self._reports()
            text = merge_metrics({r: report["metrics"] for r, report in reports.items()})
            return Response(text, media_type=CONTENT_TYPE_LATEST)

        async def one_metrics(replica: str) -> Response:
            reports = await self._reports()
            if replica not in reports:
                known = ", ".join(sorted(reports)) or "none"
                return JSONResponse(
                    {"error": {"message": f"no replica {replica!r} reported (known: {known})", "type": "not_found"}},
                    status_code=404,
                )
            return Response(reports[replica]["metrics"], media_type=CONTENT_TYPE_LATEST)

        self.server_app.add_api_route("/replicas", replicas, methods=["GET"])
        self.server_app.add_api_route("/replicas/metrics", all_metrics, methods=["GET"])
        self.server_app.add_api_route("/replicas/{replica}/metrics", one_metrics, methods=["GET"])


# ------------------------------------------------------------------------------------ the application
def has_consistent_hash_router() -> bool:
    """Whether the installed Ray Serve has the consistent-hash request router."""
    try:
        from ray.serve.experimental import consistent_hash_router  # noqa: F401
    except ImportError:
        return False
    return True


def build_replicas_app(config: ReplicaConfig, num_replicas: int) -> Any:
    """The Ray Serve application: ``num_replicas`` :class:`SpecdecodeReplica` and one
    :class:`MetricsBoard`; run it with ``serve.run(app, name=APP_NAME, route_prefix="/")``.

    Raises:
        MissingDependencyError: Ray Serve is not installed.
        ValueError: ``num_replicas`` below 1.
    """
    if num_replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {num_replicas}")
    _, serve = require_ray()
    settings = config.settings
    options: dict[str, Any] = {
        "name": REPLICA_DEPLOYMENT,
        "num_replicas": num_replicas,
        "ray_actor_options": {"num_cpus": config.num_cpus, "num_gpus": config.num_gpus},
        # Ray Serve holds back what the replica would queue itself: past this, the replica's own 429
        "max_ongoing_requests": settings.max_batch_size + settings.max_queue,
        "max_constructor_retry_count": 3,  # a model that cannot load fails the deployment soon
        "health_check_period_s": 2.0,  # a dead replica is noticed (and replaced) within seconds
    }
    if config.session_affinity:
        if has_consistent_hash_router():
            options["request_router_config"] = {"request_router_class": CONSISTENT_HASH_ROUTER}
        else:
            logger.warning("this Ray Serve has no consistent-hash router: requests are not routed by session")
    replica = serve.deployment(**options)(serve.ingress()(SpecdecodeReplica))
    board = serve.deployment(
        name=BOARD_DEPLOYMENT,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        logging_config={"enable_access_log": False},  # a push per replica per second
    )(MetricsBoard)
    return replica.bind(config, board.bind())


def app_builder(args: dict[str, Any]) -> Any:
    """Ray Serve's application builder, for config files (``serve run``, ``serve deploy``, KubeRay's
    ``RayService``): ``import_path: specdecode.serve.replicas:app_builder`` with ``args`` of

    - ``replicas`` (default 1), ``replica_cpus`` (1), ``replica_gpus`` (0), ``served_model_name``,
      ``cost_cache_folder`` (None: every replica measures its cost model; a path: as
      ``specdecode serve``'s ``serve-cost`` folder) and ``remeasure_costs`` (False);
    - the fields of :class:`~specdecode.load.ModelSource` (``target``, ``draft``, ``dtype``,
      ``backend``, ``threads``, ``exact``);
    - the fields of :class:`~specdecode.serve.config.ServeSettings` but ``model_name``
      (``proposer``, ``speculation``, ``max_batch_size``, ...; ``proposer`` is a name or ``auto``, which
      each replica resolves on its backend).

    Raises:
        ValueError: an unknown or bad argument (the message names it).
    """
    args = dict(args)
    replicas = int(args.pop("replicas", 1))
    source_fields = {f.name for f in dataclasses.fields(ModelSource)}
    settings_fields = {f.name for f in dataclasses.fields(ServeSettings)} - {"model_name"}
    source = ModelSource(**{k: args.pop(k) for k in sorted(args) if k in source_fields})
    settings = ServeSettings(**{k: args.pop(k) for k in sorted(args) if k in settings_fields})
    config = ReplicaConfig(
        source=source,
        settings=settings,
        served_model_name=args.pop("served_model_name", None),
        num_cpus=float(args.pop("replica_cpus", 1.0)),
        num_gpus=float(args.pop("replica_gpus", 0.0)),
        cost_cache_folder=args.pop("cost_cache_folder", None),
        remeasure_costs=bool(args.pop("remeasure_costs", False)),
    )
    if args:
        raise ValueError(f"app_builder: unknown args {sorted(args)}")
    return build_replicas_app(config, replicas)


def run_replicas(
    config: ReplicaConfig,
    num_replicas: int,
    host: str = "127.0.0.1",
    port: int = 8000,
    ray_address: str | None = None,
) -> None:
    """``specdecode serve --replicas N``: start (``ray_address`` None) or join a Ray cluster, run the
    application on ``host:port`` until Ctrl-C or SIGTERM, then delete it (and stop the cluster
    started here).

    Raises:
        MissingDependencyError: Ray Serve is not installed.
    """
    ray, serve = require_ray()
    app = build_replicas_app(config, num_replicas)

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM (docker stop, systemd, Kubernetes) cleans up as Ctrl-C does

    local = {"include_dashboard": False} if ray_address is None else {}
    ray.init(address=ray_address, runtime_env=ray_runtime_env(), **local)
    # after ray.init, which installs a SIGTERM handler of its own that aborts the process
    previous = signal.signal(signal.SIGTERM, stop) if threading.current_thread() is threading.main_thread() else None
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        print(
            f"specdecode serve: {num_replicas} replica(s) on Ray Serve at http://{host}:{port} "
            f"(GET /replicas lists them; Ctrl-C stops)",
            file=sys.stderr,
            flush=True,
        )
        while True:
            time.sleep(3600)
    finally:
        with contextlib.suppress(Exception):
            serve.delete(APP_NAME)
        if ray_address is None:
            with contextlib.suppress(Exception):
                serve.shutdown()
        ray.shutdown()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
