"""``specdecode serve``: an OpenAI-compatible server with continuous batching of speculative decoding.

Modules (importing this package imports nothing heavy; see docs/serving.md):

- :mod:`~specdecode.models.torch.batch`: the target over a batch of ragged rows with one KV cache;
- :mod:`~specdecode.cost.serve_model`: the start-up cost model and the per-step speculation plan;
- :mod:`~specdecode.serve.scheduler`: the scheduler thread (queue, admission, the batched loop);
- :mod:`~specdecode.serve.app` / :mod:`~specdecode.serve.schemas`: HTTP routes and request models;
- :mod:`~specdecode.serve.prometheus`, :mod:`~specdecode.serve.audit`: Prometheus metrics, the audit log;
- :mod:`~specdecode.serve.server`: build an app from model objects, run one in a thread;
- :func:`specdecode.load.load_server_models`: load the models from the flags (the command and each replica);
- :mod:`~specdecode.serve.replicas`: N replicas on Ray Serve behind one endpoint (imports Ray; only
  ``--replicas`` imports it);
- the ``serve`` subcommand: :mod:`specdecode.commands.serve`.
"""
