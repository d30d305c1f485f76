"""The methods a benchmark compares, in one registry.

A method is a callable ``run(models, prompt_ids, settings, k, prediction) -> MethodOutput``: it
decodes the token ids of one turn and returns the new token ids, its wall time and, for our engine,
its :class:`~specdecode.stats.SpecStats`. ``prediction`` is the turn's expected answer (the
``code_edit`` category's original file, else None); only the ``prediction`` method drafts from it.

- ``target``: our engine with ``speculative=False``, the baseline every speedup divides.
- one method per proposer of the library (:data:`specdecode.proposers.PROPOSERS`: ``draft_model``,
  ``prompt_lookup``, ...), registered automatically; :func:`register_proposer` adds others.
- ``prediction``: the turn's prediction drafted first (OpenAI's Predicted Outputs,
  :mod:`specdecode.proposers.prediction`, k 16), prompt lookup after 3-token matches where it has
  nothing (llama.cpp's default proposer); on a turn without a prediction, that prompt lookup alone.
- peers on the same model objects (torch backend): ``hf_generate`` (``model.generate`` alone),
  ``hf_assisted`` (``assistant_model=draft``, Hugging Face's own draft-length defaults) and
  ``hf_prompt_lookup`` (``prompt_lookup_num_tokens=k``).
- peers on the target's GGUF file (any backend; the same threads): ``llamacpp`` (llama-cpp-python's
  own plain generation, ``Llama.generate``, with flash attention on as llama.cpp itself defaults to
  on a CPU: its fastest plain decoding) and ``llamacpp_prompt_lookup`` (the same with its
  ``LlamaPromptLookupDecoding``, ``num_pred_tokens=k``, its default 10 without a sweep).

Methods that take k (``uses_k``) become one column per k of a sweep, labelled ``name[k=4]``;
without a sweep, one column each, named ``name``, at the proposer's default k
(:func:`~specdecode.proposers.base.default_num_speculative_tokens`; recorded in each record).

A method of a proposer with a draft model may name its own draft with the ``draft=`` option (a
folder, a ``.gguf`` file or a packaged name): ``cross_tokenizer(draft=smollm2)`` drafts with
SmolLM2 beside ``draft_model`` on ``--draft`` in the same run.

A proposer method can carry its options and a schedule (:mod:`specdecode.schedule`) in its name:
``NAME(option=value,...)+SCHEDULE``, e.g. ``draft_model(token_map=default,draft_vocab_size=32768)``,
``prompt_lookup+adaptive`` or ``early_exit(exit_layer=8)+heuristic`` (:func:`parse_method`), and a
token tree after ``@``: ``draft_model@tree16``, ``draft_model@dynamic:16``. The option ``k=N`` gives
a chain method its own k (one column, whatever ``-k`` sweeps): ``eagle(k=2)``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specdecode.engine import SpeculativeGenerator
from specdecode.limits import K_RANGE, is_num_speculative_tokens
from specdecode.proposers import PROPOSERS as LIBRARY_PROPOSERS
from specdecode.proposers.base import DEFAULT_NUM_SPECULATIVE_TOKENS, Proposer, default_num_speculative_tokens
from specdecode.proposers.prediction import PREDICTION_DEFAULT_K
from specdecode.proposers.prompt_lookup import PromptLookupConfig, PromptLookupProposer
from specdecode.sampling import SamplingParams
from specdecode.stats import SpecStats

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def timed(generator: SpeculativeGenerator) -> SpeculativeGenerator:
    """``generator`` set to run every prefill (``reuse_prompt`` off): a repeated prompt (the warm-up's,
    a repeat's) is timed in full, as the peers' (llama-cpp-python from ``reset()``)."""
    generator.reuse_prompt = False
    return generator


@dataclass(frozen=True)
class BenchSettings:
    """Decoding settings shared by every method of one run.

    Attributes:
        temperature: 0 = greedy (argmax), else the sampling temperature (no top-k / top-p).
        max_new_tokens: at most this many new tokens per turn.
        seed: seed of the sampling generator (sampled runs only).
        reset_proposer_caches: before each prompt (every method, repeat and the warm-up), clear
            the proposers' cross-request state (the suffix proposer's cache of earlier outputs;
            :meth:`BenchModels.clear_proposer_caches`), so that no timing depends on what was
            decoded before, the warm-up included. The turns of one prompt still share it. False:
            the state carries over for the whole run, as in a long-running server.

    Raises:
        ValueError: a value :class:`SamplingParams` rejects.
    """

    temperature: float = 0.0
    max_new_tokens: int = 128
    seed: int = 0
    reset_proposer_caches: bool = True

    def __post_init__(self) -> None:
        self.sampling()

    def sampling(self) -> SamplingParams:
        """These settings as our engine's :class:`SamplingParams`."""
        return SamplingParams(temperature=self.temperature, seed=self.seed, max_new_tokens=self.max_new_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class BenchModels:
    """The loaded models, shared by our engine and the peers (loaded once).

    Attributes:
        target: the target: a causal LM (torch backend) or a llama.cpp model (llamacpp backend).
        draft: the draft, of the same backend, or None when no selected method needs one.
        tokenizer: the target's tokenizer (with a chat template).
        gguf: the target's GGUF file, for the llama.cpp peers (None: they are skipped).
        threads: CPU threads of the llama.cpp peers (None: every core).
    """

    target: PreTrainedModel | Any
    draft: PreTrainedModel | Any | None
    tokenizer: Any
    gguf: Any = None
    threads: int | None = None
    _llamas: dict[Any, Any] = field(default_factory=dict, repr=False)
    _generators: dict[str, SpeculativeGenerator] = field(default_factory=dict, repr=False)
    _drafts: dict[str, PreTrainedModel] = field(default_factory=dict, repr=False)
    _targets: dict[str, SpeculativeGenerator] = field(default_factory=dict, repr=False)
    _bytes: dict[int, int] = field(default_factory=dict, repr=False)

    def generator(
        self, method: str | None, factory: Callable[[BenchModels], Proposer] | None = None
    ) -> SpeculativeGenerator:
        """Our engine on :attr:`target` for the method named ``method`` (None: target only), its
        proposer built once by ``factory(self)`` (default: the registered method's
        :attr:`Method.factory`).

        Raises:
            ValueError: the proposer needs a draft model and none was loaded, or ``method`` names no
                proposer method.
        """
        key = method or "none"
        if key not in self._generators:
            if method is not None and factory is None:
                factory = METHODS[method].factory if method in METHODS else None
                if factory is None:
                    raise ValueError(f"{method!r} is not a proposer method")
            made = factory(self) if factory is not None else None
            self._generators[key] = timed(SpeculativeGenerator(self.target, tokenizer=self.tokenizer, proposer=made))
        return self._generators[key]

    def proposer_bytes(self, generator: SpeculativeGenerator) -> int:
        """Bytes of the weights ``generator``'s proposer holds beyond the target (0 without one),
        measured once per engine (:func:`specdecode.proposers.proposer_weight_bytes`)."""
        from specdecode.proposers import proposer_weight_bytes

        key = id(generator)
        if key not in self._bytes:
            proposer = generator.proposer
            self._bytes[key] = 0 if proposer is None else proposer_weight_bytes(proposer, generator.target.model)
        return self._bytes[key]

    def clear_proposer_caches(self) -> None:
        """Forget cross-request proposer state (a proposer's ``clear_cache()``, e.g. the suffix
        proposer's cache of earlier outputs) in every engine built so far."""
        for generator in self._generators.values():
            if generator.proposer is not None:
                generator.proposer.clear_cache()  # declared by every proposer (ProposerBase: a no-op)

    def require_draft(self) -> PreTrainedModel:
        """The draft model.

        Raises:
            ValueError: none was loaded.
        """
        if self.draft is None:
            raise ValueError("this method needs a draft model (--draft)")
        return self.draft

    def other_draft(self, spec: str) -> PreTrainedModel:
        """A draft other than :attr:`draft` (a method's ``draft=`` option: folder, ``.gguf`` or packaged
        name such as ``smollm2``), loaded once in the target's dtype.

        Raises:
            ModelNotFoundError: see :func:`specdecode.models.torch.hf_loading.resolve_model_dir`.
        """
        from specdecode.models.torch.hf_loading import load_model

        if spec not in self._drafts:
            self._drafts[spec] = load_model(spec, "draft", self.target.dtype, **self._placement())
        return self._drafts[spec]

    def _placement(self) -> dict[str, Any]:
        """``device`` and ``cuda_graphs`` of a model loaded beside :attr:`target`: where it runs and
        whether its runners replay CUDA graphs (:mod:`specdecode.models.torch.placement`)."""
        from specdecode.models.torch.static_runner import static_cache_settings

        return {"device": self.target.device, "cuda_graphs": static_cache_settings(self.target) is not None}

    def target_in(self, dtype: str) -> SpeculativeGenerator:
        """Our engine, target only, on a second copy of :attr:`target` loaded in ``dtype`` (the
        ``target(dtype=...)`` method: plain decoding in another dtype in the same run), loaded once;
        :attr:`target` itself when it already has that dtype.

        Raises:
            ValueError: an unknown dtype.
        """
        from specdecode.models.torch.hf_loading import load_model, parse_dtype

        if dtype not in self._targets:
            if parse_dtype(dtype) == self.target.dtype:  # the loaded target already is that dtype: no copy
                self._targets[dtype] = self.generator(None)
            else:
                model = load_model(self.target.config._name_or_path, "target", dtype, **self._placement())
                self._targets[dtype] = timed(SpeculativeGenerator(model, tokenizer=self.tokenizer))
        return self._targets[dtype]

    def llama(self, num_pred_tokens: int | None = None) -> Any:
        """llama-cpp-python's ``Llama`` on :attr:`gguf` (with ``LlamaPromptLookupDecoding`` of
        ``num_pred_tokens`` when given), loaded once each, with :attr:`threads`.

        Raises:
            ValueError: no GGUF file for the target.
        """
        if self.gguf is None:
            raise ValueError("the llama.cpp peers need the target as a GGUF file (--target FILE.gguf or the default)")
        if num_pred_tokens not in self._llamas:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            from specdecode.models.llamacpp.model import default_threads

            threads = self.threads or default_threads()
            draft = LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens) if num_pred_tokens else None
            self._llamas[num_pred_tokens] = Llama(
                str(self.gguf),
                n_ctx=8192,
                n_batch=512,
                n_threads=threads,
                n_threads_batch=threads,
                flash_attn=True,  # llama.cpp's own default (auto: on for the CPU); Llama's is off, and slower
                draft_model=draft,
                # with a draft model Llama scores every token but sizes its score buffer by this flag
                # (0.3.36): without it a prompt over n_batch tokens overflows the buffer
                logits_all=draft is not None,
                verbose=False,
            )
        return self._llamas[num_pred_tokens]

    @property
    def eos_token_ids(self) -> list[int]:
        """The tokens that end generation in our engine (generation config, config, tokenizer)."""
        return sorted(self.generator(None).eos_token_ids)


