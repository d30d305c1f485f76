"""The one protocol every proposer speaks (docs/design.md §2).

The engine calls ``reset()`` once per request, then per step ``propose(...)`` and, after
verification, ``observe(...)``. It never branches on a proposer's name.

Every capability a proposer may have is declared on the protocol, with its default in
:class:`ProposerBase` (which the shipped proposers subclass); the engine and the server read the
attributes, never probe for them:

- ``supports_tree`` (default False): the proposer can offer several candidates per position with
  ``propose_tree(context, tree, sampling, generator) -> DraftTree`` (:mod:`specdecode.tree`;
  ``tree`` is a compiled ``TreeShape`` or a ``DynamicTree``); the engine uses it for ``tree=``
  requests and refuses a tree for a proposer without it. ``observe`` then gets a result whose
  ``path`` names the accepted nodes.
- ``needs_target_features`` (default False): the proposer drafts from the target's **features**
  (Medusa heads, an EAGLE head) and has ``observe_features(hidden)``. The engine then runs the
  target with ``return_hidden=True`` and, before each ``observe``, passes the features (``[m, H]``,
  the target's dtype and device: the final hidden states after the final norm, which the LM head
  turns into logits; ``f_p`` scores token ``p + 1``) of the positions that were kept, in order:
  after the prefill all T prompt positions; after a chain pass the root (the context's last token)
  and the n accepted drafts; after a tree pass the root and the accepted path. So when ``propose``
  / ``propose_tree`` gets a context of T tokens, the proposer has received exactly the features of
  positions ``0 .. T - 2`` (rejected drafts never reach it: rollback is free). The batched server
  passes them the same way, per sequence.
- ``default_num_speculative_tokens`` (default :data:`DEFAULT_NUM_SPECULATIVE_TOKENS`, an int in
  :data:`~specdecode.limits.K_RANGE`): the k that :class:`~specdecode.engine.SpeculativeGenerator`
  (and so the CLI, the API and ``specdecode bench``) uses when the caller gives none. It is a
  measured choice (the proposer's docstring says where), not a limit: any k in that range still works.

- ``describe()`` (default :data:`~specdecode.pass_observers.NO_PROPOSER`): what records say about
  it, a :class:`~specdecode.pass_observers.ProposerInfo` read once per request: ``quantization``
  (the ``draft_quantization`` statistic: ``"int8"`` an int8 draft, ``"int8-head"`` a drafter's int8
  LM-head rows, ``"none"``) and ``pass_kind`` (the cost-table curve that prices its model's
  forwards, :mod:`specdecode.cost.table`: ``"draft"``, ``"eagle"``, ``"medusa"``).
- ``clear_cache()`` (default: nothing): forget state kept *across* requests (the suffix proposer's
  cache of earlier outputs); ``reset`` forgets one request's.

A proposer with a model of its own reports each forward of it (tokens fed) to ``self.passes``, a
sink the loop sets per request (:class:`~specdecode.pass_observers.DraftPasses`: ``passes(width)``;
:data:`~specdecode.pass_observers.NO_DRAFT_PASSES` outside a request); a proposer that wraps another
hands its ``passes`` on to it. The loop never asks a proposer what it did: the sink's observers
(the request's statistics) hear it as it happens (:mod:`specdecode.pass_observers`).

Three more attributes have defaults in :class:`ProposerBase` without being part of the protocol:
``passes`` (above), ``vocab_size`` (the vocabulary its drafted ids come from, checked against the
target's; None: any, it drafts ids from the context) and ``drafter`` (the trained torch module a features proposer
drafts with, whose width the server's cost probe reads; None otherwise).

A proposer of one's own subclasses :class:`ProposerBase` (or declares every attribute of
:class:`Proposer` itself); :func:`check_proposer` says what is missing otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specdecode.limits import check_num_speculative_tokens
from specdecode.pass_observers import NO_DRAFT_PASSES, NO_PROPOSER, DraftPasses, ProposerInfo
from specdecode.sampling import SamplingParams
from specdecode.verify import VerifyResult

DEFAULT_NUM_SPECULATIVE_TOKENS = 4
"""k when neither the caller nor the proposer names one."""


def default_num_speculative_tokens(proposer: object | None) -> int:
    """The k to draft with when the caller gives none: the proposer's
    ``default_num_speculative_tokens`` (:data:`DEFAULT_NUM_SPECULATIVE_TOKENS` for ``None``,
    decoding without a proposer).

    Raises:
        ValueError: the proposer's attribute is not an integer in :data:`~specdecode.limits.K_RANGE`.
    """
    if proposer is None:
        return DEFAULT_NUM_SPECULATIVE_TOKENS
    k = proposer.default_num_speculative_tokens  # type: ignore[attr-defined]
    name = getattr(proposer, "name", type(proposer).__name__)
    return check_num_speculative_tokens(k, f"proposer {name!r}: default_num_speculative_tokens")


PREDICTION = "prediction"
"""The evidence source of a client's prediction's drafts (:mod:`specdecode.proposers.prediction`):
the draft gate (:mod:`specdecode.draft_gate`) gives it priors of its own, higher than prompt
lookup's (an edit's answer copies its prediction)."""


@dataclass(frozen=True)
class DraftTokens:
    """Tokens a proposer drafts for one step.

    Devices (docs/design.md §2b): a proposer hands ``ids`` over on the CPU and ``probs`` on the
    device it computed them on (its model's; the target's in the usual set-up);
    :meth:`~specdecode.decode_state.DecodeState.propose` moves them once (:meth:`to`).

    Attributes:
        ids: int64 ``[k]`` drafted tokens (k may be 0: nothing to propose this step), on the CPU.
        probs: float32 ``[k, V]`` the distributions q the ids were sampled from, or None for a
            deterministic proposal (treated as one-hot q by the verifier; always None when greedy).
        evidence: for a draft copied from an earlier occurrence of the context's last n tokens
            (prompt lookup), ``(source, n)``, e.g. ``("prompt_lookup", 3)``: what the draft gate
            (:mod:`specdecode.draft_gate`) estimates its acceptance by; None for other drafts (never
            gated; a client's prediction among them).
        early_stop: whether a greedy verification pass may stop after its first chunk where the
            first drafted tokens are wrong (the runner's ``greedy_stop_rows``); False where the
            draft gate found one whole pass cheaper in expectation (it then saves the chunk's
            extra call).
    """

    ids: torch.Tensor
    probs: torch.Tensor | None = None
    evidence: tuple[str, int] | None = None
    early_stop: bool = True

    @staticmethod
    def empty() -> DraftTokens:
        return DraftTokens(torch.empty(0, dtype=torch.int64))

    def to(self, device: torch.device) -> DraftTokens:
        """This draft as the verifier takes it (docs/design.md §2b): ids on the CPU, probs on
        ``device`` (the target's logits' device). Itself when nothing moves."""
        probs = self.probs
        if self.ids.device.type == "cpu" and (probs is None or probs.device == device):
            return self
        return DraftTokens(
            self.ids.cpu(), probs.to(device) if probs is not None else None, self.evidence, self.early_stop
        )

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@runtime_checkable
class Proposer(Protocol):
    """Drafts tokens for the target to verify (capabilities: see the module docstring)."""

    name: str
    supports_tree: bool
    needs_target_features: bool
    default_num_speculative_tokens: int

    def reset(self) -> None:
        """Forget everything about the previous request (no state leaks between calls)."""

    def clear_cache(self) -> None:
        """Forget state kept across requests (a no-op for most proposers)."""

    def describe(self) -> ProposerInfo:
        """What records say about it (quantization, the curve pricing its model's forwards), read once per request."""

    def propose(
        self,
        context: torch.Tensor,
        num_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftTokens:
        """Draft up to ``num_tokens`` tokens to follow ``context``.

        Args:
            context: int64 ``[T]``, the prompt and every token generated so far.
            num_tokens: k >= 1, the most tokens to draft.
            sampling: the request's sampling parameters; a proposer that samples applies the same
                :func:`~specdecode.sampling.logits_to_probs` transform as the target.
            generator: the request's random generator (for proposers that sample).
        """
        ...

    def observe(self, result: VerifyResult) -> None:
        """Feedback after verification: ``result.num_accepted`` of the draft were kept."""

    def observe_features(self, hidden: torch.Tensor) -> None:
        """The target's features of the kept positions, ``[m, H]`` (``needs_target_features`` only)."""


class ProposerBase:
    """The defaults of every optional capability of :class:`Proposer`: chains only, no target
    features, k = :data:`DEFAULT_NUM_SPECULATIVE_TOKENS`, nothing to reset or observe. Subclasses
    set ``name``, define ``propose`` (see :class:`Proposer`) and override what they have."""

    name: str = "proposer"
    supports_tree: bool = False
    needs_target_features: bool = False
    default_num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    passes: DraftPasses = NO_DRAFT_PASSES  # the loop sets this request's sink: self.passes(width) per forward
    vocab_size: int | None = None  # None: drafts ids of any vocabulary (taken from the context)
    drafter: torch.nn.Module | None = None  # a features proposer's trained drafter
    copies: bool = False
    """Every draft is copied (from the context or a prediction) and carries ``evidence``: cheap to
    make, priced by the draft gate (:mod:`specdecode.draft_gate`) rather than by a cost of drafting."""

    def reset(self) -> None:
        """Nothing to forget."""

    def clear_cache(self) -> None:
        """Nothing kept across requests."""

    def describe(self) -> ProposerInfo:
        """No quantization; forwards (if any) priced as a draft model's."""
        return NO_PROPOSER

    def observe(self, result: VerifyResult) -> None:
        """No feedback needed."""

    def observe_features(self, hidden: torch.Tensor) -> None:
        """Called only when ``needs_target_features`` is True; such a proposer overrides it.

        Raises:
            NotImplementedError: the proposer declares ``needs_target_features`` without reading them.
        """
        raise NotImplementedError(f"{type(self).__name__} declares needs_target_features but not observe_features()")


def check_proposer(proposer: object) -> None:
    """Check that ``proposer`` speaks the :class:`Proposer` protocol, capabilities declared.

    Raises:
        TypeError: a member is missing (the message names them), or ``supports_tree`` is set
            without a ``propose_tree`` method.
    """
    members = ("name", "supports_tree", "needs_target_features", "default_num_speculative_tokens")
    methods = ("reset", "clear_cache", "describe", "propose", "observe", "observe_features")
    missing = [m for m in (*members, *methods) if not hasattr(proposer, m)]
    if missing:
        raise TypeError(
            f"proposer {type(proposer).__name__} lacks {', '.join(missing)}: subclass "
            "specdecode.proposers.base.ProposerBase (it declares every capability with its default)"
        )
    if proposer.supports_tree and not callable(getattr(proposer, "propose_tree", None)):  # type: ignore[attr-defined]
        raise TypeError(f"proposer {type(proposer).__name__} sets supports_tree but has no propose_tree()")


def _attributes(value: object) -> list[object]:
    """The attribute values of an object, from its ``__dict__`` and its ``__slots__``."""
    found = list(vars(value).values()) if hasattr(value, "__dict__") else []
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name != "__dict__" and hasattr(value, name):
                found.append(getattr(value, name))
    return found


def proposer_weight_bytes(proposer: object, target: object | None = None, max_depth: int = 6) -> int:
    """Bytes of the weights a proposer holds beyond the target's: its memory cost next to the target.

    Counted: the parameters and buffers of every ``torch.nn.Module`` reachable from the proposer's
    attributes (a draft model, its reduced or int8 head, a trained drafter), the packed int8
    weights and biases of dynamically quantized linears (``torch.ao`` keeps them outside
    parameters and buffers: :func:`specdecode.models.torch.quant.quantize_int8`), and tensors that
    specdecode's own objects keep inside such a module (e.g. a drafter's copy of the target's
    LM-head rows, or the prepacked oneDNN copy of a float32 layer's weight that
    :func:`specdecode.models.torch.cpu.use_onednn_linears` makes on the first multi-token pass: counted
    once it exists), and the ``weight_bytes`` of a backend model (a llama.cpp GGUF draft:
    :class:`~specdecode.models.llamacpp.LlamaCppModel`); each storage (each quantized layer) once. Not
    counted: storages the ``target``
    owns (shared embeddings, the target's layers an early-exit proposer reuses) and per-request
    state (tensors a proposer keeps outside modules, such as the tokens in its cache;
    ``transformers`` KV caches), which grows with the context rather than being a cost of the
    proposer.

    Args:
        proposer: any proposer (or object holding models).
        target: the target model (a torch module or a backend model) whose storages are left out;
            None counts everything.
        max_depth: how many attribute hops to follow from ``proposer``.

    Returns:
        bytes (int); 0 for a proposer without weights (prompt lookup, suffix decoding).
    """
    from torch.ao.nn.quantized.modules.linear import LinearPackedParams  # a dynamic int8 linear's packed weight

    own = set()
    if isinstance(target, torch.nn.Module):
        own = {t.untyped_storage().data_ptr() for t in [*target.parameters(), *target.buffers()]}
    seen_objects: set[int] = set()
    seen_storages: set[int] = set()
    seen_packed: set[int] = set()
    total = 0

    def count(tensor: torch.Tensor) -> None:
        nonlocal total
        if tensor.is_mkldnn:  # an opaque oneDNN tensor (a prepacked weight) has no storage to share
            total += int(torch.ops.mkldnn._nbytes(tensor))  # walk() reaches each tensor object once
            return
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if tensor.device.type == "meta" or pointer in own or pointer in seen_storages:
            return
        seen_storages.add(pointer)
        total += storage.nbytes()

    def ours(value: object) -> bool:
        return type(value).__module__.startswith("specdecode")

    def walk(value: object, depth: int, in_module: bool = False) -> None:
        nonlocal total
        if id(value) in seen_objects or depth > max_depth or (target is not None and value is target):
            return
        seen_objects.add(id(value))
        if ours(value) and isinstance(getattr(value, "weight_bytes", None), int):  # a backend model's weights
            total += value.weight_bytes  # type: ignore[attr-defined]
        elif isinstance(value, torch.Tensor):
            if in_module:  # weights a module's helper keeps; a proposer's own tensors are request state
                count(value)
        elif isinstance(value, torch.nn.Module):
            for tensor in [*value.parameters(), *value.buffers()]:
                count(tensor)
            for module in value.modules():  # tensors our own objects keep beside a module's parameters
                if isinstance(module, LinearPackedParams) and id(module) not in seen_packed:  # int8 weight + bias
                    seen_packed.add(id(module))
                    total += sum(t.untyped_storage().nbytes() for t in module._weight_bias() if t is not None)
                for attr in vars(module).values():
                    if ours(attr) and not isinstance(attr, torch.nn.Module):
                        walk(attr, depth + 1, True)
        elif isinstance(value, list | tuple | set | frozenset):
            for item in value:
                walk(item, depth + 1, in_module)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item, depth + 1, in_module)
        elif ours(value):
            for attr in _attributes(value):
                walk(attr, depth + 1, in_module)

    walk(proposer, 0)
    return total
