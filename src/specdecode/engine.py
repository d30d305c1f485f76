"""The speculative decoding loop (docs/design.md §2) and its user-facing API.

One request, batch 1::

    prefill(target) -> first token (the target's own)
    loop:
      1. draft  = proposer.propose(context, k)            # DraftTokens: ids [k], probs [k, V] | None
      2. logits = target.forward(last + draft.ids)        # [k + 1, V]: one pass
      3. result = verify(draft, logits, sampling, gen)    # n accepted + 1 recovered / bonus token
      4. target.truncate(len_before + n); proposer.observe(result)
      5. stats.observe(k, n); emit the n + 1 tokens; stop on EOS / stop string / max tokens

Invariant: the target's cache holds every context token but the last, which is fed (with the
draft) by the next pass. Target-only decoding is the same loop with no proposer (k = 0).

A proposer with ``needs_target_features = True`` (Medusa, EAGLE) also gets the target's features
(final hidden states) of the positions kept, before ``observe``: all prompt rows after the
prefill, then the root and the accepted drafts of each pass; so after every step it knows the
features of context positions ``0 .. T - 2``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specdecode import loop_steps
from specdecode.constraints.spec import Constraint
from specdecode.constraints.state import ConstraintState
from specdecode.decode_state import DecodeState
from specdecode.draft_gate import PassCosts
from specdecode.limits import MAX_SPECULATIVE_TOKENS, check_num_speculative_tokens  # noqa: F401 (engine's names)
from specdecode.logprobs import TokenLogprob, check_num_logprobs
from specdecode.loop_steps import RowsForward
from specdecode.models.backends import backend_of, make_runner
from specdecode.models.torch.placement import device_clock
from specdecode.pass_observers import NO_DRAFT_PASSES, TargetPass
from specdecode.proposers.base import Proposer, check_proposer, default_num_speculative_tokens
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.proposers.prediction import encode_prediction, prediction_record, with_prediction
from specdecode.proposers.vocabulary import check_shared_vocabulary
from specdecode.sampling import SamplingParams
from specdecode.schedule import ScheduleConfig, SpeculationSchedule
from specdecode.stats import SpecStats
from specdecode.tree import TreeSpec, parse_tree, tree_attention
from specdecode.verify import VerifyResult, verify_tree

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class GenerationResult:
    """What one ``generate`` call returns.

    Attributes:
        text: the new text (special tokens skipped, cut before a stop string).
        token_ids: the new token ids (an EOS token that ended generation is included).
        finish_reason: ``"stop"`` (EOS or stop string) or ``"length"`` (max_new_tokens or the
            model's context length).
        stats: decoding statistics.
        logprobs: with ``logprobs=N``, one :class:`~specdecode.logprobs.TokenLogprob` per token of
            ``token_ids`` (the target's raw distribution, :mod:`specdecode.logprobs`); else None.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: SpecStats = field(default_factory=SpecStats)
    logprobs: list[TokenLogprob] | None = None

    def to_dict(self, tokenizer: Any = None) -> dict[str, Any]:
        """A JSON-ready dict; ``logprobs`` (with each token's text given a ``tokenizer``) only when reported."""
        out = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            **self.stats.to_dict(),
        }
        if self.logprobs is not None:
            out["logprobs"] = [entry.to_dict(tokenizer) for entry in self.logprobs]
        return out


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """End-of-sequence ids from the generation config, the model config (or a backend model's own
    ``eos_token_ids``, llama.cpp's EOS and EOT) and the tokenizer."""
    ids: set[int] = set(getattr(model, "eos_token_ids", ()))
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return frozenset(ids)


def needs_features(proposer: Proposer | None) -> bool:
    """Whether ``proposer`` reads the target's features (its ``needs_target_features``; False for None)."""
    return proposer is not None and proposer.needs_target_features


def _pass(out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logits, features or None)`` of a target pass made with or without ``return_hidden``."""
    return out if isinstance(out, tuple) else (out, None)


@dataclass(frozen=True)
class CheckedRequest:
    """The parameters of one generation, checked once (:func:`check_request`).

    Attributes:
        num_speculative_tokens: k in :data:`~specdecode.limits.K_RANGE`, or None for the proposer's own.
        tree: the compiled tree (:func:`~specdecode.tree.parse_tree`), or None for chains.
        logprobs: N in [0, 20], or None for none.
        prediction: the expected answer (OpenAI's Predicted Outputs: :mod:`specdecode.proposers.prediction`),
            a string or token ids, or None.
    """

    num_speculative_tokens: int | None = None
    tree: TreeSpec | None = None
    logprobs: int | None = None
    prediction: str | tuple[int, ...] | None = None


def check_request(
    prompt: str | Sequence[int] | None,
    num_speculative_tokens: int | None = None,
    tree: str | TreeSpec | None = None,
    logprobs: int | None = None,
    names: dict[str, str] | None = None,
    prediction: str | Sequence[int] | None = None,
) -> CheckedRequest:
    """Check a generation's parameters once, before any model is needed (arguments as in
    :meth:`SpeculativeGenerator.generate`; ``prompt`` None: not checked; ``names``: how messages
    name a parameter, e.g. ``{"logprobs": "--logprobs"}``).

    Raises:
        ValueError: an empty string prompt, k outside :data:`~specdecode.limits.K_RANGE`, a bad tree,
            ``logprobs`` outside [0, 20], or a ``prediction`` that is neither a string nor a list of
            token ids (the message names the parameter).
    """
    names = names or {}
    if prediction is not None and not isinstance(prediction, str):
        if not isinstance(prediction, Sequence) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in prediction
        ):
            raise ValueError(
                f"{names.get('prediction', 'prediction')} must be a string or a list of token ids, "
                f"got {type(prediction).__name__}"
            )
        prediction = tuple(prediction)
    if isinstance(prompt, str) and not prompt:
        raise ValueError(f"{names.get('prompt', 'prompt')} must not be empty")
    if num_speculative_tokens is not None:
        check_num_speculative_tokens(num_speculative_tokens)
    spec_tree = parse_tree(tree) if tree is not None else None
    check_num_logprobs(logprobs, names.get("logprobs", "logprobs"))
    return CheckedRequest(num_speculative_tokens, spec_tree, logprobs, prediction)


class SpeculativeGenerator:
    """Lossless speculative decoding with a target model and a proposer.

    Greedy output equals the target's own greedy decoding; sampled output follows the target's
    distribution exactly (modified rejection sampling, Leviathan et al. 2023).

    Args:
        target: the target: a ``transformers`` causal LM (torch backend) or a
            :class:`~specdecode.models.llamacpp.LlamaCppModel` (llamacpp backend); it runs through
            its runner (:func:`~specdecode.models.backends.make_runner`).
        draft: a draft model of the same backend with the target's vocabulary (becomes a
            :class:`~specdecode.proposers.draft_model.DraftModelProposer`), or None.
        tokenizer: the target's tokenizer; needed for string prompts, text and stop strings.
        proposer: any :class:`~specdecode.proposers.base.Proposer` (instead of ``draft``).

    Attributes:
        reuse_prompt: prefix caching across generations, where the target's runner keeps its
            cells (``capabilities.prompt_reuse``): on llama.cpp a prompt that shares a prefix with
            the previous sequence (a conversation's next turn, the same system prompt) prefills
            only the rest, as llama-cpp-python's ``Llama.generate`` does (``stats.cached_tokens``);
            on llama.cpp and the eager torch runner the previous generation's own prompt skips the
            prefill (``stats.prefill_reused``). Exact bit for bit (:mod:`specdecode.models.first_pass`,
            :meth:`LlamaCppRunner.restart <specdecode.models.llamacpp.LlamaCppRunner.restart>`).
            Default True; False prefills every prompt whole (the bench and the cost measurements,
            which time whole generations).

    Raises:
        IncompatibleModelsError: the draft's vocabulary size differs from the target's.
        ValueError: both ``draft`` and ``proposer`` were given.
        TypeError: ``proposer`` does not declare the :class:`~specdecode.proposers.base.Proposer`
            protocol's members (subclass :class:`~specdecode.proposers.base.ProposerBase`).
    """

    def __init__(
        self,
        target: PreTrainedModel | Any,
        draft: PreTrainedModel | Any | None = None,
        tokenizer: Any = None,
        proposer: Proposer | None = None,
    ) -> None:
        if draft is not None and proposer is not None:
            raise ValueError("give either draft= or proposer=, not both")
        self.target = make_runner(target)
        self.backend = backend_of(target)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids(target, tokenizer)
        self.grammar_aware_drafting = True  # under a constraint: see ConstraintState (False: masks only)
        self.pass_costs = PassCosts()  # what the target's passes cost on this machine: the draft gate reads them
        self.reuse_prompt = True
        if draft is not None:
            proposer = DraftModelProposer(draft)
        if proposer is not None:  # every way of building a generator comes here: the checks always run
            check_proposer(proposer)
            if proposer.needs_target_features:  # declared by the runner, refused naming both
                self.target.capabilities.require("returns_hidden", self.target, f"proposer {proposer.name!r}")
            check_shared_vocabulary(self.target, proposer)
        self.proposer = proposer

    @classmethod
    def from_loaded(cls, loaded: Any) -> SpeculativeGenerator:
        """A generator of models :func:`specdecode.load.load_models` loaded: its target, tokenizer and
        ``built`` proposer, through the constructor (its checks are a few attribute reads)."""
        return cls(loaded.target, tokenizer=loaded.tokenizer, proposer=loaded.built)

    @classmethod
    def from_pretrained(
        cls,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        dtype: str | torch.dtype = "auto",
        proposer: str | None = "auto",
        backend: str = "auto",
        threads: int | None = None,
        exact: bool | None = None,
        device: str = "auto",
        cuda_graphs: bool = True,
        **proposer_options: Any,
    ) -> SpeculativeGenerator:
        """Load the target (and the draft, if the proposer needs one) from local paths.

        Args:
            target: HF model folder or ``.gguf`` file; None for the default target
                (Qwen2.5-Coder-1.5B-Instruct).
            draft: HF model folder, ``.gguf`` file or packaged model name (``"smollm2"``); None for
                the default draft (Qwen2.5-Coder-0.5B-Instruct). Loaded only for proposers that need
                one. With ``proposer="draft_model"``, a draft whose vocabulary differs from the
                target's drafts through ``"cross_tokenizer"`` instead (a notice on stderr).
            dtype: ``"auto"`` (bfloat16 where the CPU multiplies it natively, else float32 with
                oneDNN linears: :mod:`specdecode.models.torch.cpu`), ``"bfloat16"`` or ``"float32"`` (or
                the torch dtype).
            proposer: a name from :data:`specdecode.proposers.PROPOSERS` (``"draft_model"``,
                ``"prompt_lookup"``, ...), None for a target-only generator, or ``"auto"`` (default):
                ``draft_model`` when a ``draft`` is named, else the backend's measured best
                (:data:`~specdecode.models.backends.DEFAULT_PROPOSER`: ``prompt_lookup`` after 3-token
                matches on llama.cpp, ``draft_model`` on torch), options given here taking precedence
                (options of the draft model's only, such as ``prompt_lookup_min``, ask for ``draft_model``).
            backend: ``"auto"``, ``"torch"`` or ``"llamacpp"``
                (:func:`~specdecode.models.backends.resolve_backend`: ``auto`` runs ``.gguf`` files
                and the default pair on llama.cpp on a CPU, Hugging Face folders and GPUs on torch;
                a proposer llama.cpp cannot serve runs on torch, as in ``specdecode serve``). The
                load path is :mod:`specdecode.load` (:func:`~specdecode.load.plan_models`, then
                :func:`~specdecode.load.load_models`).
            threads: CPU threads of the llamacpp backend (None: every core this process may use).
            exact: every row of a verification pass bit-identical to a one-token pass, so that
                greedy output is the target alone's token for token and sampling uses its own
                probabilities: llama.cpp's batch-invariant chunks (:mod:`specdecode.models.llamacpp.model`);
                on torch, a bfloat16 / float16 target runs exact passes (:mod:`specdecode.models.torch.exact`
                on the CPU; fixed-width passes on a GPU; float32 runs as it is). False takes the
                fastest kernels (greedy output equal up to near-ties). None (default): on, except for
                torch on a GPU, where it costs more than 15% of plain decoding's speed
                (:func:`specdecode.load.default_exact`, docs/usage.md#exactness).
            device: where torch runs the models: ``"auto"`` (default: the CUDA GPU where torch sees
                one, else the CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"``
                (:func:`~specdecode.models.torch.placement.resolve_device`); ``"cpu"`` also keeps a CUDA
                llama.cpp build's layers on the CPU.
            cuda_graphs: torch on a CUDA device: static KV cache and CUDA graphs per pass width
                (default; :mod:`specdecode.models.torch.static_runner`), False for eager passes.
            proposer_options: the proposer's own options, fields of its config dataclass
                (e.g. ``max_ngram=4`` for prompt lookup, ``drafter=DIR`` for ``"medusa"`` /
                ``"eagle"``); validated before any weights load.

        Raises:
            ModelNotFoundError: a path does not exist, or a default model is not installed.
            ValueError: unknown dtype, device, backend or proposer, a device this torch cannot use, bad
                proposer options, or a proposer the
                backend cannot serve (the message names both).
            IncompatibleModelsError: the draft's tokenizer cannot encode the target's text.
        """
        from specdecode.load import load_models, plan_models

        plan = plan_models(
            target,
            draft,
            proposer,
            backend,
            dtype,
            threads,
            exact,
            device=device,
            cuda_graphs=cuda_graphs,
            **proposer_options,
        )
        return cls.from_loaded(load_models(plan))

    @property
    def dtype(self) -> str:
        """The target's weights, for records: a torch dtype (``"bfloat16"``) or a GGUF file type."""
        return self.target.dtype

    # ------------------------------------------------------------------ prompts
    def encode_prompt(self, prompt: str | Sequence[int], raw: bool = False) -> torch.Tensor:
        """Token ids of a prompt: int64 ``[T]``.

        A string gets the tokenizer's chat template (one user turn) unless ``raw``; a list of
        token ids is used as is.

        Raises:
            ValueError: empty prompt, ids outside the vocabulary, a string without a tokenizer, or
                a prompt that fills the target's context.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the generator has no tokenizer; pass token ids")
            if not raw and getattr(self.tokenizer, "chat_template", None):
                prompt = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
                )
            ids = self.tokenizer.encode(prompt, add_special_tokens=raw)
        else:
            ids = [int(i) for i in prompt]
        if not ids:
            raise ValueError("prompt must contain at least one token")
        V = self.target.vocab_size
        if min(ids) < 0 or max(ids) >= V:
            raise ValueError(f"prompt token ids must be in [0, {V}), got min {min(ids)}, max {max(ids)}")
        if len(ids) >= self.target.max_length:
            raise ValueError(f"prompt has {len(ids)} tokens; the target's context is {self.target.max_length}")
        return torch.tensor(ids, dtype=torch.int64)

    # ------------------------------------------------------------------ the loop
    def _rows_forward(self, features: bool, restart: bool) -> RowsForward:
        """The target's runner as :func:`~specdecode.loop_steps.prefill` and
        :func:`~specdecode.loop_steps.score` take it: a batch of one row (features when ``features``;
        the prefill through the runner's ``restart`` when ``restart``: prompt reuse)."""
        target = self.target

        def forward(
            inputs: list[torch.Tensor], num_logits: list[int], hints: list[torch.Tensor | None] | None
        ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
            if hints is None and restart:  # the prefill, answered from the previous one if the prompt is the same
                out = target.restart(inputs[0], num_logits=num_logits[0], return_hidden=features)  # type: ignore[attr-defined]
            elif hints is None:  # the prefill
                out = target.forward(inputs[0], num_logits=num_logits[0], return_hidden=features)
            else:
                out = target.forward(inputs[0], num_logits[0], return_hidden=features, greedy_draft=hints[0])
            logits, hidden = _pass(out)
            return [logits], [hidden]

        return forward

    def _decode(
        self, state: DecodeState, schedule: SpeculationSchedule, tree: TreeSpec | None = None
    ) -> Iterator[tuple[list[int], str]]:
        """Run ``state`` to its end; yield each target pass's ``(new token ids, new text)``."""
        target, proposer, stats = self.target, state.proposer, state.stats
        restart = self.reuse_prompt and target.capabilities.prompt_reuse
        if not restart:
            target.reset()
        if proposer is not None:
            proposer.reset()
        forward = self._rows_forward(needs_features(proposer), restart)
        clock = device_clock(target.device)  # synchronized off the CPU: each side is charged its own work

        (result,), (logits,) = loop_steps.prefill([state], forward, clock)  # (1, V); the first token
        stats.prefill_reused = restart and target.reused_prompt  # type: ignore[attr-defined]
        stats.cached_tokens = target.cached_tokens if restart else 0  # type: ignore[attr-defined]
        chain = proposer is not None and tree is None  # the widths of the passes to come: 1 + drafted,
        target.prepare_widths(range(1, schedule.k + 2) if chain else (1,))  # up to the starting k; CUDA graphs
        yield state.append(result.tokens, logits)  # logits: the rows of log-probabilities, if asked
        while state.finish_reason is None:
            # context[:T] is known; the target has cached context[:T - 1].
            room = state.room()
            if tree is not None and proposer is not None and room > 0:
                result, kept_logits = self._tree_step(state, tree, room, clock)  # 1.-5.
                yield state.append(result.tokens, kept_logits)
                continue
            k_step = min(schedule.next_k(), room) if proposer is not None else 0
            tic = clock()
            draft = schedule.trim(state.propose(k_step))  # 1. (the draft gate may shorten a copied draft)
            toc = clock()
            stats.draft_time_s += toc - tic
            (logits,), (hidden,), seconds = loop_steps.score([state], [draft], forward, clock)  # 2. one pass
            # (k+1, V), features (k+1, H) | None; fewer rows only if greedy and a draft token was wrong
            result = loop_steps.verify_truncate(state, draft, logits, hidden, target.truncate)  # 3.-4.
            n = result.num_accepted
            step_s = clock() - tic
            self.pass_costs.observe(  # what passes cost here
                len(draft) + 1, int(logits.shape[0]), seconds, step_s, whole=not draft.early_stop
            )
            if proposer is not None:
                schedule.update(len(draft), n, step_s, draft_time_s=toc - tic, tokens=result.tokens)
            stats.plain_steps, stats.fallbacks = schedule.plain_steps, schedule.fallbacks
            stats.gated_draft_tokens = schedule.gated_tokens
            yield state.append(result.tokens, logits)  # 5. (rows 0 .. n score the n + 1 tokens)

    @staticmethod
    def _check_tree(tree: str | TreeSpec, proposer: Proposer, plan: SpeculationSchedule) -> TreeSpec:
        spec = parse_tree(tree)
        if not proposer.supports_tree:
            raise ValueError(f"tree: the {proposer.name!r} proposer drafts chains only (supports_tree is False)")
        if plan.kind not in ("constant", "ungated"):
            raise ValueError(f"tree: token trees use a fixed shape; schedule must be 'constant', got {plan.kind!r}")
        return spec

    def _tree_step(
        self, state: DecodeState, tree: TreeSpec, room: int, clock: Callable[[], float] = time.perf_counter
    ) -> tuple[VerifyResult, torch.Tensor | None]:
        """Steps 1-4 of the loop with a token tree (:mod:`specdecode.tree`), at most ``room`` deep,
        timed by ``clock`` (the loop's). Returns the result and, when the state reports
        log-probabilities, the logits rows of the root and the kept path ``[n + 1, V]`` (else None)."""
        target, proposer, stats = self.target, state.proposer, state.stats
        assert proposer is not None
        tic = clock()
        draft = proposer.propose_tree(state.context[: state.T], tree, state.sampling, state.generator)  # type: ignore[attr-defined]
        if draft.depth > room:  # near max_new_tokens / the context limit
            draft = draft.prune(room)
        if state.constraint is not None:  # branches checked against the grammar (forbidden nodes cut), forced
            draft = state.constraint.shape_tree(draft)  # tokens added as chains, no deeper than the tree
        toc = clock()
        depths, mask = tree_attention(draft.parents)  # (N + 1,), (N + 1, N + 1): node 0 is context[-1]
        cached = target.length  # T - 1
        attend = torch.cat([torch.ones(len(draft) + 1, cached, dtype=torch.bool), mask], dim=1)  # (N + 1, T + N)
        features = needs_features(proposer)
        ids = state.step_input(draft.ids)  # (N + 1,)
        # a walking runner (llama.cpp) may decode only the nodes the raw greedy walk reaches (not under a constraint)
        greedy = state.sampling.greedy and state.constraint is None
        logits, hidden = _pass(
            target.forward_masked(ids, cached + depths, attend, return_hidden=features, greedy=greedy)
        )  # 2.
        stats.draft_time_s += toc - tic
        state.target_pass(TargetPass((len(draft) + 1,), clock() - toc))
        if state.constraint is not None:  # 3. the target's distribution masked per node
            result = state.constraint.verify_tree(draft, logits, state.sampling, state.generator)
        else:
            result = verify_tree(draft.ids, draft.parents, logits, state.sampling, state.generator)  # 3.
        kept = torch.cat([torch.zeros(1, dtype=torch.int64), result.path])  # (n + 1,): root + accepted path
        target.compact(cached + kept)  # 4.
        kept_features = hidden[kept.to(hidden.device)] if hidden is not None else None  # (n + 1, H)
        state.after_verify(len(draft), result, kept_features, depth=int(depths.max()))
        return result, logits[kept.to(logits.device)] if state.logprobs is not None else None

    def _constraint_state(self, constraint: Constraint | None) -> ConstraintState | None:
        """A fresh grammar state for one generation (None without a constraint)."""
        if constraint is None:
            return None
        from specdecode.constraints.build import make_constraint_state

        return make_constraint_state(
            constraint, self.tokenizer, self.target.vocab_size, self.eos_token_ids, self.grammar_aware_drafting
        )

    def stream_tokens(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None = None,
        num_speculative_tokens: int | None = None,
        raw: bool = False,
        speculative: bool = True,
        schedule: ScheduleConfig | str = "constant",
        tree: str | TreeSpec | None = None,
        logprobs: int | None = None,
        constraint: Constraint | None = None,
        prediction: str | Sequence[int] | None = None,
    ) -> Iterator[tuple[list[int], str, GenerationResult]]:
        """The generation as it happens: per target pass, ``(new token ids, new text, result so far)``.

        The last item's result is final (its ``finish_reason`` is set); with ``logprobs``, the
        new tokens' log-probabilities are the last ``len(new token ids)`` of its ``logprobs``.
        Arguments as in :meth:`generate`.
        """
        request = check_request(prompt, num_speculative_tokens, tree, logprobs, prediction=prediction)
        yield from self.stream_request(prompt, request, sampling, raw, speculative, schedule, constraint)

    def stream_request(
        self,
        prompt: str | Sequence[int],
        request: CheckedRequest,
        sampling: SamplingParams | None = None,
        raw: bool = False,
        speculative: bool = True,
        schedule: ScheduleConfig | str = "constant",
        constraint: Constraint | None = None,
    ) -> Iterator[tuple[list[int], str, GenerationResult]]:
        """:meth:`stream_tokens` of a request :func:`check_request` checked (``specdecode generate``
        checks it before loading the models): k, the tree and ``logprobs`` are not checked again.

        Raises:
            ValueError: a tree the proposer or schedule cannot draft, or a prompt the target
                cannot take (see :meth:`encode_prompt`).
        """
        start = time.perf_counter()
        sampling = sampling or SamplingParams()
        prompt_ids = self.encode_prompt(prompt, raw=raw)
        proposer = self.proposer if speculative else None
        prediction = None
        if request.prediction is not None:
            prediction = encode_prediction(request.prediction, self.tokenizer, self.target.vocab_size)
            if speculative:  # the prediction drafts first, the generator's proposer where it has nothing
                proposer = with_prediction(proposer, prediction, int(prompt_ids.shape[0]))
        k = request.num_speculative_tokens or default_num_speculative_tokens(proposer)
        self.pass_costs.chunk = self.target.capabilities.greedy_stop_rows  # where a wrong draft stops a pass
        self.pass_costs.then = self.target.capabilities.greedy_stop_then
        plan = SpeculationSchedule(k, schedule, self.pass_costs, greedy=sampling.greedy)
        tree = request.tree
        spec_tree = self._check_tree(tree, proposer, plan) if tree is not None and proposer is not None else None
        if spec_tree is not None:
            self.target.capabilities.require("trees", self.target, "tree=")
        stats = SpecStats(
            num_speculative_tokens=(spec_tree.depth if spec_tree else plan.max_k) if proposer else 0,
            proposer=proposer.name if proposer else "none",
            schedule=plan.kind if proposer else "none",
            tree=spec_tree.name if spec_tree else "none",
            dtype=self.dtype,
            prompt_tokens=int(prompt_ids.shape[0]),
            prediction=prediction_record(proposer, prediction),
        )
        state = DecodeState(
            prompt_ids,
            sampling,
            self.target.max_length,
            plan.max_k,
            proposer=proposer,
            eos_token_ids=self.eos_token_ids,
            tokenizer=self.tokenizer,
            stats=stats,
            num_logprobs=request.logprobs,
            constraint=self._constraint_state(constraint),
            device=self.target.device,  # where the logits live: drafts' probs are moved there once
        )
        result = GenerationResult("", [], "length", stats, state.logprobs)
        steps = self._decode(state, plan, spec_tree)
        try:
            for new_ids, new_text in steps:
                if not result.token_ids:
                    stats.time_to_first_token_s = time.perf_counter() - start
                result.token_ids.extend(new_ids)
                result.text += new_text
                result.finish_reason = state.finish_reason or "length"
                stats.wall_time_s = time.perf_counter() - start
                yield new_ids, new_text, result
        finally:
            steps.close()
            if proposer is not None:  # its forwards after this request (a cost probe, ...) are no one's
                proposer.passes = NO_DRAFT_PASSES  # type: ignore[attr-defined]

    def generate(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None = None,
        num_speculative_tokens: int | None = None,
        raw: bool = False,
        speculative: bool = True,
        schedule: ScheduleConfig | str = "constant",
        tree: str | TreeSpec | None = None,
        logprobs: int | None = None,
        constraint: Constraint | None = None,
        prediction: str | Sequence[int] | None = None,
    ) -> GenerationResult:
        """Generate a continuation of ``prompt``.

        Args:
            prompt: a string (chat template applied unless ``raw``) or a list of token ids.
            sampling: :class:`SamplingParams` (default: greedy, 128 new tokens).
            num_speculative_tokens: k, tokens drafted per step, in :data:`~specdecode.limits.K_RANGE` (the
                starting k of a ``heuristic`` or ``adaptive`` schedule); None (default): the proposer's own default
                (:func:`~specdecode.proposers.base.default_num_speculative_tokens`: 4, or 2 for
                the EAGLE head and Medusa heads, measured best on this project's reference CPU).
            raw: do not apply the chat template to a string prompt.
            speculative: False decodes with the target alone (same loop, no proposer).
            schedule: how k changes from step to step: ``"constant"``, ``"heuristic"`` (grow
                after a fully accepted draft, shrink after a rejection) or ``"adaptive"`` (the
                heuristic plus a measured fallback to plain decoding), or a
                :class:`~specdecode.schedule.ScheduleConfig`. See :mod:`specdecode.schedule`.
            tree: draft a token tree instead of a chain (:mod:`specdecode.tree`): a static shape's
                name (``"default"``, ``"tree16"``, ...), a JSON file of paths, ``"dynamic:N"``
                (EAGLE-2 style, N nodes), or a compiled tree. Needs a proposer with
                ``propose_tree`` and the ``constant`` schedule; ``num_speculative_tokens`` is
                then unused (the tree's depth plays its part).
            logprobs: N in [0, 20]: report every emitted token's log-probability and the N most
                likely alternatives at its position (``GenerationResult.logprobs``), taken from the
                target's raw distribution (log_softmax of its float32 logits, before temperature,
                top-k and top-p; :mod:`specdecode.logprobs`), the same with speculation on or off,
                chains or trees; None (default): off, at no cost.
            constraint: structured output (:mod:`specdecode.constraints`): a
                :class:`~specdecode.constraints.JsonSchema`, :class:`~specdecode.constraints.Regex`
                or :class:`~specdecode.constraints.Grammar`. The output is then distributed exactly
                as constrained decoding by the target alone (its logits masked to the tokens the
                grammar allows at every position, before temperature / top-k / top-p; greedy: the
                masked argmax), with speculation on or off; drafts are cut at a forbidden token and
                the grammar's forced tokens are drafted for free (:attr:`grammar_aware_drafting`).
                Needs the target's fast tokenizer. None (default): unconstrained.
            prediction: the expected answer, a string or token ids (OpenAI's Predicted Outputs,
                :mod:`specdecode.proposers.prediction`): its tokens are drafted first where the answer
                follows it (k defaults to 16 then), the generator's proposer drafts where it has nothing.
                The output is still the target's own (greedy) or distributed as the target's
                (sampled); ``result.stats.prediction`` says how many predicted tokens were accepted.
                Ignored with ``speculative=False`` (its record then counts every token rejected).

        Returns:
            :class:`GenerationResult`. Two calls with the same seed return the same result.

        Raises:
            ValueError: bad prompt or parameter (the message names it).
            ConstraintError: a constraint llguidance rejects (a ``ValueError`` naming the parameter).
        """
        result = GenerationResult("", [], "length")
        for _, _, result in self.stream_tokens(
            prompt, sampling, num_speculative_tokens, raw, speculative, schedule, tree, logprobs, constraint, prediction
        ):
            pass
        return result

    def stream(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None = None,
        num_speculative_tokens: int | None = None,
        raw: bool = False,
        speculative: bool = True,
        schedule: ScheduleConfig | str = "constant",
        tree: str | TreeSpec | None = None,
        logprobs: int | None = None,
        constraint: Constraint | None = None,
        prediction: str | Sequence[int] | None = None,
    ) -> Iterator[str]:
        """Yield the generated text piece by piece (arguments as in :meth:`generate`)."""
        for _, piece, _ in self.stream_tokens(
            prompt, sampling, num_speculative_tokens, raw, speculative, schedule, tree, logprobs, constraint, prediction
        ):
            if piece:
                yield piece