@dataclass(frozen=True)
class MethodOutput:
    """What a method returns for one turn.

    Attributes:
        token_ids: the new token ids (an ending EOS included).
        wall_time_s: seconds of the whole call, measured the same way for every method.
        stats: our engine's statistics, or None for a peer.
        proposer_bytes: bytes of the weights our engine's proposer holds beyond the target
            (:func:`specdecode.proposers.proposer_weight_bytes`), or None for a peer.
        num_speculative_tokens: the k it ran with (the sweep's, the method's own, or with neither
            the proposer's default), or None for a method without k.
        time_to_first_token_s: seconds from the call to its first new token, for a peer that
            streams (llama-cpp-python); ours is in ``stats``; None where not known.
    """

    token_ids: list[int]
    wall_time_s: float
    stats: SpecStats | None = None
    proposer_bytes: int | None = None
    num_speculative_tokens: int | None = None
    time_to_first_token_s: float | None = None


RunFn = Callable[[BenchModels, list[int], BenchSettings, "int | None", "str | None", bool], MethodOutput]


@dataclass(frozen=True)
class Method:
    """A registered method.

    Attributes:
        name: registry name, e.g. ``"draft_model"``.
        run: ``run(models, prompt_ids, settings, k, prediction)``.
        uses_k: takes ``num_speculative_tokens`` (one column per k of a sweep).
        peer: not our engine: an exception marks it skipped instead of stopping the benchmark.
        needs_draft: needs the draft model loaded.
        fixed_k: the k a chain method fixed with its ``k=`` option (it then takes none from a sweep).
        backends: the backends (``--backend``) it runs on.
        needs_gguf: runs the target's GGUF file (the llama.cpp peers): left out of the default
            methods when the target is not one.
        factory: for a method of our engine with a proposer, ``factory(models)`` builds the
            proposer (once per run: :meth:`BenchModels.generator`); None otherwise.
        uses_prediction: drafts from a turn's prediction (the ``prediction`` method and its variants,
            e.g. ``prediction+ungated``, ``prediction(k=32)``).
        by_default: among the methods a run takes when none are named (``prediction`` is not: it
            differs from prompt lookup only on prompts with a prediction, the ``code_edit`` category).
    """

    name: str
    run: RunFn
    uses_k: bool = False
    peer: bool = False
    needs_draft: bool = False
    fixed_k: int | None = None
    backends: tuple[str, ...] = ("torch", "llamacpp")
    needs_gguf: bool = False
    factory: Callable[[BenchModels], Proposer] | None = None
    uses_prediction: bool = False
    by_default: bool = True


