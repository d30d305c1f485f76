"""``specdecode train-drafter``: train Medusa heads or an EAGLE-style head for a target on its own
features (self-distillation; :mod:`specdecode.drafters.train`).

Example::

    specdecode train-drafter --kind eagle --max-tokens 200000 --time-budget-min 60
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from specdecode.commands.common import add_command_parser, add_dtype_arg
from specdecode.drafters.corpus import chat_texts
from specdecode.drafters.features import FEATURES_META, collect_features
from specdecode.drafters.heads import KINDS, target_identity
from specdecode.drafters.losses import DISTILL
from specdecode.drafters.train import SAVE_DTYPES, TrainConfig, train_drafter


def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``train-drafter`` subcommand to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    p = add_command_parser(
        subparsers,
        "train-drafter",
        "train Medusa heads or an EAGLE-style head for a target on its own features (self-distillation)",
    )
    p.add_argument(
        "--kind",
        choices=KINDS,
        required=True,
        help="the drafter to train (required): medusa, Medusa heads; eagle, an EAGLE-style head",
    )
    p.add_argument(
        "--target", default=None, help="target: HF model folder or .gguf file (default: Qwen2.5-Coder-1.5B-Instruct)"
    )
    add_dtype_arg(p)  # the target's dtype for features: auto avoids bf16 where it is multiplied row by row
    p.add_argument(
        "--data",
        action="append",
        metavar="SOURCE",
        help="corpus: 'stdlib' (Python's standard library source, default), 'site-packages' (packaged prose), "
        "or a folder of .py/.md/.txt files (repeatable)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="turn the corpus's Python functions into chat examples (instruction: complete this function; "
        "answer: the function) in the target's chat template, as an instruct target sees code requests",
    )
    p.add_argument(
        "--features",
        default=None,
        metavar="DIR",
        help="features folder (default: <cache>/features/<target's weights hash>-<data>-<seq-len>)",
    )
    p.add_argument(
        "--extra-features",
        action="append",
        default=[],
        metavar="DIR",
        help="another features folder (made by an earlier run for this target) to train on too (repeatable)",
    )
    p.add_argument("--collect-only", action="store_true", help="collect the features, do not train")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=200_000,
        metavar="N",
        help="corpus tokens to run the target over (default 200000)",
    )
    p.add_argument("--seq-len", type=int, default=512, metavar="N", help="tokens per training sequence (default 512)")
    p.add_argument(
        "--out", default=None, metavar="DIR", help="drafter folder (default: the folder --proposer KIND looks in)"
    )
    defaults = TrainConfig()
    integers = {
        "draft_vocab_size": "token map size: the target's N most frequent predictions, special tokens first",
        "num_heads": "Medusa: heads, the most tokens drafted per step",
        "batch_size": "sequences per optimiser step",
        "max_steps": "step budget",
        "val_every": "held-out validation every N steps",
        "save_every": "checkpoint every N steps",
        "seed": "data order and initialisation",
    }
    for name, text in integers.items():
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=getattr(defaults, name),
            metavar="N",
            help=f"{text} (default {getattr(defaults, name)})",
        )
    p.add_argument(
        "--intermediate-size",
        type=int,
        default=None,
        metavar="N",
        help="EAGLE: MLP width (default: half the target's)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=defaults.lr,
        help=f"AdamW peak learning rate: linear warm-up, then cosine decay to 0 (default {defaults.lr})",
    )
    p.add_argument(
        "--cls-weight",
        type=float,
        default=defaults.cls_weight,
        metavar="W",
        help=f"EAGLE: weight of the classification loss next to feature regression (default {defaults.cls_weight})",
    )
    p.add_argument(
        "--distill",
        choices=DISTILL,
        default=defaults.distill,
        help="classification labels: the target's top-1 prediction, or its whole distribution over the "
        f"token map (soft, KL distillation) (default {defaults.distill})",
    )
    p.add_argument(
        "--loss-positions",
        type=int,
        default=defaults.loss_positions,
        metavar="N",
        help=f"positions per sequence scored by the LM head each step, 0 = all (default {defaults.loss_positions})",
    )
    p.add_argument(
        "--ttt-steps",
        type=int,
        default=defaults.ttt_steps,
        metavar="N",
        help="EAGLE: draft steps unrolled in training on the head's own features (EAGLE-3's training-time "
        f"test), 1 for teacher forcing only (default {defaults.ttt_steps})",
    )
    p.add_argument(
        "--save-dtype",
        choices=list(SAVE_DTYPES),
        default=defaults.save_dtype,
        help=f"dtype of the saved weights (default {defaults.save_dtype}: half the file of float32)",
    )
    p.add_argument(
        "--time-budget-min",
        type=float,
        default=None,
        metavar="MIN",
        help="stop training after MIN minutes (default: none)",
    )
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument(
        "--init-from",
        default=None,
        metavar="DIR",
        help="start from this saved drafter's weights (same kind and sizes; new token map, optimiser, schedule)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_train_drafter)
    return p


def cmd_train_drafter(args: argparse.Namespace) -> int:
    """Collect the target's features on the corpus (resumable), then train and save the drafter."""
    from specdecode.drafters import default_drafter_dir
    from specdecode.models.default import cache_dir
    from specdecode.models.torch.hf_loading import load_model, load_tokenizer, resolve_model_dir
    from specdecode.token_map import corpus_files, read_texts, special_token_ids

    config = TrainConfig(
        kind=args.kind,
        draft_vocab_size=args.draft_vocab_size,
        num_heads=args.num_heads,
        intermediate_size=args.intermediate_size,
        batch_size=args.batch_size,
        lr=args.lr,
        cls_weight=args.cls_weight,
        distill=args.distill,
        max_steps=args.max_steps,
        time_budget_s=None if args.time_budget_min is None else args.time_budget_min * 60.0,
        val_every=args.val_every,
        save_every=args.save_every,
        loss_positions=args.loss_positions or None,
        ttt_steps=args.ttt_steps,
        seed=args.seed,
        save_dtype=args.save_dtype,
    )
    sources = args.data or ["stdlib"]
    files = corpus_files(sources)  # bad sources fail before the model loads
    if args.init_from is not None:
        from specdecode.drafters.heads import CONFIG_FILE, WEIGHTS_FILE

        if not all((Path(args.init_from) / name).is_file() for name in (CONFIG_FILE, WEIGHTS_FILE)):
            raise ValueError(f"--init-from {args.init_from}: no saved drafter there ({CONFIG_FILE}, {WEIGHTS_FILE})")
    for extra in args.extra_features:
        if not (Path(extra) / FEATURES_META).is_file():
            raise ValueError(f"--extra-features {extra}: no {FEATURES_META} there (collect features into it first)")
    random.Random(args.seed).shuffle(files)  # a sample across the corpus, not its first files alphabetically
    target_dir = resolve_model_dir(args.target, "target")
    target = load_model(target_dir, "target", args.dtype)
    tokenizer = load_tokenizer(target_dir)
    identity = target_identity(target)
    tag = "-".join(Path(s).name or "corpus" for s in sources) + ("-chat" if args.chat else "")
    features = (
        Path(args.features)
        if args.features
        else (cache_dir() / "features" / f"{identity['weights_hash']}-{tag}-{args.seq_len}")
    )
    print(f"train-drafter: {len(files)} corpus files ({', '.join(sources)}); features in {features}")
    texts = read_texts(files)
    collect_features(
        target,
        tokenizer,
        chat_texts(tokenizer, texts, args.seed) if args.chat else texts,
        features,
        args.max_tokens,
        args.seq_len,
        progress=not args.no_progress,
        source=", ".join(sources) + (" (chat examples of its functions)" if args.chat else ""),
    )
    if args.collect_only:
        print(f"train-drafter: features in {features} (--collect-only: no training)")
        return 0
    out = Path(args.out) if args.out else default_drafter_dir(args.kind, target)
    report = train_drafter(
        target,
        [features, *args.extra_features],
        out,
        config,
        special_token_ids(tokenizer),
        resume=args.resume,
        init_from=args.init_from,
        progress=not args.no_progress,
    )
    print(json.dumps({k: v for k, v in report.items() if k != "history"}, indent=2))
    print(f"train-drafter: saved {args.kind} drafter in {out}")
    return 0
