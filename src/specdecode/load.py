"""One load path: which backend and proposer run, then the models (docs/design.md §2b).

``SpeculativeGenerator.from_pretrained``, ``specdecode generate``, ``specdecode serve`` and each
Ray Serve replica load through the two steps here, so they share one policy; ``specdecode bench``
plans with :func:`plan_bench_models` (the target and the draft its methods need, no proposer: each
method builds its own, on the one backend of the plan) and loads with :func:`load_models` too::

    plan = plan_models(target, draft, proposer, backend, dtype, threads, exact, **options)
    loaded = load_models(plan)          # LoadedModels: target, tokenizer, draft, proposer, ...

:func:`plan_models` loads no weights and raises every error of input, naming the parameter: the
backend is resolved once (:func:`~specdecode.models.backends.resolve_backend`, whose llama.cpp
smoke test may print one line), ``proposer="auto"`` becomes the backend's default, the proposer's
options are validated, every path is checked and, for model folders, the vocabulary rule is asked
once (:func:`~specdecode.proposers.vocabulary.draft_proposer`: a ``draft_model`` draft of another
vocabulary drafts through ``cross_tokenizer``). GGUF files are compared once they load (their
vocabularies are known only then).

**Policy.** Under ``backend="auto"``, a proposer llama.cpp cannot serve runs on torch, for the
library and the server alike; one named for ``backend="llamacpp"`` is refused with the reason. The
server needs more of llama.cpp than ``generate`` does: its batched runner returns no hidden states,
so Medusa and EAGLE (which read them) count as proposers it cannot serve (``server=True``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # this module loads no torch until it loads models
    from specdecode.proposers.base import Proposer


@dataclass(frozen=True)
class ModelSource:
    """What to load: the model flags of ``specdecode serve`` (and the arguments of :func:`plan_models`).

    Attributes:
        target, draft: ``--target`` / ``--draft`` (a folder, a ``.gguf`` file, a packaged model's
            name, or None for the default pair's model).
        dtype: ``--dtype``.
        backend: ``--backend`` (``auto``, ``torch``, ``llamacpp``).
        threads, exact: ``--threads`` (llamacpp only) and ``--exact`` / ``--no-exact`` (None:
            neither, :func:`default_exact`).
        device, cuda_graphs: ``--device`` and ``--cuda-graphs`` (torch; ``--device cpu`` also keeps
            llama.cpp's layers on the CPU).
    """

    target: str | None = None
    draft: str | None = None
    dtype: str = "auto"
    backend: str = "auto"
    threads: int | None = None
    exact: bool | None = None
    device: str = "auto"
    cuda_graphs: bool = True


@dataclass(frozen=True)
class LoadPlan:
    """What :func:`load_models` loads, every choice made and every input checked.

    Attributes:
        backend: the backend that runs the models (``torch`` or ``llamacpp``, resolved).
        proposer: the proposer that runs (``auto`` resolved; for model folders the vocabulary rule
            applied), or None for none.
        options: its options (``auto``'s defaults under those given).
        config: the validated options (its config dataclass), or None without a proposer.
        target: the target's model folder (torch) or ``.gguf`` file (llamacpp).
        draft: the draft's, or None where no draft loads.
        name: the target's name (the server's model id unless another is given).
        dtype, threads: as given (:func:`plan_models`).
        exact: exact mode, decided (:func:`default_exact` where none was given).
        server: planned for the server (a draft given loads even if the proposer needs none; the
            proposer is not built: the server builds one per request).
        announce: the prefix of the notice on stderr when the proposer switches to ``cross_tokenizer``.
        prepack: prepack the target's weights at load even without a proposer
            (:func:`plan_bench_models`; the server and a proposer always do).
        device: where torch runs the models (resolved: ``"cpu"``, ``"cuda:0"``, ...); for llama.cpp
            ``"cpu"`` keeps every layer on the CPU (a CUDA build otherwise offloads them all).
        cuda_graphs: on a CUDA device, static KV cache and CUDA graphs (:mod:`specdecode.models.torch.placement`).
    """

    backend: str
    proposer: str | None
    options: dict[str, Any]
    config: Any
    target: Path
    draft: Path | None
    name: str
    dtype: Any = "auto"
    threads: int | None = None
    exact: bool = True
    server: bool = False
    announce: str = "specdecode"
    prepack: bool = False
    device: str = "cpu"
    cuda_graphs: bool = True


@dataclass
class LoadedModels:
    """Loaded models and what loading them decided.

    Attributes:
        target, tokenizer, draft: the models (``draft`` None where none loaded).
        name: the target's name (the API's model id unless ``--served-model-name`` is given).
        proposer: the proposer that runs: the one planned, or ``cross_tokenizer`` for a
            ``draft_model`` draft of another vocabulary.
        backend: the backend the models run on.
        built: the proposer built on the models (None for the server, which builds its own per
            request, or without a proposer).
        options: the proposer's options.
    """

    target: Any
    tokenizer: Any
    draft: Any
    name: str
    proposer: str | None
    backend: str = "torch"
    built: Proposer | None = None
    options: dict[str, Any] = field(default_factory=dict)


def auto_proposer(backend: str, draft: str | Path | None, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """What ``proposer="auto"`` runs on ``backend`` (a resolved one) with the ``options`` given:
    the backend's default (:func:`~specdecode.models.backends.default_proposer`: ``draft_model``
    whenever a draft is named) with its options under those given, or ``draft_model`` when the
    options given are the draft model's and not the default's (``prompt_lookup_min=2`` asks for the
    draft, as a ``draft`` does)."""
    from specdecode.models.backends import default_proposer
    from specdecode.proposers import PROPOSERS

    def takes(name: str) -> set[str]:
        return {f.name for f in dataclasses.fields(PROPOSERS[name].config)}

    name, defaults = default_proposer(backend, draft)
    if not set(options) <= takes(name) and set(options) <= takes("draft_model"):
        name, defaults = "draft_model", {}
    return name, {**defaults, **options}


def llamacpp_refusal(name: str, server: bool = False) -> str | None:
    """Why the llamacpp backend cannot serve proposer ``name`` (``server``: in the server's batched
    runner), or None where it can."""
    from specdecode.proposers import PROPOSERS

    spec = PROPOSERS[name]
    if "llamacpp" not in spec.backends:
        return (
            f"proposer {name!r} is not available on the llamacpp backend (it runs on "
            f"{', '.join(spec.backends)}); use backend='torch' (--backend torch)"
        )
    if server and spec.needs_target_features:  # LlamaCppBatchedRunner.capabilities.returns_hidden is False
        return (
            f"--proposer {name}: the llamacpp server's batched runner returns no hidden states, which "
            f"{name} reads (specdecode generate runs it on llama.cpp); use --backend torch to serve it"
        )
    return None


def _make_config(name: str, options: dict[str, Any]) -> Any:
    """``name``'s validated options; an option of another proposer is named with its owners.

    Raises:
        ValueError: an option ``name`` does not take, or a bad value.
    """
    from specdecode.proposers import PROPOSERS

    spec = PROPOSERS[name]
    own = {f.name for f in dataclasses.fields(spec.config)}
    for option in sorted(set(options) - own):
        owners = [n for n, s in PROPOSERS.items() if option in {f.name for f in dataclasses.fields(s.config)}]
        if owners:
            takes = ", ".join(sorted(own)) or "no options"
            raise ValueError(
                f"proposer {name!r} does not take [{option!r}] (--{option.replace('_', '-')} is an option of "
                f"--proposer {' / '.join(owners)}); it takes {takes}"
            )
    return spec.make_config(**options)


def choose(
    proposer: str | None,
    backend: str,
    target: str | Path | None = None,
    draft: str | Path | None = None,
    dtype: Any = "auto",
    *,
    server: bool = False,
    device: str = "auto",
    **options: Any,
) -> tuple[str, str | None, dict[str, Any], Any]:
    """The backend and the proposer, without paths or weights: ``(backend, proposer, options, config)``.

    The first half of :func:`plan_models` (arguments as there), for a process that plans for others
    (``specdecode serve --replicas``: each replica checks its own paths).

    Raises:
        ValueError: an unknown backend or proposer, options without a proposer, bad options, or a
            proposer ``backend="llamacpp"`` cannot serve (the message names both).
    """
    from specdecode.models.backends import resolve_backend
    from specdecode.proposers import PROPOSERS

    if proposer is not None and proposer != "auto" and proposer not in PROPOSERS:
        raise ValueError(f"proposer must be one of {sorted(PROPOSERS)}, 'auto' or None, got {proposer!r}")
    if proposer is None and options:
        raise ValueError(f"proposer options {sorted(options)} given without a proposer")
    chosen = resolve_backend(backend, target, dtype, device)  # once: its llama.cpp smoke test may print a line
    if proposer == "auto":
        proposer, options = auto_proposer(chosen, draft, options)
    config = _make_config(proposer, options) if proposer is not None else None  # bad options fail early
    refusal = llamacpp_refusal(proposer, server) if proposer is not None and chosen == "llamacpp" else None
    if refusal is not None:
        if backend != "auto":
            raise ValueError(refusal)
        chosen = "torch"  # auto: what llama.cpp cannot serve runs on torch (library and server alike)
    return chosen, proposer, options, config


def default_exact(backend: str, device: str) -> bool:
    """Exact mode where ``exact`` is not given: on wherever it costs at most 15% of plain decoding's
    speed (docs/usage.md#exactness): llama.cpp (batch-invariant chunks) and torch on the CPU (one
    query row per attention call; bf16 and fp16 targets, float32 runs as it is); off for torch on a
    GPU, where fixed-width passes make a one-token pass cost a 9-token one (opt in with
    ``exact=True``)."""
    return not (backend == "torch" and device.startswith("cuda"))


def plan_models(
    target: str | Path | None = None,
    draft: str | Path | None = None,
    proposer: str | None = "auto",
    backend: str = "auto",
    dtype: Any = "auto",
    threads: int | None = None,
    exact: bool | None = None,
    *,
    device: str = "auto",
    cuda_graphs: bool = True,
    server: bool = False,
    announce: str = "specdecode",
    **options: Any,
) -> LoadPlan:
    """Every choice and every check of a load, no weights loaded.

    Args:
        target, draft: HF model folder, ``.gguf`` file, packaged model name, or None for the
            default pair's model (the draft is used only where the proposer needs one, or with
            ``server``).
        proposer: a name of :data:`~specdecode.proposers.PROPOSERS`, ``"auto"`` (:func:`auto_proposer`)
            or None (the target alone).
        backend: ``"auto"``, ``"torch"`` or ``"llamacpp"`` (resolved once,
            :func:`~specdecode.models.backends.resolve_backend`).
        dtype: ``"auto"``, ``"bfloat16"``, ``"float32"`` or a torch dtype.
        threads: the llamacpp backend's CPU threads.
        exact: every row of a verification pass bit-identical to a one-token pass, so that greedy
            output is the target alone's token for token: llama.cpp's batch-invariant chunks
            (:class:`~specdecode.models.llamacpp.LlamaCppOptions`); a torch target in bfloat16 or
            float16 gets exact passes (:mod:`specdecode.models.torch.exact` on the CPU, fixed-width
            passes on a GPU). None: :func:`default_exact`.
        device: ``"auto"`` (a CUDA GPU where torch sees one, else the CPU), ``"cpu"``, ``"cuda"``,
            ``"cuda:N"`` or ``"mps"`` (:func:`~specdecode.models.torch.placement.resolve_device`).
        cuda_graphs: on a CUDA device, run torch's runners over a static KV cache with CUDA graphs
            (default; False: eager passes).
        server: plan for ``specdecode serve`` (see :attr:`LoadPlan.server`; Medusa and EAGLE count
            as proposers llama.cpp cannot serve).
        announce: prefix of the notice on stderr when the proposer switches to ``cross_tokenizer``.
        options: the proposer's options (fields of its config dataclass).

    Raises:
        ValueError: unknown dtype, device, backend or proposer, a device this torch cannot use, bad
            proposer or llamacpp options, options without a proposer, or a proposer
            ``backend="llamacpp"`` cannot serve (names both).
        ModelNotFoundError: a path does not exist or is not a model, or a default model is not installed.
        IncompatibleModelsError: a draft of another vocabulary for a proposer that cannot switch
            to ``cross_tokenizer`` (model folders; GGUF files: :func:`load_models`).
    """
    from specdecode.models.default import DEFAULT_TARGET
    from specdecode.models.torch.hf_loading import parse_dtype
    from specdecode.models.torch.placement import resolve_device

    place = str(resolve_device(device))  # a device this torch cannot use fails before anything loads
    parse_dtype(dtype)
    chosen, proposer, options, config = choose(
        proposer, backend, target, draft, dtype, server=server, device=place, **options
    )
    exact = default_exact(chosen, place) if exact is None else exact
    needs_draft = proposer is not None and _spec(proposer).needs_draft
    loads_draft = needs_draft or (server and draft is not None)
    if chosen == "llamacpp":
        from specdecode.models.backends import gguf_path
        from specdecode.models.llamacpp.model import LlamaCppOptions

        LlamaCppOptions(threads=threads, exact=exact)  # a bad value fails here, not after a load
        target_path = gguf_path(target, "target")  # every path checked before any weights load
        draft_path = gguf_path(draft, "draft") if loads_draft else None
        name = target_path.stem
    else:
        from specdecode.models.torch.hf_loading import resolve_model_dir

        target_path = resolve_model_dir(target, "target")
        draft_path = resolve_model_dir(draft, "draft") if loads_draft else None
        name = target_path.name
        final = _vocabulary_rule(proposer, target_path, draft_path, announce)
        if final != proposer:  # a draft of another vocabulary: cross_tokenizer, with the options given
            proposer, config = final, _make_config(final, options)
    name = DEFAULT_TARGET.name if target is None else name
    return LoadPlan(
        chosen,
        proposer,
        options,
        config,
        target_path,
        draft_path,
        name,
        dtype,
        threads,
        exact,
        server,
        announce,
        device=place,
        cuda_graphs=cuda_graphs,
    )


def plan_bench_models(
    target: str | Path | None = None,
    draft: str | Path | None = None,
    backend: str = "auto",
    dtype: Any = "auto",
    threads: int | None = None,
    exact: bool | None = None,
    *,
    need_draft: bool = False,
    device: str = "auto",
    cuda_graphs: bool = True,
) -> LoadPlan:
    """:func:`plan_models` for ``specdecode bench``: the target and, where ``need_draft``, the draft
    (the default pair's where ``draft`` is None), no proposer (each method builds its own); the
    target's weights prepacked at load (the bench keeps the float draft beside its int8 copy for the
    peers, which would otherwise leave the target's verification passes without them).

    Raises:
        ValueError, ModelNotFoundError: as :func:`plan_models`.
    """
    plan = plan_models(target, None, None, backend, dtype, threads, exact, device=device, cuda_graphs=cuda_graphs)
    draft_path = None
    if need_draft:  # checked before any weights load, as plan_models checks the target
        if plan.backend == "llamacpp":
            from specdecode.models.backends import gguf_path

            draft_path = gguf_path(draft, "draft")
        else:
            from specdecode.models.torch.hf_loading import resolve_model_dir

            draft_path = resolve_model_dir(draft, "draft")
    return dataclasses.replace(plan, draft=draft_path, prepack=True)


def load_server_models(
    source: ModelSource, proposer: str | None, announce: str = "specdecode serve", **options: Any
) -> LoadedModels:
    """Plan (``server=True``) and load ``source`` with the default proposer ``proposer`` (a name,
    ``"auto"`` or None) and its ``options``: what ``specdecode serve`` and each replica on Ray Serve
    (:mod:`specdecode.serve.replicas`) load.

    Raises:
        ValueError, ModelNotFoundError, IncompatibleModelsError: see :func:`plan_models` and
            :func:`load_models`.
    """
    plan = plan_models(**dataclasses.asdict(source), proposer=proposer, server=True, announce=announce, **options)
    return load_models(plan)


def _spec(name: str) -> Any:
    from specdecode.proposers import PROPOSERS

    return PROPOSERS[name]


def _vocabulary_rule(proposer: str | None, target: Any, draft: Any, announce: str) -> str | None:
    """:func:`~specdecode.proposers.vocabulary.draft_proposer`, asked once per load (folders in
    :func:`plan_models`, loaded GGUF models in :func:`load_models`)."""
    from specdecode.proposers import vocabulary

    return vocabulary.draft_proposer(proposer, target, draft, announce=announce)


def load_models(plan: LoadPlan) -> LoadedModels:
    """Load what ``plan`` says: the target (before the draft), its tokenizer, the draft, and (not
    for the server) the proposer built on them.

    Raises:
        ModelNotFoundError, LlamaCppUnusableError: a model cannot load (see
            :func:`~specdecode.models.torch.hf_loading.load_model`, :func:`~specdecode.models.backends.load_llamacpp`).
        IncompatibleModelsError: two GGUF files of other vocabularies for a proposer that cannot
            switch to ``cross_tokenizer``.
        ValueError: the options given do not fit ``cross_tokenizer`` where two GGUF files of other
            vocabularies switch to it.
    """
    proposer, config = plan.proposer, plan.config
    if plan.backend == "llamacpp":
        from specdecode.models.backends import load_llamacpp, load_llamacpp_tokenizer
        from specdecode.models.llamacpp.model import LlamaCppOptions

        options = LlamaCppOptions(threads=plan.threads, exact=plan.exact)
        if plan.device == "cpu":  # --device cpu: a CUDA build keeps every layer on the CPU
            options = dataclasses.replace(options, gpu_layers=0)
        target = load_llamacpp(plan.target, "target", options)
        draft = load_llamacpp(plan.draft, "draft", options) if plan.draft is not None else None
        tokenizer = load_llamacpp_tokenizer(target)
        final = _vocabulary_rule(proposer, target, draft, plan.announce)  # GGUF: known once loaded
        if final != proposer:
            proposer, config = final, _make_config(final, plan.options)
    else:
        from specdecode.models.torch.hf_loading import load_model, load_tokenizer

        # the target first: its prepacked weights before the draft's copies (models.cpu.prepack)
        place = {"device": plan.device, "cuda_graphs": plan.cuda_graphs}
        prepack_now = plan.prepack or plan.server or proposer is not None
        target = load_model(plan.target, "target", plan.dtype, prepack_now=prepack_now, exact=plan.exact, **place)
        draft = load_model(plan.draft, "draft", plan.dtype, **place) if plan.draft is not None else None
        tokenizer = load_tokenizer(plan.target)
    built = None
    if proposer is not None and not plan.server:
        built = _spec(proposer).build(config, target, draft)
    return LoadedModels(target, tokenizer, draft, plan.name, proposer, plan.backend, built, dict(plan.options))


def load_random_models(
    target: str | Path | None,
    draft: str | Path | None,
    backend: str = "auto",
    dtype: Any = "auto",
    *,
    need_draft: bool = True,
    device: str = "auto",
    cuda_graphs: bool = True,
    exact: bool | None = None,
) -> tuple[Any, Any]:
    """The target and (``need_draft``) the draft with random weights of their architectures
    (:func:`specdecode.models.torch.hf_loading.random_model`: a folder's ``config.json``, or the
    default pair's shipped one), on torch, placed as :func:`load_models` places loaded ones: what a
    pass costs without the weights (``specdecode cost-table --random-weights``); the target with
    ``exact`` passes as :func:`load_models` loads it (None: :func:`default_exact`).

    Raises:
        ValueError: ``backend`` is ``llamacpp`` (llama.cpp times a GGUF file as it is), or a bad
            dtype or device.
        ModelNotFoundError: a model that is not a folder with a ``config.json``.
    """
    from specdecode.models.torch.hf_loading import random_model

    if backend not in ("auto", "torch"):
        raise ValueError(f"--random-weights runs on torch (--backend torch or auto), got --backend {backend}; "
                         "llama.cpp times the GGUF file given")  # fmt: skip
    from specdecode.models.torch.placement import resolve_device

    place = {"dtype": dtype, "device": device, "cuda_graphs": cuda_graphs}
    exact = default_exact("torch", str(resolve_device(device))) if exact is None else exact
    built_target = random_model(target, "target", exact=exact, **place)
    built_draft = random_model(draft, "draft", seed=1, **place) if need_draft else None
    return built_target, built_draft