@dataclass(frozen=True)
class Variant:
    """One column of the results: a method at one k (None for methods without k)."""

    method: Method
    k: int | None = None

    @property
    def label(self) -> str:
        return self.method.name if self.k is None else f"{self.method.name}[k={self.k}]"

    def run(
        self,
        models: BenchModels,
        prompt_ids: list[int],
        settings: BenchSettings,
        prediction: str | None = None,
        continues: bool = False,
    ) -> MethodOutput:
        """Decode one turn (see :class:`Method`); ``prediction``: the turn's expected answer, or None;
        ``continues``: the turn continues this method's previous sequence (a ``multi_turn`` prompt's
        later turn), whose cache it may reuse; else it is prefilled whole."""
        return self.method.run(models, prompt_ids, settings, self.k, prediction, continues)


METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    """Add (or replace) a method in :data:`METHODS`; returns it."""
    METHODS[method.name] = method
    return method


def _engine_run(
    proposer: str | None,
    schedule: str = "constant",
    tree: str | None = None,
    dtype: str | None = None,
    fixed_k: int | None = None,
    factory: Callable[[BenchModels], Proposer] | None = None,
    uses_prediction: bool = False,
) -> RunFn:
    """Our engine's run function for the method keyed ``proposer`` (None: target only), whose proposer
    ``factory`` builds; ``fixed_k`` fixes the method's k (the sweep's k is then ignored); with
    ``uses_prediction`` the turn's prediction drafts first (k: the sweep's, else the prediction's 16)."""

    def run(
        models: BenchModels,
        prompt_ids: list[int],
        settings: BenchSettings,
        k: int | None,
        prediction: str | None,
        continues: bool = False,
    ) -> MethodOutput:
        prediction = prediction if uses_prediction else None
        generator = models.generator(proposer, factory) if dtype is None else models.target_in(dtype)
        generator.reuse_prompt = continues  # prefix caching only within a multi_turn prompt
        sampling = settings.sampling()
        own_k = default_num_speculative_tokens(generator.proposer)
        default_k = PREDICTION_DEFAULT_K if prediction is not None else own_k
        used_k = (fixed_k or k or default_k) if proposer else None
        tic = time.perf_counter()
        result = generator.generate(
            prompt_ids,
            sampling,
            num_speculative_tokens=used_k,
            speculative=bool(proposer),
            schedule=schedule,
            tree=tree,
            prediction=prediction,
        )
        wall = time.perf_counter() - tic
        if tree is not None:
            used_k = None  # a tree's depth plays k's part
        return MethodOutput(result.token_ids, wall, result.stats, models.proposer_bytes(generator), used_k)

    return run


