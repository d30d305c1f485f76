"""``specdecode calibrate-early-exit``: measure candidate exit layers of a target; save the fastest.

For each candidate exit layer L the speculative engine decodes a few sample prompts greedily with
:class:`~specdecode.proposers.early_exit.EarlyExitProposer` (k tokens per step), and the target
alone decodes the same prompts. Per L it reports (definitions of docs/design.md §4):

- acceptance rate alpha = accepted / drafted, and mean acceptance length = 1 + accepted / drafts;
- draft cost ratio c = (draft seconds per drafted token) / (target seconds per verification pass),
  from :class:`~specdecode.stats.SpecStats` ``draft_time_s`` / ``target_time_s``;
- predicted speedup ``(1 - alpha^(k+1)) / ((1 - alpha)(k c + 1))``;
- measured tokens/s and measured speedup over the target alone (same prompts, same settings).

The L with the best measured tokens/s is saved for this target (see
:func:`~specdecode.proposers.early_exit.save_exit_layer`); ``EarlyExitConfig(exit_layer=None)``
uses it from then on. Timings are wall-clock on this machine: noisy on shared or busy hardware.

Prompts: a small built-in mix of code and prose (``specdecode/data/calibration_prompts.jsonl``), or a
user file: ``.jsonl`` (one JSON string, or an object with ``prompt``, ``text`` or ``turns``, per
line) or plain text (prompts separated by blank lines).

Example::

    specdecode calibrate-early-exit --layers 4,8,12,16,20 --num-prompts 4 --max-new-tokens 48 -k 4
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

DEFAULT_MAX_NEW_TOKENS = 48
DEFAULT_K = 4
PROMPTS_RESOURCE = ("data", "calibration_prompts.jsonl")


# ---------------------------------------------------------------- inputs
def default_layers(num_layers: int) -> list[int]:
    """Candidate exit layers up to 3/4 of the depth: every layer up to 8 layers deep, every 2nd up to
    16, else every 4th (28 layers -> 4, 8, 12, 16, 20)."""
    step = 1 if num_layers <= 8 else 2 if num_layers <= 16 else 4
    top = min(num_layers - 1, max(1, 3 * num_layers // 4))
    return list(range(step, top + 1, step)) or [1]


def parse_layers(text: str) -> list[int]:
    """``"4,8,12"`` -> ``[4, 8, 12]`` (duplicates dropped, order kept).

    Raises:
        ValueError: not a comma list of integers (the message names ``--layers``).
    """
    try:
        layers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise ValueError(f"--layers must be a comma list of exit layers such as 4,8,12, got {text!r}") from error
    if not layers:
        raise ValueError(f"--layers must name at least one exit layer, got {text!r}")
    return list(dict.fromkeys(layers))


def check_layers(layers: Sequence[int], num_layers: int, name: str = "layers") -> list[int]:
    """Return ``layers`` if every one is an exit layer of a ``num_layers``-layer target.

    Raises:
        ValueError: empty, or a layer outside [1, num_layers - 1] (the message names ``name``).
    """
    bad = [x for x in layers if not isinstance(x, int) or isinstance(x, bool) or not 1 <= x <= num_layers - 1]
    if not layers or bad:
        raise ValueError(f"{name} must be exit layers in [1, {num_layers - 1}] for this target, got {list(layers)}")
    return list(layers)


def _prompt_of(item: Any) -> str | None:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        for key in ("prompt", "text"):
            if isinstance(item.get(key), str):
                return item[key]
        turns = item.get("turns")
        if isinstance(turns, list) and turns and isinstance(turns[0], str):
            return turns[0]
    return None


def load_prompts(path: str | Path | None = None) -> list[str]:
    """Calibration prompts: the built-in set (``path`` None) or a user ``.jsonl`` / text file.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a jsonl line without a prompt, or no prompt at all (the message names the file).
    """
    if path is None:
        text = resources.files("specdecode").joinpath(*PROMPTS_RESOURCE).read_text(encoding="utf-8")
        name = "built-in prompts"
    else:
        path = Path(path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--prompts: no such file: {path}")
        text, name = path.read_text(encoding="utf-8"), str(path)
    if path is None or path.suffix == ".jsonl":
        prompts = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                prompt = _prompt_of(json.loads(line))
            except ValueError:
                prompt = None
            if not prompt:
                raise ValueError(f"{name}, line {number}: expected a JSON string or an object with 'prompt'")
            prompts.append(prompt)
    else:
        prompts = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    if not prompts:
        raise ValueError(f"{name} holds no prompt")
    return prompts


# ---------------------------------------------------------------- measuring
def predicted_speedup(alpha: float, k: int, c: float) -> float:
    """Walltime improvement of speculation with i.i.d. acceptance ``alpha``, k drafts, cost ratio c
    (Leviathan et al. 2023, docs/design.md §4): ``(1 - alpha^(k+1)) / ((1 - alpha)(k c + 1))``."""
    tokens = k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return tokens / (k * c + 1.0)


@dataclass(frozen=True)
class LayerMeasurement:
    """One candidate exit layer, summed over every prompt.

    Attributes:
        exit_layer: L, the decoder layers that drafted.
        acceptance_rate: alpha = accepted / drafted tokens.
        mean_acceptance_length: 1 + accepted / drafts (tokens per target pass).
        draft_cost_ratio: c = (draft s / drafted token) / (target s / verification pass).
        predicted_speedup: from alpha, k and c (:func:`predicted_speedup`).
        tokens_per_second: new tokens / wall seconds with speculation.
        measured_speedup: ``tokens_per_second`` / the target alone's tokens/s.
        identical: prompts whose output equals the target alone's (all of them in float32; bf16
            verification of k + 1 tokens at once can flip a near-tie).
    """

    exit_layer: int
    acceptance_rate: float
    mean_acceptance_length: float
    draft_cost_ratio: float
    predicted_speedup: float
    tokens_per_second: float
    measured_speedup: float
    identical: int


@dataclass
class Calibration:
    """What :func:`calibrate_early_exit` measured and chose.

    Attributes:
        exit_layer: the chosen L (best measured tokens/s).
        rows: one :class:`LayerMeasurement` per candidate, in the order measured.
        target_tokens_per_second: the target alone on the same prompts.
        identity: :func:`~specdecode.proposers.early_exit.target_identity` of the target.
        saved_to: the calibration file written, or None when not saved.
    """

    exit_layer: int
    rows: list[LayerMeasurement]
    target_tokens_per_second: float
    num_speculative_tokens: int
    max_new_tokens: int
    num_prompts: int
    num_hidden_layers: int
    name_or_path: str
    dtype: str
    device: str
    identity: str
    saved_to: str | None = None
    calibrated_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _run(generator: Any, prompts: list[Any], sampling: Any, k: int, speculative: bool) -> tuple[dict, list]:
    """Decode every prompt; return summed counters and the token ids of each output."""
    total = dict.fromkeys(("drafts", "drafted", "accepted", "passes", "new", "wall", "draft_s", "target_s"), 0.0)
    outputs = []
    for ids in prompts:
        result = generator.generate(ids, sampling, num_speculative_tokens=k, speculative=speculative)
        s = result.stats
        outputs.append(result.token_ids)
        for key, value in (("drafts", s.drafts), ("drafted", s.draft_tokens), ("accepted", s.accepted_tokens),
                           ("passes", s.target_forward_passes - 1), ("new", s.new_tokens), ("wall", s.wall_time_s),
                           ("draft_s", s.draft_time_s), ("target_s", s.target_time_s)):  # fmt: skip
            total[key] += value
    return total, outputs


def _measurement(layer: int, t: dict, k: int, baseline_tps: float, identical: int) -> LayerMeasurement:
    alpha = t["accepted"] / t["drafted"] if t["drafted"] else 0.0
    per_pass = t["target_s"] / t["passes"] if t["passes"] else 0.0
    c = (t["draft_s"] / t["drafted"]) / per_pass if t["drafted"] and per_pass > 0 else 0.0
    tps = t["new"] / t["wall"] if t["wall"] > 0 else 0.0
    return LayerMeasurement(
        exit_layer=layer,
        acceptance_rate=alpha,
        mean_acceptance_length=1.0 + t["accepted"] / t["drafts"] if t["drafts"] else 1.0,
        draft_cost_ratio=c,
        predicted_speedup=predicted_speedup(alpha, k, c),
        tokens_per_second=tps,
        measured_speedup=tps / baseline_tps if baseline_tps > 0 else 0.0,
        identical=identical,
    )


def calibrate_early_exit(
    target: Any,
    tokenizer: Any = None,
    layers: Sequence[int] | None = None,
    prompts: Sequence[str | Sequence[int]] | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    num_speculative_tokens: int = DEFAULT_K,
    save: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Calibration:
    """Measure every candidate exit layer on ``prompts`` (greedy); pick and save the fastest.

    Args:
        target: the target ``transformers`` causal LM (Llama / Qwen2 layout).
        tokenizer: the target's tokenizer (string prompts get its chat template); None if every
            prompt is a list of token ids.
        layers: candidate exit layers, each in [1, num_hidden_layers - 1]; default
            :func:`default_layers`.
        prompts: strings or token-id lists; default :func:`load_prompts` (the built-in set).
        max_new_tokens: new tokens per prompt (greedy; a prompt may stop early at EOS).
        num_speculative_tokens: k.
        save: write the choice to the calibration file (``<cache dir>/calibration/early_exit.json``).
        progress: called with one line of text per finished measurement.

    Returns:
        :class:`Calibration`, the chosen exit layer being the one with the best measured tokens/s.

    Raises:
        ValueError: bad layers, k, max_new_tokens or prompts (the message names them), or a target
            layout early exit does not support.
    """
    from specdecode.engine import SpeculativeGenerator, check_num_speculative_tokens
    from specdecode.proposers.early_exit import (
        EarlyExitConfig,
        EarlyExitProposer,
        early_exit_view,
        num_decoder_layers,
        save_exit_layer,
        target_identity,
    )
    from specdecode.sampling import SamplingParams

    k = check_num_speculative_tokens(num_speculative_tokens)
    sampling = SamplingParams(max_new_tokens=max_new_tokens)
    n_layers = num_decoder_layers(target)
    layers = check_layers(list(layers) if layers is not None else default_layers(n_layers), n_layers)
    early_exit_view(target, layers[0])  # an unsupported layout fails before any decoding
    say = progress or (lambda line: None)
    baseline = SpeculativeGenerator(target, tokenizer=tokenizer)
    baseline.reuse_prompt = False  # timed: every prefill runs
    ids = [baseline.encode_prompt(p).tolist() for p in (prompts if prompts is not None else load_prompts())]
    if not ids:
        raise ValueError("prompts must hold at least one prompt")

    warm = SamplingParams(max_new_tokens=min(8, max_new_tokens))  # untimed: first-call overheads
    baseline.generate(ids[0], warm, speculative=False)
    base, base_out = _run(baseline, ids, sampling, k, speculative=False)
    base_tps = base["new"] / base["wall"] if base["wall"] > 0 else 0.0
    say(f"target alone: {base_tps:.2f} tokens/s")
    rows = []
    for layer in layers:
        proposer = EarlyExitProposer(target, EarlyExitConfig(exit_layer=layer))
        generator = SpeculativeGenerator(target, tokenizer=tokenizer, proposer=proposer)
        generator.reuse_prompt = False
        generator.generate(ids[0], warm, num_speculative_tokens=k)
        totals, outputs = _run(generator, ids, sampling, k, speculative=True)
        same = sum(a == b for a, b in zip(outputs, base_out, strict=True))
        rows.append(_measurement(layer, totals, k, base_tps, same))
        r = rows[-1]
        say(f"exit layer {layer}: acceptance {r.acceptance_rate:.2f}, {r.tokens_per_second:.2f} tokens/s")
    best = max(rows, key=lambda r: r.tokens_per_second)
    result = Calibration(
        exit_layer=best.exit_layer,
        rows=rows,
        target_tokens_per_second=base_tps,
        num_speculative_tokens=k,
        max_new_tokens=max_new_tokens,
        num_prompts=len(ids),
        num_hidden_layers=n_layers,
        name_or_path=str(getattr(target, "name_or_path", "")),
        dtype=str(target.dtype).removeprefix("torch."),
        device=str(target.device),
        identity=target_identity(target),
    )
    if save:
        record = {key: value for key, value in result.to_dict().items() if key not in ("saved_to", "identity")}
        result.saved_to = str(save_exit_layer(target, record))
    return result


# ---------------------------------------------------------------- output
def render_table(cal: Calibration) -> Any:
    """A rich table of the measurements, the chosen exit layer marked."""
    from rich.table import Table

    name = Path(cal.name_or_path).name or "target"
    title = (
        f"early-exit calibration: {name}, {cal.num_hidden_layers} layers, {cal.dtype} on {cal.device}, "
        f"k={cal.num_speculative_tokens}, {cal.num_prompts} prompts x {cal.max_new_tokens} tokens (greedy)"
    )
    caption = (
        "alpha: acceptance rate; acc. len: mean acceptance length; c: draft cost ratio; pred.: predicted "
        "speedup (docs/design.md §4); same: outputs equal to the target alone's; * chosen. Wall-clock timings on "
        "this machine: noisy when it is shared or busy."
    )
    table = Table(title=title, caption=caption)
    for column in ("exit layer", "alpha", "acc. len", "c", "pred.", "tokens/s", "speedup", "same"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_row("target", "", "", "", "", f"{cal.target_tokens_per_second:.2f}", "1.00", "")
    for r in cal.rows:
        mark = " *" if r.exit_layer == cal.exit_layer else ""
        table.add_row(
            f"{r.exit_layer}{mark}",
            f"{r.acceptance_rate:.3f}",
            f"{r.mean_acceptance_length:.2f}",
            f"{r.draft_cost_ratio:.3f}",
            f"{r.predicted_speedup:.2f}",
            f"{r.tokens_per_second:.2f}",
            f"{r.measured_speedup:.2f}",
            f"{r.identical}/{cal.num_prompts}",
            style="bold" if mark else None,
        )
    return table
