"""A draft model with another tokenizer: it drafts text, which is re-tokenised into target tokens.

A draft that does not share the target's vocabulary (e.g. SmolLM2-135M-Instruct, 49,152 tokens,
for the Qwen2.5-Coder target, 151,936 tokens) cannot hand over token ids or distributions. It can
hand over *text*: the target context is decoded and kept, re-tokenised, as the draft's context; the
draft continues it; its new text is encoded with the target's tokenizer and proposed as target
tokens, which the target verifies as any other proposal. The idea is Hugging Face's universal
assisted generation (``AssistedCandidateGeneratorDifferentTokenizers`` in ``transformers``: decode,
re-encode a look-behind window at the boundary); for the exact sampling rule across vocabularies
see Timor et al. 2025, "Accelerating LLM Inference with Lossless Speculative Decoding Algorithms
for Heterogeneous Vocabularies", arXiv 2502.05202. The code here is our own.

**Why the output stays exact.** The proposal is a *deterministic* sequence of target tokens (the
draft decodes greedily), returned as ``DraftTokens(ids, probs=None)``: a one-hot ``q``. For one
position with target distribution ``p`` and proposed token ``x``, the rejection sampler
(:func:`specdecode.verify.rejection_sample`) accepts ``x`` with probability ``min(1, p(x)/1) = p(x)``
and otherwise samples from ``p`` with ``x`` removed and renormalised, so the emitted token ``y`` has
``P(y = x) = p(x)`` and, for ``y != x``, ``P(y) = (1 - p(x)) * p(y) / (1 - p(x)) = p(y)``: exactly
``p``, whatever ``x`` is. Chained over the positions (each one conditioned on the accepted prefix)
this is Leviathan et al. 2023, Theorem 1, with ``q`` one-hot. The only requirement is that the
proposal is fixed before the verification draws its uniforms: it may depend on anything in the past
(the context, earlier steps' random draws, where earlier steps ended, the draft's cache) but not on
this step's uniforms. Then, conditionally on the whole history, every emitted token is distributed
as the target's ``p`` given the context, hence so is the output. A draft that *sampled* its text
with the request's generator would be exact too: its draws come from the generator before the
verification's, and the PRNG's successive draws are (modelled as) independent, so the proposal is
again fixed and independent of the uniforms that judge it; only ``q`` would still be treated as
one-hot, since the draft's distribution lives in another vocabulary. We draft greedily because with
a one-hot ``q`` the acceptance probability of ``x`` is ``p(x)``, which the argmax of a draft close
to the target maximises. Greedy decoding (``temperature == 0``) is exact for any proposal: the
verifier keeps a token only if it equals the target's argmax.

**Keeping the draft's context in sync.** The proposer keeps the target ids it last saw, the draft
ids of the same text, and *anchors*: pairs ``(t, d)`` where the text of the first ``t`` target
tokens equals the text of the first ``d`` draft tokens. At each step it finds where the new context
departs from the last one (rollback: the rejected tail is gone; acceptance: new tokens follow),
goes back at least ``look_behind`` target tokens to an anchor, decodes the target tokens from there
and re-encodes that text with the draft's tokenizer, so a word cut at the boundary is tokenised as
the draft's tokenizer would. Anchors are placed where target and draft token boundaries coincide
inside a re-encoded window (word starts: the draft tokens before them are what encoding the whole
text gives), or, failing those, at the end of each synced context. The draft's KV cache keeps the
longest prefix it shares with the new draft ids and is truncated there (never a re-prefill).

**Back to target tokens.** The draft's new text is appended to the decoded last ``look_behind``
target tokens and encoded with the target's tokenizer; if the result starts with those context
tokens, the rest is the proposal (the boundary is tokenised in context). If not, the text merges
across the boundary (e.g. the context ends in ``"hel"`` and the draft wrote ``"lo"``): the context's
tokens are fixed, so the new text is encoded on its own.
"""

from __future__ import annotations