def register_proposer(
    name: str,
    factory: Callable[[BenchModels], Proposer],
    needs_draft: bool = False,
    backends: tuple[str, ...] = ("torch", "llamacpp"),
) -> Method:
    """Benchmark a proposer: ``factory(models)`` builds it; it becomes the method ``name`` (with k)."""
    run = _engine_run(name, factory=factory)
    return register_method(Method(name, run, uses_k=True, needs_draft=needs_draft, backends=backends, factory=factory))


def _hf_run(extra: Callable[[BenchModels, int], dict[str, Any]] | None = None, uses_k: bool = False) -> RunFn:
    """A peer: ``target.generate`` with the keyword arguments ``extra(models, k)`` adds (k: the
    sweep's, else :data:`~specdecode.proposers.base.DEFAULT_NUM_SPECULATIVE_TOKENS`)."""

    def run(
        models: BenchModels,
        prompt_ids: list[int],
        settings: BenchSettings,
        k: int | None,
        prediction: str | None,
        continues: bool = False,
    ) -> MethodOutput:
        k = k or DEFAULT_NUM_SPECULATIVE_TOKENS  # transformers' generate keeps no cache between calls
        kwargs = extra(models, k) if extra is not None else {}
        input_ids = torch.tensor([prompt_ids], dtype=torch.int64, device=models.target.device)  # (1, T)
        eos = models.eos_token_ids
        kwargs.update(max_new_tokens=settings.max_new_tokens, eos_token_id=eos or None, repetition_penalty=1.0)
        kwargs.update(pad_token_id=eos[0] if eos else None, do_sample=not settings.greedy)
        if not settings.greedy:
            kwargs.update(temperature=settings.temperature, top_k=0, top_p=1.0)
            torch.manual_seed(settings.seed)
        tic = time.perf_counter()
        with torch.inference_mode():
            out = models.target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        wall = time.perf_counter() - tic
        new_ids = out[0, input_ids.shape[1] :].tolist()
        return MethodOutput(new_ids, wall, num_speculative_tokens=k if uses_k else None)  # new tokens only

    return run


