"""The target's features over the corpus, the labels of self-distillation, saved in shards.

The target runs over each token sequence (:mod:`specdecode.drafters.corpus`; no gradient) and we
keep, per position p, the token ``x_p``, the feature ``f_p`` (final hidden state after the norm,
bfloat16) and ``y_p = argmax lm_head(f_p)``, the target's own prediction of token ``p + 1``. Those
predictions are the labels: no other model and no labelled data are needed (Medusa-2's and EAGLE's
self-distillation, here on the target's predictions over corpus text rather than on its
generations, which would take hours on a CPU). A features folder (``shard-*.safetensors`` and
:data:`FEATURES_META`) is made once per target, corpus and ``seq_len`` (resumably) and serves
both drafter kinds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specdecode.drafters.corpus import token_sequences
from specdecode.drafters.heads import target_identity

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FEATURES_META = "features.json"


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