import bisect
import difflib
import filecmp
import functools
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specdecode.errors import IncompatibleModelsError
from specdecode.models.backends import make_runner
from specdecode.proposers.base import DraftTokens, ProposerBase
from specdecode.sampling import SamplingParams, argmax_ids
from specdecode.verify import VerifyResult

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Text both tokenizers must carry through an encode -> decode round trip (code and prose, as the
# default target writes); a draft tokenizer that loses most of it cannot draft for the target.
PROBE_TEXT = (
    "def add(a, b):\n    return a + b  # the sum\n\nThe quick brown fox jumps over the lazy dog. "
    "0123456789 {}[]()<>=+-*/%_'\"`"
)
MIN_PROBE_SIMILARITY = 0.5
REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 sequence gives


@dataclass(frozen=True)
class CrossTokenizerConfig:
    """Options of :class:`CrossTokenizerProposer`.

    Attributes:
        look_behind: target tokens re-tokenised behind the boundary at each step, on both sides
            (the draft's context is re-encoded from an anchor at least this far back; the new text
            is encoded after this many context tokens). >= 1.
        extra_draft_tokens: draft tokens generated beyond ``ceil((k + 1) * r)`` for k target
            tokens, where ``r`` is the measured number of draft tokens per target token of the
            context (the draft's tokens may be shorter), in [0, 64]. The (k + 1)-th target token
            only shows that the k-th is complete and is never proposed.
        warn_after_steps: after this many steps (summed over requests), warn once if the measured
            acceptance makes the expected speedup < 1 (see :meth:`CrossTokenizerProposer.expected_speedup`);
            0 never warns.

    Raises:
        ValueError: a value outside the above.
    """

    look_behind: int = field(default=8, metadata={"help": "tokens re-tokenised behind the boundary (default 8)"})
    extra_draft_tokens: int = field(
        default=0, metadata={"help": "draft tokens generated beyond what k target tokens take (default 0)"}
    )
    warn_after_steps: int = field(
        default=64, metadata={"help": "warn once if after N steps the pairing does not pay (0 = never; default 64)"}
    )

    def __post_init__(self) -> None:
        for name, low, high in (
            ("look_behind", 1, 1 << 16),
            ("extra_draft_tokens", 0, 64),
            ("warn_after_steps", 0, None),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low or (high and value > high):
                bounds = f"in [{low}, {high}]" if high else f">= {low}"
                raise ValueError(f"{name} must be an integer {bounds}, got {value!r}")


def decode(tokenizer: Any, ids: list[int]) -> str:
    """Text of ``ids``, special tokens kept as text (``<|im_end|>``: shared chat markers survive)."""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) if ids else ""


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without BOS / EOS (special-token strings in it become those tokens)."""
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def decode_after(tokenizer: Any, prefix: list[int], ids: list[int]) -> str:
    """Text of ``ids`` as it reads after ``prefix``: ``decode(prefix + ids)`` minus ``decode(prefix)``
    (SentencePiece-style tokenizers drop a leading space when decoding from the start)."""
    head = decode(tokenizer, prefix)
    full = decode(tokenizer, prefix + ids)
    return full[len(head) :] if prefix and full.startswith(head) else decode(tokenizer, ids)


def char_offsets(tokenizer: Any, ids: list[int], text: str) -> list[int] | None:
    """Character offset in ``text`` after each of ``ids`` (``text`` is their decoding), or None
    when single tokens do not decode to pieces of ``text`` (a character split over tokens, or a
    tokenizer that drops leading spaces per token)."""
    pieces = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if "".join(pieces) != text:
        return None
    offsets, total = [], 0
    for piece in pieces:
        total += len(piece)
        offsets.append(total)
    return offsets


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def check_pairing(draft_tokenizer: Any, target_tokenizer: Any) -> None:
    """Raise unless text written with the target's tokenizer survives the draft's tokenizer.

    :data:`PROBE_TEXT` goes through the target's tokenizer (encode, decode) and then the draft's;
    the draft's result must keep at least :data:`MIN_PROBE_SIMILARITY` of it (``difflib`` ratio).
    A lossy but usable round trip (some characters become ``<unk>``) gives a warning.

    Raises:
        ValueError: a tokenizer is missing (None).
        IncompatibleModelsError: the target's tokenizer cannot carry the probe text, or the draft's
            cannot encode the target's text (the tokenizers share too few characters).
    """
    if draft_tokenizer is None or target_tokenizer is None:
        raise ValueError("cross_tokenizer needs both tokenizers (the draft's and the target's), got None")
    target_text = decode(target_tokenizer, encode(target_tokenizer, PROBE_TEXT))
    if difflib.SequenceMatcher(None, PROBE_TEXT, target_text, autojunk=False).ratio() < MIN_PROBE_SIMILARITY:
        raise IncompatibleModelsError(
            f"the target's tokenizer cannot carry plain text ({PROBE_TEXT[:30]!r} comes back as "
            f"{target_text[:30]!r}); text-level drafting needs a tokenizer that round-trips text"
        )
    draft_text = decode(draft_tokenizer, encode(draft_tokenizer, target_text))
    if draft_text == target_text:
        return
    ratio = difflib.SequenceMatcher(None, target_text, draft_text, autojunk=False).ratio()
    if ratio < MIN_PROBE_SIMILARITY:
        raise IncompatibleModelsError(
            f"the draft's tokenizer cannot encode the target's text: {target_text[:40]!r} comes back as "
            f"{draft_text[:40]!r} ({ratio:.0%} similar); the two tokenizers share too few characters for "
            "a cross-tokenizer draft"
        )
    warnings.warn(
        f"cross_tokenizer: the draft's tokenizer changes some of the target's text ({ratio:.0%} similar): "
        "drafts will be accepted less often",
        RuntimeWarning,
        stacklevel=3,
    )


def same_vocabulary(target_tokenizer: Any, draft_tokenizer: Any) -> bool:
    """True if both tokenizers map the same strings to the same ids."""
    return bool(target_tokenizer.get_vocab() == draft_tokenizer.get_vocab())


@functools.lru_cache(maxsize=8)
def load_tokenizer_cached(model_dir: str) -> Any:
    """The tokenizer saved in ``model_dir``, loaded once per process (tokenizers are not mutated)."""
    from specdecode.models.torch.hf_loading import load_tokenizer

    return load_tokenizer(Path(model_dir))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def tokenizer_of(model: PreTrainedModel, role: str, fallback: Any = None) -> Any:
    """The tokenizer saved beside ``model``'s weights (``model.name_or_path``, the folder it was
    loaded from), or ``fallback`` if that folder has no tokenizer files.

    Raises:
        ValueError: no tokenizer there and no ``fallback``, or one that does not load.
    """
    path = str(getattr(model, "name_or_path", "") or "")
    if not path or not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        if fallback is not None:
            return fallback
        raise ValueError(
            f"proposer 'cross_tokenizer' needs the {role}'s tokenizer: load the {role} from a model folder "
            f"with its tokenizer (name_or_path is {path!r}) or build "
            "CrossTokenizerProposer(draft, draft_tokenizer, target_tokenizer)"
        )
    try:
        return load_tokenizer_cached(path)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"proposer 'cross_tokenizer': cannot load the {role}'s tokenizer from {path}: {error}"
        ) from error


def vocabularies_differ(target_dir: Path, draft_dir: Path) -> bool:
    """True if the models saved in the two folders do not share a vocabulary (different embedding
    sizes in ``config.json``, or tokenizers that map strings to other ids): a ``draft_model`` draft
    cannot serve, a ``cross_tokenizer`` one can. A draft folder without tokenizer files counts as
    sharing the target's. Reads configs and tokenizers (only when their files differ), no weights."""
    from transformers import AutoConfig

    sizes = [
        getattr(AutoConfig.from_pretrained(d).get_text_config(), "vocab_size", None) for d in (target_dir, draft_dir)
    ]
    if sizes[0] != sizes[1]:
        return True
    if not any((draft_dir / name).is_file() for name in TOKENIZER_FILES):
        return False  # a draft saved without a tokenizer is taken to share the target's, as draft_model does
    names = [name for name in TOKENIZER_FILES if (target_dir / name).is_file() or (draft_dir / name).is_file()]
    if names and all(
        (draft_dir / name).is_file() and filecmp.cmp(target_dir / name, draft_dir / name, shallow=False)
        for name in names
    ):
        return False  # the same tokenizer files: no need to load them
    return not same_vocabulary(load_tokenizer_cached(str(target_dir)), load_tokenizer_cached(str(draft_dir)))