def _llama_run(prompt_lookup: bool) -> RunFn:
    """A peer: llama-cpp-python's ``Llama.generate`` on the target's GGUF file, from an empty cache
    (``reset()`` first: no prefix reuse between prompts or repeats) unless the turn ``continues`` a
    ``multi_turn`` prompt (then from the longest common prefix of its cache, as ``generate`` does),
    until EOS or max_new_tokens; greedy is ``temp=0``, sampling ``temp=T`` with top-k, top-p and
    min-p off."""

    def run(
        models: BenchModels,
        prompt_ids: list[int],
        settings: BenchSettings,
        k: int | None,
        prediction: str | None,
        continues: bool = False,
    ) -> MethodOutput:
        pred = (k or 10) if prompt_lookup else None  # 10: LlamaPromptLookupDecoding's default
        llm = models.llama(pred)
        eos = set(models.eos_token_ids)
        if not settings.greedy:
            llm.set_seed(settings.seed)
        tic = time.perf_counter()
        if not continues:
            llm.reset()
        new_ids: list[int] = []
        first: float | None = None
        for token in llm.generate(
            prompt_ids, temp=settings.temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0
        ):
            first = first if first is not None else time.perf_counter() - tic
            new_ids.append(int(token))
            if token in eos or len(new_ids) >= settings.max_new_tokens:
                break
        wall = time.perf_counter() - tic
        return MethodOutput(new_ids, wall, num_speculative_tokens=pred, time_to_first_token_s=first)

    return run


register_method(Method("target", _engine_run(None)))
for _spec in LIBRARY_PROPOSERS.values():  # every proposer of the library, with its default options
    register_proposer(
        _spec.name,
        lambda models, spec=_spec: spec.build(
            spec.make_config(), models.target, models.require_draft() if spec.needs_draft else None
        ),
        needs_draft=_spec.needs_draft,
        backends=_spec.backends,
    )


def _prediction_fallback(models: BenchModels) -> Proposer:
    """The ``prediction`` method's proposer where the prediction has nothing: prompt lookup after
    3-token matches (:data:`~specdecode.models.backends.DEFAULT_PROPOSER` on llama.cpp)."""
    return PromptLookupProposer(PromptLookupConfig(min_ngram=3, max_ngram=8))


