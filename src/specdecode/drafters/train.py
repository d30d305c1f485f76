"""Train a drafter on the target's own features and predictions (self-distillation).

``specdecode train-drafter --kind medusa|eagle --out DIR`` does two things:

1. **Features** (:func:`collect_features`): text that installs offline (the Python standard
   library's source, :func:`specdecode.token_map.corpus_files`; never the benchmark
   prompts) is tokenised and cut into sequences of ``seq_len`` tokens; the target runs over each
   (no gradient) and we keep, per position p, the token ``x_p``, the feature ``f_p`` (final hidden
   state after the norm, bfloat16) and ``y_p = argmax lm_head(f_p)``, the target's own prediction
   of token ``p + 1``. Those predictions are the labels: no other model and no labelled data are
   needed (Medusa-2's and EAGLE's self-distillation, here on the target's predictions over corpus
   text rather than on its generations, which would take hours on a CPU). Saved as safetensors
   shards in a features folder that both kinds reuse. With ``--chat`` (:func:`chat_texts`) the
   corpus's documented functions become chat examples in the target's chat template (complete this
   function -> the function), the format and the copying an instruct target meets on code requests;
   ``--extra-features`` trains on several features folders at once.
2. **Training** (:func:`train_drafter`): AdamW on the drafter only (the target is frozen; the
   drafter scores with the target's LM head rows of a token map built from the labels' counts).

   - Medusa head i at position p: cross-entropy of its scores against ``y_{p+i}`` (the target's
     prediction of token ``p + 1 + i``), weighted ``0.8 ** (i - 1)`` (Medusa's decay).
   - EAGLE at position p: input (``x_{p+1}``, ``f_p`` + uniform noise in ±``noise``, EAGLE-1's
     augmentation), output ``f^_{p+1}``; loss = SmoothL1(``f^_{p+1}``, ``f_{p+1}``) (feature
     regression) + ``cls_weight`` x cross-entropy of its scores against ``y_{p+1}``. With
     ``ttt_steps`` D > 1 the head is also unrolled D - 1 more steps on its own predicted features, as
     it drafts, and scored at each (EAGLE-3's training-time test; :func:`eagle_loss`).

   A progress bar (tqdm), a step and a time budget, validation of top-1 agreement with the target
   on held-out sequences every ``val_every`` steps, a checkpoint (drafter, optimiser, step, data
   order) every ``save_every`` steps and at the end; ``resume=True`` continues from it.

The final report (saved in ``drafter.json`` under ``training``) gives the top-1 agreement per draft
position on the held-out sequences and the expected number of accepted tokens per step for a chain
of k drafts, ``sum_j prod_{i<=j} a_i`` (greedy, treating positions as independent).
For EAGLE, position j > 1 is measured autoregressively, as drafting runs (the head's own predicted
features, attending to the true pairs before the rollout and to its own earlier steps), with the
corpus tokens as token inputs.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from specdecode.drafters.heads import (
    KINDS,
    DrafterConfig,
    EagleHead,
    MedusaHeads,
    build_drafter,
    load_drafter,
    save_drafter,
    target_identity,
)

FEATURES_META = "features.json"
CHECKPOINT = "checkpoint.pt"
DISTILL = ("top1", "soft")
SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# ---------------------------------------------------------------- features
def token_sequences(tokenizer: Any, texts: Iterable[str], seq_len: int, max_tokens: int) -> Iterator[list[int]]:
    """Sequences of exactly ``seq_len`` token ids from ``texts`` joined by EOS, at most ``max_tokens`` in all."""
    eos = getattr(tokenizer, "eos_token_id", None)
    buffer: list[int] = []
    made = 0
    for text in texts:
        buffer.extend(tokenizer.encode(text, add_special_tokens=False))
        if eos is not None:
            buffer.append(int(eos))
        while len(buffer) >= seq_len:
            if made + seq_len > max_tokens:
                return
            yield buffer[:seq_len]
            buffer = buffer[seq_len:]
            made += seq_len


CHAT_INSTRUCTIONS = (
    "Complete the following Python function:",
    "Implement this Python function.",
    "Write the body of the function below.",
    "Finish this code:",
    "Here is a function signature and its docstring. Write the implementation.",
)


def function_examples(text: str, max_lines: int = 80) -> Iterator[tuple[str, str]]:
    """``(header, function)`` pairs from Python source: every function or method with a docstring and
    at least two statements after it, at most ``max_lines`` lines, dedented; ``header`` is the ``def``
    line(s) and the docstring, ``function`` the whole definition. Source that does not parse yields nothing."""
    import ast
    import textwrap

    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    lines = text.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or ast.get_docstring(node) is None:
            continue
        if len(node.body) < 3 or node.end_lineno is None or node.end_lineno - node.lineno >= max_lines:
            continue
        doc_end = node.body[0].end_lineno or node.lineno
        whole = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
        header_lines = doc_end - node.lineno + 1
        yield "\n".join(whole.splitlines()[:header_lines]) + "\n", whole + "\n"


def chat_texts(tokenizer: Any, texts: Iterable[str], seed: int = 0) -> Iterator[str]:
    """Chat examples in the target's chat template, made from the functions of Python source.

    Each function with a docstring (:func:`function_examples`) becomes one user turn (an instruction
    from :data:`CHAT_INSTRUCTIONS`, picked at random, and the function's signature and docstring in a
    code block) and one assistant turn (the whole function in a code block). It teaches a drafter the
    chat format and the copying that an instruct target does when asked to complete code (its answer
    starts by repeating the signature and docstring), without generating anything: the labels are
    still the target's own predictions over these texts.

    Args:
        tokenizer: the target's tokenizer, with a chat template.
        texts: Python source texts (e.g. ``read_texts(corpus_files(["stdlib"]))``).
        seed: the instruction choice.

    Yields:
        the rendered chat (str), one per function.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat examples need a tokenizer with a chat template")
    pick = random.Random(seed)
    for text in texts:
        for header, function in function_examples(text):
            messages = [
                {"role": "user", "content": f"{pick.choice(CHAT_INSTRUCTIONS)}\n```python\n{header}```"},
                {"role": "assistant", "content": f"```python\n{function}```"},
            ]
            yield tokenizer.apply_chat_template(messages, tokenize=False)


