"""``specdecode build-token-map``: count a corpus with the target's tokenizer and save its N most
frequent tokens, for ``--token-map`` (FR-Spec; :mod:`specdecode.token_map`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from specdecode.commands.common import add_command_parser
from specdecode.token_map import (
    CORPORA,
    DEFAULT_CORPUS,
    DEFAULT_WORD_LIST_WEIGHT,
    DEFAULT_WORDS,
    REPORT_SIZES,
    WORD_LIST_PREFIX,
    corpus_counts,
    coverage,
    save_token_map,
    special_token_ids,
    token_map_from_counts,
)


def add_token_map_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``build-token-map`` subcommand to ``subparsers`` (from ``add_subparsers``)."""
    t = add_command_parser(
        subparsers,
        "build-token-map",
        "build a token map: the N most frequent target tokens, for --token-map (FR-Spec)",
    )
    t.add_argument(
        "--target",
        help="target whose tokenizer counts: HF model folder or .gguf file (default: Qwen2.5-Coder-1.5B-Instruct)",
    )
    t.add_argument("--size", type=int, default=32768, metavar="N", help="tokens in the map (default 32768)")
    t.add_argument("--out", metavar="FILE", help="output .npy or .pt file (default: token_map_<N>.npy)")
    corpus = f"comma list of {', '.join(CORPORA)}, {WORD_LIST_PREFIX}<language> (a word-frequency list) or folders"
    t.add_argument(
        "--corpus",
        default=",".join(DEFAULT_CORPUS),
        metavar="LIST",
        help=f"{corpus} (default: {','.join(DEFAULT_CORPUS)})",
    )
    t.add_argument(
        "--word-list-weight",
        type=float,
        default=DEFAULT_WORD_LIST_WEIGHT,
        metavar="W",
        help=f"share of the word-frequency lists in the counts, in (0, 1) (default {DEFAULT_WORD_LIST_WEIGHT})",
    )
    t.add_argument(
        "--words", type=int, default=DEFAULT_WORDS, metavar="N", help=f"words per list (default {DEFAULT_WORDS})"
    )
    t.set_defaults(func=cmd_build_token_map)
    return t


def cmd_build_token_map(args: argparse.Namespace) -> int:
    """Count the corpus, save the map, print one JSON object: corpus size and coverage per N."""
    from specdecode.models.torch.hf_loading import load_tokenizer, resolve_model_dir

    sources = [s.strip() for s in args.corpus.split(",") if s.strip()]
    tokenizer = load_tokenizer(resolve_model_dir(args.target, "target"))
    counts, made_of = corpus_counts(tokenizer, sources, args.word_list_weight, args.words)
    always = special_token_ids(tokenizer)
    token_map = token_map_from_counts(counts, args.size, always)
    out = save_token_map(token_map, args.out or f"token_map_{args.size}.npy")
    sizes = sorted(n for n in {*REPORT_SIZES, len(token_map)} if n <= counts.shape[0])
    summary = {
        "out": str(out),
        "size": len(token_map),
        "corpus": sources,
        **made_of,
        "distinct_tokens": int((counts > 0).sum()),
        "coverage": {n: coverage(counts, token_map_from_counts(counts, n, always[:n])) for n in sizes},
    }
    print(json.dumps(summary))
    return 0