register_method(
    Method(
        "prediction",
        _engine_run("prediction", factory=_prediction_fallback, uses_prediction=True),
        uses_k=True,
        factory=_prediction_fallback,
        uses_prediction=True,
        by_default=False,
    )
)
register_method(Method("llamacpp", _llama_run(False), peer=True, needs_gguf=True))
register_method(Method("llamacpp_prompt_lookup", _llama_run(True), uses_k=True, peer=True, needs_gguf=True))
TORCH = ("torch",)
register_method(Method("hf_generate", _hf_run(), peer=True, backends=TORCH))
register_method(
    Method(
        "hf_assisted",
        _hf_run(lambda m, k: {"assistant_model": m.require_draft()}),
        peer=True,
        needs_draft=True,
        backends=TORCH,
    )
)
register_method(
    Method(
        "hf_prompt_lookup",
        _hf_run(lambda m, k: {"prompt_lookup_num_tokens": k}, uses_k=True),
        uses_k=True,
        peer=True,
        backends=TORCH,
    )
)


_METHOD_SPEC = re.compile(
    r"^(?P<name>\w+)(?:\((?P<options>[^()]*)\))?(?:\+(?P<schedule>\w+))?(?:@(?P<tree>[\w:./-]+))?$"
)


def _option_value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"none": None, "true": True, "false": False}.get(text.lower(), text)


def split_methods(text: str) -> list[str]:
    """Split a ``--methods`` list at the commas outside parentheses:
    ``"target,draft_model(a=1,b=2)"`` -> ``["target", "draft_model(a=1,b=2)"]``."""
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += char
    items.append(current.strip())
    return [item for item in items if item]


def parse_method(text: str) -> Method:
    """The method named ``text``: a registered name, or ``PROPOSER(option=value,...)+SCHEDULE@TREE``.

    The option ``label=NAME`` names the method in the reports (instead of ``text``); ``k=N``
    fixes the method's k (a chain's; the method then takes no k from the sweep).

    ``@TREE`` drafts token trees (:func:`specdecode.tree.parse_tree`: ``@tree16``,
    ``@dynamic:16``, ``@shape.json``); a tree method takes no k.

    Options are validated here (before any model loads) by the proposer's config dataclass.

    Raises:
        ValueError: unknown method, proposer or schedule, or bad options (named in the message).
    """
    from specdecode.proposers import PROPOSERS as LIBRARY
    from specdecode.schedule import SCHEDULES

    text = text.replace(" ", "")
    if text in METHODS:
        return METHODS[text]
    match = _METHOD_SPEC.match(text)
    if match is not None and match["name"] == "hf_assisted" and match["options"]:
        return _hf_assisted_with(text, match["options"])
    if match is not None and match["name"] == "target" and match["options"]:
        return _target_in(text, match["options"])
    if match is None or match["name"] not in METHODS or METHODS[match["name"]].factory is None:
        raise ValueError(f"unknown method {text!r}; choose from {sorted(METHODS)}, or PROPOSER(option=value)+SCHEDULE")
    name, schedule, tree = match["name"], match["schedule"] or "constant", match["tree"]
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule in method {text!r} must be one of {list(SCHEDULES)}, got {schedule!r}")
    if tree is not None:
        from specdecode.tree import parse_tree

        parse_tree(tree)  # a bad tree fails before any model loads
    options: dict[str, Any] = {}
    for pair in filter(None, (match["options"] or "").split(",")):
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"method {text!r}: options are written key=value, got {pair!r}")
        options[key] = _option_value(value)
    fixed_k = options.pop("k", None)  # this method's own k, instead of the sweep's
    if fixed_k is not None and (tree is not None or not is_num_speculative_tokens(fixed_k)):
        raise ValueError(f"method {text!r}: k= must be an integer in {K_RANGE} on a chain (no @tree), got {fixed_k!r}")
    base = METHODS[name]
    key = label = text  # key: the engine's cache key (BenchModels.generator); label: the method's name in reports
    if "label" in options:  # a short name for the reports (a drafter path makes a long one)
        key = str(options.pop("label"))
        if not re.fullmatch(r"[\w.+-]+", key) or key in METHODS:
            raise ValueError(
                f"method {text!r}: label= must be letters, digits, '_', '.', '+' or '-' and not a method's name, "
                f"got {key!r}"
            )
        label = key + (f"+{match['schedule']}" if match["schedule"] else "") + (f"@{tree}" if tree else "")
    draft = options.pop("draft", None)
    if draft is not None:
        from specdecode.models.torch.hf_loading import resolve_model_dir

        if name not in LIBRARY or not LIBRARY[name].needs_draft:
            raise ValueError(f"method {text!r}: draft= is an option of proposers with a draft model only")
        draft = str(draft)
        resolve_model_dir(draft, "draft")  # a bad path fails before any model loads
    if options or draft is not None:
        if name not in LIBRARY:
            raise ValueError(f"method {name!r} takes no options")
        spec = LIBRARY[name]
        config = spec.make_config(**options)

        def factory(models: BenchModels) -> Proposer:
            if not spec.needs_draft:  # e.g. prompt_lookup(min_ngram=3): no draft model, none required
                return spec.build(config, models.target, None)
            other = models.other_draft(draft) if draft is not None else models.require_draft()
            return spec.build(config, models.target, other)

    else:
        factory = base.factory  # type: ignore[assignment]
    needs_draft = base.needs_draft and draft is None
    run = _engine_run(key, schedule, tree, fixed_k=fixed_k, factory=factory, uses_prediction=base.uses_prediction)
    return Method(
        label,
        run,
        uses_k=tree is None and fixed_k is None,
        needs_draft=needs_draft,
        fixed_k=fixed_k,
        backends=LIBRARY[name].backends if name in LIBRARY else base.backends,
        factory=factory,
        uses_prediction=base.uses_prediction,
    )