class CrossTokenizerProposer(ProposerBase):
    """Drafts target tokens with a draft model that has its own tokenizer (see the module docstring
    for the text translation, the context sync and why the output stays exact).

    The proposal is always deterministic (greedy draft, ``probs=None``), under greedy decoding and
    under sampling alike.

    Args:
        draft_model: the draft (any vocabulary): a ``transformers`` causal LM or a llama.cpp
            :class:`~specdecode.models.llamacpp.LlamaCppModel`; it keeps a KV cache (its runner).
        draft_tokenizer: the draft's tokenizer (``encode`` / ``decode`` / ``batch_decode`` /
            ``get_vocab``, e.g. a ``PreTrainedTokenizerFast``).
        target_tokenizer: the target's tokenizer.
        config: :class:`CrossTokenizerConfig`.
        target_vocab_size: rows of the target's embedding; proposals stop before any id outside
            ``[0, target_vocab_size)`` (None: no limit).
        cost_ratio: the cost of one draft pass relative to one target pass (``c``, docs/design.md §4),
            used only for the "does not pay" warning; the registry's build passes the parameter
            count ratio. 0 (unknown) never warns.

    Raises:
        ValueError: a tokenizer is None.
        IncompatibleModelsError: the draft's tokenizer cannot encode the target's text (see
            :func:`check_pairing`), or its base vocabulary is larger than the draft model's
            embedding (added tokens beyond the embedding are dropped from the draft's context).
    """

    name = "cross_tokenizer"

    def __init__(
        self,
        draft_model: PreTrainedModel,
        draft_tokenizer: Any,
        target_tokenizer: Any,
        config: CrossTokenizerConfig | None = None,
        target_vocab_size: int | None = None,
        cost_ratio: float = 0.0,
    ) -> None:
        check_pairing(draft_tokenizer, target_tokenizer)
        self.config = config or CrossTokenizerConfig()
        self.runner = make_runner(draft_model)  # a torch or llama.cpp draft, with its own cache
        base = int(getattr(draft_tokenizer, "vocab_size", None) or len(draft_tokenizer))  # without added tokens
        if base > self.runner.vocab_size:
            raise IncompatibleModelsError(
                f"the draft's tokenizer has {base} tokens but the draft model only {self.runner.vocab_size} "
                "embeddings: the tokenizer belongs to another model"
            )
        self.draft_tokenizer = draft_tokenizer
        self.target_tokenizer = target_tokenizer
        self.target_vocab_size = target_vocab_size
        self.cost_ratio = float(cost_ratio)
        eos: list[Any] = [getattr(draft_tokenizer, "eos_token_id", None)]
        eos.append(list(getattr(draft_model, "eos_token_ids", ())))  # a llama.cpp model's EOS and EOT
        eos.append(getattr(getattr(draft_model, "generation_config", None), "eos_token_id", None))
        self.draft_eos = frozenset(i for e in eos if e is not None for i in ([e] if isinstance(e, int) else e))
        # measured over the proposer's life (across requests), for the one warning
        self.steps = self.drafted = self.accepted = self.draft_passes = 0
        self._warned = False
        self.reset()

    def reset(self) -> None:
        self.runner.reset()
        self._target = torch.empty(0, dtype=torch.int64)  # the target ids last synced, [T]
        self._draft: list[int] = []  # draft ids with the same text
        self._cached: list[int] = []  # draft ids in the draft's KV cache
        self._agree = 0  # self._cached[:self._agree] == self._draft[:self._agree] is known
        self._anchor_t, self._anchor_d, self._natural = [0], [0], [True]  # anchors, sorted by t

    # ------------------------------------------------------------------ target -> draft
    def _start_anchor(self, keep: int) -> int:
        """Index of the anchor to re-encode from, given that the first ``keep`` target ids still hold:
        the latest natural anchor within ``look_behind`` more tokens of ``keep - look_behind``, else
        the latest anchor at or before it."""
        L = self.config.look_behind
        limit = max(0, keep - L)
        last = bisect.bisect_right(self._anchor_t, limit) - 1  # >= 0: anchor (0, 0)
        for i in range(last, -1, -1):
            if self._anchor_t[i] < limit - L:
                break
            if self._natural[i]:
                return i
        return last

    def _sync(self, context: torch.Tensor) -> None:
        """Bring the draft's ids (:attr:`_draft`) in line with ``context`` (int64 ``[T]``)."""
        n = min(self._target.shape[0], context.shape[0])
        differ = (self._target[:n] != context[:n]).nonzero()
        keep = int(differ[0, 0]) if differ.numel() else n
        a = self._start_anchor(keep)
        t0, d0 = self._anchor_t[a], self._anchor_d[a]
        del self._anchor_t[a + 1 :], self._anchor_d[a + 1 :], self._natural[a + 1 :]
        window = context[t0:].tolist()
        text = decode_after(self.target_tokenizer, context[max(0, t0 - 2) : t0].tolist(), window)
        ids = [i for i in encode(self.draft_tokenizer, text) if i < self.runner.vocab_size]  # no added token
        self._add_anchors(window, ids, text, t0, d0)
        self._draft = self._draft[:d0] + ids
        self._agree = min(self._agree, d0)
        self._target = context.clone()

    def _add_anchors(self, window: list[int], ids: list[int], text: str, t0: int, d0: int) -> None:
        """Anchors inside the re-encoded window where target and draft token boundaries coincide
        (natural), and one at its end (when the text does not end inside a character)."""
        T, D = t0 + len(window), d0 + len(ids)
        if decode(self.draft_tokenizer, ids) == text:
            target_offsets = char_offsets(self.target_tokenizer, window, text)
            draft_offsets = char_offsets(self.draft_tokenizer, ids, text) if target_offsets else None
            if target_offsets and draft_offsets:
                where = {o: j for j, o in enumerate(draft_offsets[:-1])}
                for i, o in enumerate(target_offsets[:-1]):
                    if o in where and t0 + i + 1 > self._anchor_t[-1]:
                        self._anchor_t.append(t0 + i + 1)
                        self._anchor_d.append(d0 + where[o] + 1)
                        self._natural.append(True)
        if window and not text.endswith(REPLACEMENT) and T > self._anchor_t[-1]:
            self._anchor_t.append(T)
            self._anchor_d.append(D)
            self._natural.append(False)

    def _feed(self) -> torch.Tensor:
        """Roll the draft's cache back to the prefix it shares with :attr:`_draft` and feed the
        rest (at least one token); return the logits for the next draft token, float32 ``[V_d]``."""
        a = self._agree
        keep = min(a + common_prefix(self._cached[a:], self._draft[a:]), len(self._draft) - 1)
        self.runner.truncate(keep)
        self._cached = list(self._draft)
        self._agree = len(self._draft)
        self.draft_passes += 1
        return self.runner.forward(torch.tensor(self._draft[keep:], dtype=torch.int64), num_logits=1)[-1]

    # ------------------------------------------------------------------ draft -> target
    def _to_target(self, context: torch.Tensor, new: list[int]) -> list[int]:
        """Target ids for the text of the draft tokens ``new`` following ``context`` (all of them;
        a trailing incomplete character is left out)."""
        text = decode_after(self.draft_tokenizer, self._draft[-2:], new).rstrip(REPLACEMENT)
        tail = context[-self.config.look_behind :].tolist()
        ids = encode(self.target_tokenizer, decode(self.target_tokenizer, tail) + text)
        if ids[: len(tail)] == tail:
            return ids[len(tail) :]
        return encode(self.target_tokenizer, text)  # the text merges with the context's last tokens, which are fixed

    def propose(
        self,
        context: torch.Tensor,
        num_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftTokens:
        """Draft up to ``num_tokens`` target tokens to follow ``context`` (int64 ``[T]`` target ids).

        The draft decodes greedily until its text gives ``num_tokens + 1`` target tokens (the last
        one only shows that the one before is complete), its EOS, or ``ceil((num_tokens + 1) * r) +
        extra_draft_tokens`` tokens (``r``: draft tokens per target token of the context). Unless it
        stopped at EOS or got that far, the last target token, which more text might lengthen, is
        dropped (if others remain).

        Returns ``DraftTokens(ids, None)``: int64 ``[m]``, 0 <= m <= num_tokens, a deterministic
        proposal (``sampling`` and ``generator`` are not used). Empty when the draft's context is
        full or its text gives no target token.
        """
        self._sync(context)
        ratio = min(max(len(self._draft) / max(context.shape[0], 1), 0.25), 4.0)  # draft tokens per target token
        m = math.ceil((num_tokens + 1) * ratio) + self.config.extra_draft_tokens
        if not self._draft or len(self._draft) + m > self.runner.max_length:
            return DraftTokens.empty()
        logits = self._feed()  # (V_d,)
        new: list[int] = []
        for i in range(m):
            new.append(int(argmax_ids(logits)))
            ids = self._to_target(context, new)
            if new[-1] in self.draft_eos or len(ids) > num_tokens or i + 1 == m:
                break
            logits = self.runner.forward(torch.tensor(new[-1:], dtype=torch.int64), num_logits=1)[-1]
            self._cached.append(new[-1])
            self.draft_passes += 1
        if new[-1] not in self.draft_eos and len(ids) <= num_tokens and len(ids) > 1:
            ids = ids[:-1]
        ids = ids[:num_tokens]
        if self.target_vocab_size is not None:
            bad = [i for i, x in enumerate(ids) if not 0 <= x < self.target_vocab_size]
            ids = ids[: bad[0]] if bad else ids
        self.drafted += len(ids)
        return DraftTokens(torch.tensor(ids, dtype=torch.int64))

    # ------------------------------------------------------------------ feedback
    def expected_speedup(self) -> float:
        """The speedup the measured acceptance allows, ignoring everything but the passes:
        ``(1 + a) / (1 + c * r)`` with ``a`` the accepted tokens per step, ``r`` the draft passes
        per step and ``c`` :attr:`cost_ratio`; tokenizer time and overheads are left out, so it is
        an upper bound. 1.0 before the first step."""
        if self.steps == 0:
            return 1.0
        return (1.0 + self.accepted / self.steps) / (1.0 + self.cost_ratio * self.draft_passes / self.steps)

    def observe(self, result: VerifyResult) -> None:
        """Count acceptance (the next ``propose`` re-syncs the context); warn once, after
        ``warn_after_steps`` steps, if :meth:`expected_speedup` is below 1."""
        self.steps += 1
        self.accepted += result.num_accepted
        after = self.config.warn_after_steps
        if after and not self._warned and self.steps >= after and self.expected_speedup() < 1.0:
            self._warned = True
            rate = self.accepted / max(self.drafted, 1)
            warnings.warn(
                f"cross_tokenizer: after {self.steps} steps the draft's tokens were accepted {rate:.0%} of the "
                f"time ({self.accepted / self.steps:.2f} per step, {self.draft_passes / self.steps:.1f} draft "
                f"passes per step at cost ratio {self.cost_ratio:.3f}): expected speedup "
                f"{self.expected_speedup():.2f} < 1, this pairing does not pay; try a draft closer to the "
                "target or --proposer prompt_lookup",
                RuntimeWarning,
                stacklevel=2,
            )
