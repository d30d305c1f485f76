"""Train a drafter on the target's own features and predictions (self-distillation).

``specdecode train-drafter --kind medusa|eagle --out DIR`` (:mod:`specdecode.commands.train_drafter`)
does two things:

1. **Features** (:func:`~specdecode.drafters.features.collect_features`): the corpus
   (:mod:`specdecode.drafters.corpus`: text that installs offline, never the benchmark prompts; with
   ``--chat``, chat examples made from its functions) is cut into sequences of ``seq_len`` tokens,
   and the target's features and predictions over them are saved in a features folder
   (:mod:`specdecode.drafters.features`) that both kinds reuse; ``--extra-features`` trains on
   several features folders at once.
2. **Training** (:func:`train_drafter`): AdamW on the drafter only (the target is frozen; the
   drafter scores with the target's LM head rows of a token map built from the labels' counts), on
   the losses of :mod:`specdecode.drafters.losses`. A progress bar (tqdm), a step and a time budget,
   validation of top-1 agreement with the target on held-out sequences
   (:mod:`specdecode.drafters.validation`) every ``val_every`` steps, a checkpoint (drafter,
   optimiser, step, data order) every ``save_every`` steps and at the end; ``resume=True``
   continues from it.

The final report (saved in ``drafter.json`` under ``training``) gives the top-1 agreement per draft
position on the held-out sequences and the expected number of accepted tokens per step for a chain
of k drafts (:func:`~specdecode.drafters.validation.expected_accepted`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specdecode.drafters.features import FEATURES_META, load_features
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
from specdecode.drafters.losses import DISTILL, eagle_loss, medusa_loss
from specdecode.drafters.validation import expected_accepted, validate

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CHECKPOINT = "checkpoint.pt"
SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


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
            features (EAGLE-3's training-time test, see :func:`~specdecode.drafters.losses.eagle_loss`);
            1 = teacher forcing only (EAGLE-1). Each step costs about one more forward and LM-head product.
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
        features_dir: a folder made by :func:`~specdecode.drafters.features.collect_features` for this
            target, or several (one ``seq_len``): trained on together, each holding out its last
            ``val_fraction`` of sequences.
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