def _target_in(text: str, options: str) -> Method:
    """``target(dtype=DTYPE)``: plain decoding by our engine on a copy of the target in another dtype
    (e.g. the bfloat16 baseline in a float32 run). Its speedup column still divides ``target``.

    Raises:
        ValueError: an option other than ``dtype=``, or an unknown dtype.
    """
    from specdecode.models.torch.hf_loading import DTYPE_CHOICES

    key, sep, dtype = options.partition("=")
    if key != "dtype" or not sep or dtype not in DTYPE_CHOICES:
        raise ValueError(f"method {text!r}: target takes one option, dtype= one of {list(DTYPE_CHOICES)}")
    return Method(text, _engine_run(None, dtype=dtype), backends=("torch",))


def _hf_assisted_with(text: str, options: str) -> Method:
    """``hf_assisted(draft=SPEC)``: transformers' assisted generation with another draft; when its
    vocabulary differs from the target's, transformers' universal assisted generation (text
    re-tokenisation, ``tokenizer=`` and ``assistant_tokenizer=``) is used.

    Raises:
        ValueError: an option other than ``draft=``, or an unknown draft.
    """
    from specdecode.models.torch.hf_loading import load_tokenizer, resolve_model_dir

    key, sep, spec = options.partition("=")
    if key != "draft" or not sep or "," in spec:
        raise ValueError(f"method {text!r}: hf_assisted takes one option, draft=NAME_OR_PATH")
    draft_dir = resolve_model_dir(spec, "draft")  # a bad path fails before any model loads

    def extra(models: BenchModels, k: int | None) -> dict[str, Any]:
        draft = models.other_draft(spec)
        kwargs: dict[str, Any] = {"assistant_model": draft}
        if draft.config.vocab_size != models.target.config.vocab_size:
            kwargs.update(tokenizer=models.tokenizer, assistant_tokenizer=load_tokenizer(draft_dir))
        return kwargs

    return Method(text, _hf_run(extra), peer=True, backends=("torch",))


def expand(names: Sequence[str], ks: Sequence[int | None]) -> list[Variant]:
    """Columns for the named methods (see :func:`parse_method`): one per k for methods that take
    k, ``target`` first; ``ks = [None]``: one column each, at each proposer's default k.

    Raises:
        ValueError: an unknown method name, bad options, or an empty list.
    """
    if not names:
        raise ValueError(f"no methods given; choose from {sorted(METHODS)}")
    methods = [parse_method(n) for n in dict.fromkeys(names)]
    ordered = sorted(methods, key=lambda m: m.name != "target")
    return [Variant(m, k) for m in ordered for k in (ks if m.uses_k else [None])]