@torch.inference_mode()
def target_features(target: PreTrainedModel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's features and predictions over a batch of sequences.

    Args:
        target: the target causal LM (eval mode).
        ids: int64 ``[B, L]``.

    Returns:
        ``(features bfloat16 [B, L, H], predictions int64 [B, L])``: ``f_p`` and ``argmax lm_head(f_p)``.
    """
    hidden = target.get_decoder()(input_ids=ids.to(target.device), use_cache=False).last_hidden_state  # (B, L, H)
    predictions = target.get_output_embeddings()(hidden).argmax(-1)  # (B, L)
    return hidden.to("cpu", torch.bfloat16), predictions.to("cpu")


def collect_features(
    target: PreTrainedModel,
    tokenizer: Any,
    texts: Iterable[str],
    out_dir: str | Path,
    max_tokens: int,
    seq_len: int = 512,
    batch_size: int = 4,
    shard_sequences: int = 64,
    progress: bool = True,
    source: str = "",
) -> Path:
    """Run the target over the corpus and save features, tokens and predictions in shards.

    Resumable: shards already in ``out_dir`` are kept and their sequences skipped; each shard is
    written atomically with ``features.json`` after it, so a run stopped at any moment loses at most
    the sequences of the shard in progress.

    Args:
        target, tokenizer: the target and its tokenizer.
        texts: the corpus (e.g. ``read_texts(corpus_files(["stdlib"]))``).
        out_dir: the features folder (``shard-00000.safetensors`` ..., ``features.json``).
        max_tokens: corpus tokens to process (a multiple of ``seq_len`` is used).
        seq_len: tokens per sequence.
        batch_size: sequences per target pass.
        shard_sequences: sequences per shard file.
        progress: show a tqdm bar.
        source: a description of the corpus for the report.

    Returns:
        ``out_dir``.

    Raises:
        ValueError: ``max_tokens < seq_len`` or a features folder made for another target or shape.
    """
    from tqdm.auto import tqdm

    if max_tokens < seq_len or seq_len < 2:
        raise ValueError(f"max_tokens ({max_tokens}) must be >= seq_len ({seq_len}) >= 2")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    identity = target_identity(target)
    meta_path = out / FEATURES_META
    meta: dict[str, Any] = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if meta and (meta.get("target", {}).get("weights_hash") != identity["weights_hash"] or meta["seq_len"] != seq_len):
        raise ValueError(f"features folder {out} was made for another target or seq_len; use another --features")
    done = sorted(out.glob("shard-*.safetensors"))
    have = 0
    for path in done:  # sequences per shard, read from the header (no tensor is loaded)
        with safe_open(str(path), "pt") as shard_file:
            have += int(shard_file.get_slice("tokens").get_shape()[0])
    wanted = max_tokens // seq_len
    sequences = token_sequences(tokenizer, texts, seq_len, wanted * seq_len)
    for _ in range(have):  # skip what earlier runs saved
        next(sequences, None)
    tic = time.perf_counter()
    bar = tqdm(total=wanted, initial=have, unit="seq", desc="features", disable=not progress)
    shard: dict[str, list[torch.Tensor]] = {"tokens": [], "features": [], "predictions": []}
    index = len(done)

    def write_meta() -> None:
        meta_path.write_text(
            json.dumps(
                {
                    "target": identity,
                    "seq_len": seq_len,
                    "sequences": count,
                    "tokens": count * seq_len,
                    "source": source or meta.get("source", ""),
                    "seconds": round(float(meta.get("seconds", 0.0)) + time.perf_counter() - tic, 1),
                },
                indent=2,
            )
            + "\n"
        )

    def flush() -> None:
        """Save the shard (atomically: a run killed mid-write leaves no half shard) and the metadata."""
        nonlocal index
        if shard["tokens"]:
            tensors = {key: torch.cat(value) for key, value in shard.items()}
            path = out / f"shard-{index:05d}.safetensors"
            partial = path.with_name(path.name + ".partial")
            save_file(tensors, str(partial))
            partial.replace(path)
            index += 1
            for value in shard.values():
                value.clear()
            write_meta()

    count = have
    while batch := list(islice(sequences, batch_size)):
        ids = torch.tensor(batch, dtype=torch.int64)  # (B, L)
        features, predictions = target_features(target, ids)
        shard["tokens"].append(ids)
        shard["features"].append(features)
        shard["predictions"].append(predictions)
        count += len(batch)
        bar.update(len(batch))
        if sum(t.shape[0] for t in shard["tokens"]) >= shard_sequences:
            flush()
    flush()
    bar.close()
    write_meta()
    return out


def load_features(folder: str | Path) -> dict[str, torch.Tensor]:
    """All shards of a features folder: ``tokens`` int64 ``[S, L]``, ``features`` bfloat16 ``[S, L, H]``,
    ``predictions`` int64 ``[S, L]``.

    Raises:
        FileNotFoundError: no shards in ``folder``.
    """
    paths = sorted(Path(folder).glob("shard-*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no feature shards in {folder}")
    shards = [load_file(str(p)) for p in paths]
    return {key: torch.cat([s[key] for s in shards]) for key in ("tokens", "features", "predictions")}


# ---------------------------------------------------------------- training
@dataclass
class TrainConfig:
    """Training options (``specdecode train-drafter`` flags of the same names).

    Attributes:
        kind: ``"medusa"`` or ``"eagle"``.
        draft_vocab_size: N, the token map size (most frequent target predictions, special tokens first).
        num_heads: Medusa heads K (tokens drafted per step at most).
        intermediate_size: EAGLE's MLP width (None: half the target's).
        batch_size: sequences per optimiser step.
        lr: AdamW peak learning rate (linear warm-up over 5% of ``max_steps`` (at most 30 steps), then cosine decay to 0
            at the end of the step or the time budget, whichever comes first).
        max_steps: step budget.
        time_budget_s: wall-clock budget in seconds for training (None: no limit).
        val_fraction: share of sequences held out for validation: the last ones collected (the
            corpus files are shuffled before collection, so these are other files).
        val_every: validate every this many steps.
        save_every: checkpoint every this many steps.
        noise: EAGLE's uniform feature noise half-width.
        cls_weight: EAGLE's weight of the classification loss.
        distill: the classification target: ``"top1"`` (cross-entropy against the target's top-1
            prediction, a hard label) or ``"soft"`` (cross-entropy against the target's whole
            distribution over the token map, ``softmax(lm_head(f))`` renormalised on the map, i.e.
            KL distillation as in EAGLE's and Medusa-2's self-distillation; more signal per token).
        loss_positions: positions per sequence where the LM-head losses are computed each step
            (random; None: all). The LM-head rows dominate a step's cost on a CPU.
        ttt_steps: EAGLE: draft steps unrolled per training step on the head's own predicted
            features (EAGLE-3's training-time test, see :func:`eagle_loss`); 1 = teacher forcing
            only (EAGLE-1). Each step costs about one more forward and LM-head product.
        seed: data order and initialisation.
        save_dtype: ``"bfloat16"`` (default, half the file) or ``"float32"``: the dtype of the saved
            drafter's weights (training and ``checkpoint.pt`` stay float32; loading casts to the
            target's dtype).
    """

    kind: str = "eagle"
    draft_vocab_size: int = 32768
    num_heads: int = 4
    intermediate_size: int | None = None
    batch_size: int = 4
    lr: float = 1e-3
    max_steps: int = 2000
    time_budget_s: float | None = None
    val_fraction: float = 0.05
    val_every: int = 200
    save_every: int = 200
    noise: float = 0.1
    cls_weight: float = 0.1
    distill: str = "top1"
    loss_positions: int | None = 128
    ttt_steps: int = 1
    seed: int = 0
    save_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)}, got {self.kind!r}")
        integers = ("draft_vocab_size", "num_heads", "batch_size", "max_steps", "val_every", "save_every", "ttt_steps")
        for name in integers:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("cls_weight", "noise"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.distill not in DISTILL:
            raise ValueError(f"distill must be one of {list(DISTILL)}, got {self.distill!r}")
        if self.save_dtype not in SAVE_DTYPES:
            raise ValueError(f"save_dtype must be one of {list(SAVE_DTYPES)}, got {self.save_dtype!r}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"time_budget_s must be > 0 or None, got {self.time_budget_s!r}")


def head_ids_from_predictions(predictions: torch.Tensor, vocab_size: int, size: int, always: list[int]) -> torch.Tensor:
    """Token map: ``always`` (special tokens) then the target's most frequent predictions; int64 ``[size]``."""
    from specdecode.token_map import token_map_from_counts

    counts = np.bincount(predictions.reshape(-1).numpy(), minlength=vocab_size)[:vocab_size]
    return token_map_from_counts(counts, min(size, vocab_size), always)


def _column_labels(labels: torch.Tensor, head_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token ids -> their column in the token map, -100 (ignored) outside it."""
    column = torch.full((vocab_size,), -100, dtype=torch.int64)
    column[head_ids] = torch.arange(head_ids.shape[0])
    return column[labels]


def _sample_positions(B: int, span: int, count: int | None, generator: torch.Generator | None) -> torch.Tensor:
    """int64 ``[B, m]``: ``m = min(count, span)`` distinct positions in ``[0, span)`` per row (all if None)."""
    if count is None or count >= span:
        return torch.arange(span).expand(B, span)
    return torch.stack([torch.randperm(span, generator=generator)[:count] for _ in range(B)])


def _classification_loss(
    drafter: MedusaHeads | EagleHead, logits: torch.Tensor, target: torch.Tensor, teacher: torch.Tensor | None
) -> torch.Tensor:
    """Cross-entropy of ``logits`` float32 ``[..., N]`` against the target's predictions.

    ``teacher`` None: hard labels ``target`` (map columns, -100 ignored). Otherwise ``teacher`` is the
    target's true feature ``[..., H]`` at the labelled position and the label is its distribution over
    the token map (soft cross-entropy = KL distillation up to the teacher's entropy).
    """
    if teacher is None:
        return F.cross_entropy(logits.flatten(0, -2), target.flatten(), ignore_index=-100)
    with torch.no_grad():
        probs = torch.softmax(drafter.logits(teacher), dim=-1)  # (..., N)
    return -(probs * torch.log_softmax(logits, dim=-1)).sum(-1).mean()


def medusa_loss(
    drafter: MedusaHeads,
    features: torch.Tensor,
    labels: torch.Tensor,
    loss_positions: int | None = None,
    generator: torch.Generator | None = None,
    distill: str = "top1",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Medusa loss on a batch.

    Args:
        features: ``[B, L, H]``.
        labels: int64 ``[B, L]`` map columns of the target's predictions ``y_p`` (-100 outside the map).
        loss_positions: positions per sequence the loss is computed at (random, distinct; None: all).
            The LM-head rows dominate the cost, so a sample keeps a CPU step short.
        generator: for the sample.
        distill: ``"top1"`` or ``"soft"`` (see :class:`TrainConfig`).

    Returns:
        ``(loss, correct [K], counted [K])``: the weighted cross-entropy and per-head top-1 hits.
    """
    K = drafter.config.num_heads
    B, L = labels.shape
    picked = _sample_positions(B, L - K, loss_positions, generator)  # (B, m): positions p
    rows = torch.arange(B).view(B, 1)
    hidden = drafter(features[rows, picked].float())  # (B, m, K, H)
    total = features.new_zeros((), dtype=torch.float32)
    correct = torch.zeros(K, dtype=torch.int64)
    counted = torch.zeros(K, dtype=torch.int64)
    for i in range(1, K + 1):
        logits = drafter.logits(hidden[:, :, i - 1])  # (B, m, N)
        target = labels[rows, picked + i]  # y_{p+i}
        teacher = features[rows, picked + i] if distill == "soft" else None  # f_{p+i}
        total = total + 0.8 ** (i - 1) * _classification_loss(drafter, logits, target, teacher)
        with torch.no_grad():
            valid = target >= 0
            correct[i - 1] = int(((logits.argmax(-1) == target) & valid).sum())
            counted[i - 1] = int(valid.sum())
    return total, correct, counted


def rollout_mask(span: int, step: int, batch: int, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """The additive attention mask of rollout step ``step`` (1-based) over ``span`` rollouts at once.

    Rollout p (started from the true feature ``f_p``) sees the true pairs q <= p, which the head's cache
    holds from step 1, and its own earlier steps only (one diagonal block per earlier step), as it does
    when drafting. Step 1 needs no mask (causal over the true pairs): returns None.

    Returns:
        ``{"full_attention": [batch, 1, span, span * step]}`` of ``dtype`` (0 allowed, dtype min masked).
    """
    if step == 1:
        return None
    lower = torch.ones(span, span, dtype=torch.bool).tril()
    eye = torch.eye(span, dtype=torch.bool)
    allowed = torch.cat([lower] + [eye] * (step - 1), dim=1)  # (span, span * step)
    additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return {"full_attention": additive.view(1, 1, *allowed.shape).expand(batch, 1, *allowed.shape)}


def eagle_loss(
    drafter: EagleHead,
    tokens: torch.Tensor,
    features: torch.Tensor,
    labels: torch.Tensor,
    noise: float,
    cls_weight: float,
    loss_positions: int | None = None,
    generator: torch.Generator | None = None,
    distill: str = "top1",
    ttt_steps: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE loss on a batch (see the module docstring).

    Step 1 is teacher forcing: input ``f_p`` (+ noise) and ``x_{p+1}``, output ``f^_{p+1}``. With
    ``ttt_steps`` D > 1, the head is also unrolled as it drafts (EAGLE-3's "training-time test", Li et
    al. 2025, arXiv 2503.01840; HASS, Zhang et al. 2024, arXiv 2408.15766): step j takes its own
    ``f^_{p+j-1}`` of step j - 1 (gradients flow through it) with ``x_{p+j}``, attends to the true
    pairs up to p and to its own earlier steps (:func:`rollout_mask`), and is scored against
    ``f_{p+j}`` and ``y_{p+j}``; the loss of step j is weighted ``0.8 ** (j - 1)`` (Medusa's decay),
    so the first position, which matters most for acceptance, keeps the largest weight. D = 1 is
    EAGLE-1's teacher forcing; rollouts start at p = 0 .. L - 1 - D.

    Args:
        tokens: int64 ``[B, L]``; features: ``[B, L, H]``; labels: int64 ``[B, L]`` map columns of ``y_p``.
        noise, cls_weight: see :class:`TrainConfig` (noise on step 1's true features only).
        loss_positions: positions per sequence the classification loss is computed at, per step
            (random; None: all); the regression loss uses every position.
        generator: for the sample.
        distill: ``"top1"`` or ``"soft"`` (see :class:`TrainConfig`).
        ttt_steps: D >= 1, the draft steps unrolled (1 <= D < L).

    Returns:
        ``(loss, correct [D], counted [D])``: top-1 hits and labels counted per step.

    Raises:
        ValueError: ``ttt_steps`` outside ``[1, L)``.
    """
    B, L = tokens.shape
    if not isinstance(ttt_steps, int) or not 1 <= ttt_steps < L:
        raise ValueError(f"ttt_steps must be an integer in [1, {L}) for sequences of {L} tokens, got {ttt_steps!r}")
    span = L - ttt_steps  # rollouts start at p = 0 .. span - 1
    current = features[:, :span].float()
    if noise > 0:
        current = current + (torch.rand_like(current) * 2 - 1) * noise
    cache = drafter.new_cache() if ttt_steps > 1 else None
    dtype = drafter.fc.weight.dtype
    rows = torch.arange(B).view(B, 1)
    total = features.new_zeros((), dtype=torch.float32)
    correct = torch.zeros(ttt_steps, dtype=torch.int64)
    counted = torch.zeros(ttt_steps, dtype=torch.int64)
    for j in range(1, ttt_steps + 1):
        positions = torch.arange(j, span + j).expand(B, span)
        mask = rollout_mask(span, j, B, dtype)
        predicted = drafter(current, tokens[:, j : span + j], positions, cache, mask)  # (B, span, H): f^_{p+j}
        truth = features[:, j : span + j]  # f_{p+j}
        regression = F.smooth_l1_loss(predicted.float(), truth.float())
        picked = _sample_positions(B, span, loss_positions, generator)  # (B, m)
        logits = drafter.logits(predicted[rows, picked])  # (B, m, N)
        target = labels[:, j : span + j][rows, picked]
        teacher = truth[rows, picked] if distill == "soft" else None
        classification = _classification_loss(drafter, logits, target, teacher)
        total = total + 0.8 ** (j - 1) * (regression + cls_weight * classification)
        with torch.no_grad():
            valid = target >= 0
            correct[j - 1] = int(((logits.argmax(-1) == target) & valid).sum())
            counted[j - 1] = int(valid.sum())
        current = predicted
    return total, correct, counted


@torch.no_grad()
def validate(
    drafter: MedusaHeads | EagleHead,
    tokens: torch.Tensor,
    features: torch.Tensor,
    labels: torch.Tensor,
    depth: int = 4,
    batch_size: int = 4,
) -> list[float]:
    """Top-1 agreement with the target per draft position 1..depth on held-out sequences.

    Medusa: head j's top-1 against ``y_{p+j}``. EAGLE: position 1 from the true feature ``f_p``;
    position j > 1 autoregressive from its own predicted features (token inputs: the target's
    tokens ``x``), scored against ``y_{p+j}``.

    Returns:
        ``[depth]`` agreements in [0, 1] (Medusa: ``min(depth, K)`` of them).
    """
    drafter.eval()
    hits = torch.zeros(depth, dtype=torch.float64)
    total = torch.zeros(depth, dtype=torch.float64)
    L = tokens.shape[1]
    for start in range(0, tokens.shape[0], batch_size):
        x = tokens[start : start + batch_size]
        f = features[start : start + batch_size].float()
        y = labels[start : start + batch_size]
        if isinstance(drafter, MedusaHeads):
            K = min(depth, drafter.config.num_heads)
            hidden = drafter(f[:, : L - K])  # (B, L - K, K, H)
            for j in range(1, K + 1):
                target = y[:, j : L - K + j]
                valid = target >= 0
                hits[j - 1] += float(((drafter.logits(hidden[:, :, j - 1]).argmax(-1) == target) & valid).sum())
                total[j - 1] += float(valid.sum())
            continue
        # EAGLE: the training loss's rollout of ``depth`` steps (no noise), scored at every position
        _, correct, counted = eagle_loss(drafter, x, f, y, noise=0.0, cls_weight=0.0, ttt_steps=depth)
        hits += correct.double()
        total += counted.double()
    drafter.train()
    kept = total > 0
    return (hits[kept] / total[kept]).tolist()


def expected_accepted(agreement: list[float]) -> float:
    """``sum_j prod_{i<=j} a_i``: expected accepted drafts per step of a chain (independence assumed)."""
    out, running = 0.0, 1.0
    for a in agreement:
        running *= a
        out += running
    return out


def train_drafter(
    target: PreTrainedModel,
    features_dir: str | Path | Sequence[str | Path],
    out_dir: str | Path,
    config: TrainConfig,
    always_ids: list[int] | None = None,
    resume: bool = False,
    progress: bool = True,
    init_from: str | Path | None = None,
) -> dict[str, Any]:
    """Train a drafter on collected features; save it in ``out_dir``; return the training report.

    Args:
        target: the frozen target (its LM head rows score the drafter's outputs).
        features_dir: a folder made by :func:`collect_features` for this target, or several (one
            ``seq_len``): trained on together, each holding out its last ``val_fraction`` of sequences.
        out_dir: where the drafter (and ``checkpoint.pt``) go.
        config: :class:`TrainConfig`.
        always_ids: token ids always in the token map (the tokenizer's special tokens).
        resume: continue from ``out_dir/checkpoint.pt`` if present.
        init_from: a saved drafter of the same kind and shape to start from (warm start: its weights,
            this run's token map, a fresh optimiser and schedule), e.g. to go on training on new data.
        progress: show a tqdm bar.

    Returns:
        the report saved in ``drafter.json`` under ``training``.

    Raises:
        ValueError: features made for another target or with unequal ``seq_len``, too few sequences
            in a folder to hold some out, or ``init_from`` holding a drafter of another kind or shape.
        FileNotFoundError: a folder without features, or ``init_from`` without a saved drafter.
        IncompatibleModelsError: ``init_from`` holds a drafter trained for another target.
    """
    from tqdm.auto import tqdm

    torch.manual_seed(config.seed)
    folders = [Path(features_dir)] if isinstance(features_dir, str | Path) else [Path(f) for f in features_dir]
    if not folders:
        raise ValueError("features_dir: give at least one features folder")
    identity = target_identity(target)
    metas: list[dict[str, Any]] = []
    parts: list[dict[str, torch.Tensor]] = []
    val_parts: list[torch.Tensor] = []
    start = 0
    for folder in folders:
        meta_path = folder / FEATURES_META
        if not meta_path.is_file():
            raise FileNotFoundError(f"features_dir: {folder} holds no {FEATURES_META} (collect features first)")
        meta = json.loads(meta_path.read_text())
        if meta["target"]["weights_hash"] != identity["weights_hash"]:
            raise ValueError(f"features in {folder} were made with another target")
        if metas and meta["seq_len"] != metas[0]["seq_len"]:
            raise ValueError(f"features in {folder} have seq_len {meta['seq_len']}, {folders[0]} {metas[0]['seq_len']}")
        part = load_features(folder)
        S_i = part["tokens"].shape[0]
        n_val_i = max(1, int(round(S_i * config.val_fraction)))
        if S_i - n_val_i < 1:
            raise ValueError(f"features in {folder} hold {S_i} sequences: too few to hold {n_val_i} out")
        # held out: the last sequences of each stream (other files than most training sequences; a random
        # split would validate on chunks of the very files trained on, which overstates agreement)
        val_parts.append(torch.arange(start + S_i - n_val_i, start + S_i))
        start += S_i
        metas.append(meta)
        parts.append(part)
    data = {key: torch.cat([p[key] for p in parts]) for key in parts[0]} if len(parts) > 1 else parts[0]
    del parts
    S = data["tokens"].shape[0]
    val_idx = torch.cat(val_parts)
    is_val = torch.zeros(S, dtype=torch.bool)
    is_val[val_idx] = True
    train_idx = (~is_val).nonzero().view(-1)
    n_val = int(val_idx.shape[0])
    meta = {
        "source": " + ".join(str(m.get("source", "")) for m in metas),
        "seq_len": metas[0]["seq_len"],
        "seconds": sum(float(m.get("seconds") or 0.0) for m in metas),
    }
    V = identity["vocab_size"]
    head_ids = head_ids_from_predictions(data["predictions"][train_idx], V, config.draft_vocab_size, always_ids or [])
    labels = _column_labels(data["predictions"], head_ids, V)  # (S, L)
    coverage = float((labels[train_idx] >= 0).float().mean())

    drafter_config = DrafterConfig.for_target(
        config.kind, target, int(head_ids.shape[0]), config.num_heads, config.intermediate_size
    )
    drafter = build_drafter(drafter_config, head_ids)
    if init_from is not None:
        warm_start(drafter, init_from, target)
    target.requires_grad_(False)
    drafter.attach(target, check=False, dtype=torch.float32)
    drafter.train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = max(1, min(config.max_steps // 20, 30))  # short: CPU runs are a few hundred steps

    def lr_at(step: int, elapsed_s: float) -> float:
        """Linear warm-up, then cosine decay to 0 at whichever budget (steps or time) ends first."""
        if step < warmup:
            return config.lr * (step + 1) / warmup
        done = (step - warmup) / max(1, config.max_steps - warmup)
        if config.time_budget_s is not None:
            done = max(done, elapsed_s / config.time_budget_s)
        return config.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    step, elapsed_before, history = 0, 0.0, []
    if resume and (out / CHECKPOINT).is_file():
        state = torch.load(out / CHECKPOINT, weights_only=False)
        drafter.load_state_dict(state["drafter"])
        optimizer.load_state_dict(state["optimizer"])
        step, elapsed_before, history = state["step"], state["elapsed_s"], state["history"]
        if not torch.equal(state["head_ids"], head_ids):
            raise ValueError("checkpoint was made with another token map (different features or options)")

    def checkpoint() -> None:
        torch.save(
            {
                "drafter": drafter.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "elapsed_s": elapsed_before + (time.perf_counter() - tic),
                "history": history,
                "head_ids": head_ids,
            },
            out / CHECKPOINT,
        )

    sampler = torch.Generator().manual_seed(config.seed + step)
    tic = time.perf_counter()
    batches_per_epoch = max(1, train_idx.shape[0] // config.batch_size)
    bar = tqdm(total=config.max_steps, initial=step, unit="step", desc=f"train {config.kind}", disable=not progress)
    loss_avg = None
    correct_sum = torch.zeros(config.num_heads if config.kind == "medusa" else config.ttt_steps)
    counted_sum = torch.zeros_like(correct_sum)
    stop_reason = "max_steps"
    while step < config.max_steps:
        if config.time_budget_s is not None and elapsed_before + time.perf_counter() - tic > config.time_budget_s:
            stop_reason = "time_budget"
            break
        epoch, position = divmod(step, batches_per_epoch)
        perm = train_idx[
            torch.randperm(train_idx.shape[0], generator=torch.Generator().manual_seed(config.seed + epoch))
        ]
        idx = perm[position * config.batch_size : (position + 1) * config.batch_size]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, elapsed_before + time.perf_counter() - tic)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=target.device.type == "cpu"):
            if isinstance(drafter, MedusaHeads):
                loss, correct, counted = medusa_loss(
                    drafter, data["features"][idx], labels[idx], config.loss_positions, sampler, config.distill
                )
            else:
                loss, correct, counted = eagle_loss(
                    drafter,
                    data["tokens"][idx],
                    data["features"][idx],
                    labels[idx],
                    config.noise,
                    config.cls_weight,
                    config.loss_positions,
                    sampler,
                    config.distill,
                    config.ttt_steps,
                )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        value = float(loss.detach())
        loss_avg = value if loss_avg is None else 0.95 * loss_avg + 0.05 * value
        correct_sum += correct
        counted_sum += counted
        bar.update(1)
        bar.set_postfix(loss=f"{loss_avg:.3f}", top1=f"{float(correct_sum[0] / counted_sum[0].clamp(min=1)):.3f}")
        if step % config.val_every == 0:
            agreement = validate(
                drafter,
                data["tokens"][val_idx],
                data["features"][val_idx],
                labels[val_idx],
                batch_size=config.batch_size,
            )
            history.append({"step": step, "loss": round(loss_avg, 4), "val_top1": [round(a, 4) for a in agreement]})
            bar.write(
                f"step {step}: loss {loss_avg:.3f}, held-out top-1 per position {[round(a, 3) for a in agreement]}"
            )
            correct_sum.zero_()
            counted_sum.zero_()
        if step % config.save_every == 0:
            checkpoint()
    bar.close()
    checkpoint()
    train_seconds = elapsed_before + time.perf_counter() - tic
    agreement = validate(drafter, data["tokens"][val_idx], data["features"][val_idx], labels[val_idx])
    per_source = (
        {
            str(m.get("source", f)): [
                round(a, 4) for a in validate(drafter, data["tokens"][v], data["features"][v], labels[v])
            ]
            for f, m, v in zip(folders, metas, val_parts, strict=True)
        }
        if len(folders) > 1
        else None
    )
    report = {
        "data": {
            "source": meta.get("source", ""),
            "train_sequences": int(train_idx.shape[0]),
            "val_sequences": int(n_val),
            "seq_len": int(meta["seq_len"]),
            "train_tokens": int(train_idx.shape[0]) * int(meta["seq_len"]),
            "feature_seconds": meta.get("seconds"),
        },
        "token_map_coverage": round(coverage, 4),
        "steps": step,
        "stopped_by": stop_reason,
        "train_seconds": round(train_seconds, 1),
        "config": asdict(config),
        "val_top1_per_position": [round(a, 4) for a in agreement],
        **({"val_top1_per_position_by_source": per_source} if per_source else {}),
        "expected_accepted_per_step": {
            str(k): round(expected_accepted(agreement[:k]), 3) for k in range(1, len(agreement) + 1)
        },
        "history": history,
        "parameters": int(sum(p.numel() for p in drafter.parameters())),
    }
    drafter.config.training = report
    save_drafter(drafter, out, dtype=SAVE_DTYPES[config.save_dtype])
    return report


def warm_start(drafter: MedusaHeads | EagleHead, folder: str | Path, target: PreTrainedModel) -> None:
    """Copy the weights of the drafter saved in ``folder`` into ``drafter`` (its own token map is kept:
    the LM-head rows come from the target at attach time, so a map change costs nothing).

    Raises:
        FileNotFoundError: no saved drafter there.
        ValueError: another kind, or a weight of another shape (hidden or MLP size, number of heads).
        IncompatibleModelsError: it was trained for another target.
    """
    saved = load_drafter(folder, target, kind=drafter.config.kind)
    state = {k: v for k, v in saved.state_dict().items() if k != "head_ids" and not k.startswith("_target")}
    own = drafter.state_dict()
    wrong = [k for k, v in state.items() if k not in own or own[k].shape != v.shape]
    if wrong:
        raise ValueError(f"init_from {folder}: weights of another shape or name ({wrong[:3]}); same options needed")
    drafter.load_state_dict(state, strict=False)
