"""Load Hugging Face models (the torch backend) from a local HF folder, a ``.gguf`` file (converted
once to a cached folder) or the default pair; or build one of the same architecture with random
weights (:func:`random_model`: pass costs measured where the weights cannot be)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specdecode.errors import ModelNotFoundError
from specdecode.models.default import NAMED_MODELS, ensure_default_model, ensure_gguf_model, ensure_named_model
from specdecode.models.torch.cpu import auto_dtype, prepack, use_onednn_linears
from specdecode.models.torch.placement import place_model, resolve_device

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ARCHITECTURES = Path(__file__).resolve().parents[2] / "data" / "architectures"
"""The default pair's ``config.json`` files (``<name>.json``), for :func:`random_model` without the weights."""
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DTYPE_CHOICES = ("auto", *DTYPES)  # what --dtype accepts


def parse_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """``"auto"`` / ``"bfloat16"`` / ``"float32"`` (or the torch dtype) -> torch dtype.

    ``"auto"`` is :func:`specdecode.models.torch.cpu.auto_dtype` for ``device``: bfloat16 on a GPU, and
    on a CPU that multiplies bf16 natively, float32 on other CPUs (there a pass over k + 1 tokens
    costs k + 1 bf16 passes, which no speculation can win back).

    Raises:
        ValueError: any other value.
    """
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype == "auto":
        return DTYPES[auto_dtype(device)]
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {dtype!r}")


def resolve_model_dir(spec: str | Path | None, role: str) -> Path:
    """Folder of an HF-format model for ``spec``.

    Args:
        spec: an HF model folder, a ``.gguf`` file (converted once to cached bf16 safetensors), the
            name of a packaged model (:data:`~specdecode.models.default.NAMED_MODELS`, e.g.
            ``"smollm2"``; a file or folder of that name takes precedence), or None for the
            default ``role`` model.
        role: ``"target"`` or ``"draft"`` (names the parameter in errors).

    Raises:
        ModelNotFoundError: the path does not exist, is not a model, or the default or named model
            is not installed.
    """
    if spec is None:
        return ensure_default_model(role)
    path = Path(spec).expanduser()
    if isinstance(spec, str) and spec in NAMED_MODELS and not path.exists():
        return ensure_named_model(spec)
    if not path.exists():
        raise ModelNotFoundError(f"--{role}: no such file or folder: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"--{role}: {path} is a file but not a .gguf file")
        return ensure_gguf_model(path)
    if not (path / "config.json").exists():
        raise ModelNotFoundError(f"--{role}: {path} has no config.json; not a Hugging Face model folder")
    return path


def load_model(
    spec: str | Path | None,
    role: str,
    dtype: str | torch.dtype = "auto",
    onednn: bool = True,
    prepack_now: bool = False,
    device: str | torch.device = "cpu",
    cuda_graphs: bool = True,
    exact: bool = False,
) -> PreTrainedModel:
    """Load a causal LM in ``dtype`` for inference on ``device`` (``spec`` as in :func:`resolve_model_dir`).

    ``device`` (:func:`specdecode.models.torch.placement.resolve_device`: ``"auto"``, ``"cpu"``,
    ``"cuda"``, ...): the model moves there after loading; on a CUDA device with ``cuda_graphs`` its
    runners keep a static KV cache and replay CUDA graphs
    (:func:`specdecode.models.torch.placement.place_model`).

    A float32 model on the CPU gets its large linear layers routed through oneDNN for passes of
    few tokens (:func:`specdecode.models.torch.cpu.use_onednn_linears`; ``onednn=False`` keeps torch's
    default kernels). With ``prepack_now``, such a model takes its packing decision and makes its
    prepacked copies at once (:func:`specdecode.models.torch.cpu.prepack`): for a target loaded before
    its draft, so that the draft's copies cannot leave it without them. A collection of Python's
    cycle collector runs first, so that a model loaded after another was dropped does not find
    memory still held by objects in reference cycles (routed layers themselves form none: they
    hold their layer weakly).

    With ``exact``, a bfloat16 or float16 model is marked for exact passes (every row of a
    verification pass bit-identical to a one-token pass): on the CPU one query row per attention call
    (:func:`specdecode.models.torch.exact.use_exact_passes`), on a CUDA device fixed-width passes
    (:func:`~specdecode.models.torch.placement.place_model`); float32 models are left as they are.

    Raises:
        ModelNotFoundError, ValueError: see :func:`resolve_model_dir`, :func:`parse_dtype` and
            :func:`~specdecode.models.torch.placement.resolve_device`.
    """
    place = resolve_device(device)
    torch_dtype = parse_dtype(dtype, place)
    gc.collect()  # dropped models caught in reference cycles give their memory back before the next load
    from transformers import AutoModelForCausalLM  # here: choosing a dtype or a device loads no transformers model

    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(spec, role), dtype=torch_dtype)
    return _ready(model, place, torch_dtype, onednn, prepack_now, cuda_graphs, exact)


def _ready(model: PreTrainedModel, place: torch.device, torch_dtype: torch.dtype, onednn: bool, prepack_now: bool,
           cuda_graphs: bool, exact: bool = False) -> PreTrainedModel:  # fmt: skip
    """A built model made ready as :func:`load_model` describes: placed, or on the CPU routed through
    oneDNN, or marked for exact passes."""
    from specdecode.models.torch.exact import EXACT_DTYPES, use_exact_passes, wants_exact_passes

    if place.type != "cpu":  # exact on a GPU: fixed-width passes (16-bit weights; float32 as it is)
        exact_here = exact and torch_dtype in EXACT_DTYPES
        return place_model(model.eval(), place, cuda_graphs, exact_here)  # type: ignore[return-value]
    if onednn and torch_dtype == torch.float32:
        use_onednn_linears(model)
        if prepack_now:
            prepack(model)
    if exact and wants_exact_passes(model):
        use_exact_passes(model)
    return model.eval()


def model_config(spec: str | Path | None, role: str) -> Any:
    """The ``transformers`` configuration of a model, reading no weights: a Hugging Face folder's
    ``config.json``, or for ``spec`` None the default ``role`` model's (:data:`ARCHITECTURES`,
    shipped: the default pair need not be installed).

    Raises:
        ModelNotFoundError: ``spec`` is not a folder with a ``config.json`` (a ``.gguf`` file or a
            packaged name: its architecture is not known without its weights).
    """
    from transformers import AutoConfig

    from specdecode.models.default import DEFAULT_MODELS

    if spec is None:
        return AutoConfig.from_pretrained(ARCHITECTURES / f"{DEFAULT_MODELS[role].name}.json")
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"--{role}: random weights need a Hugging Face folder with a config.json (or the default "
            f"model), got {spec}; a .gguf file is measured as it is, on llama.cpp"
        )
    return AutoConfig.from_pretrained(path)


def random_model(
    spec: str | Path | None,
    role: str,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    cuda_graphs: bool = True,
    seed: int = 0,
    exact: bool = False,
) -> PreTrainedModel:
    """A model of ``spec``'s architecture (:func:`model_config`) with random weights (the
    architecture's own initialization, seeded), made ready as :func:`load_model` makes a loaded
    one: what a pass of it costs is what a pass of the real model costs, on this device, dtype and
    runner. Built on ``device`` directly (a GPU never holds a CPU copy).

    Raises:
        ModelNotFoundError, ValueError: see :func:`model_config`, :func:`parse_dtype` and
            :func:`~specdecode.models.torch.placement.resolve_device`.
    """
    place = resolve_device(device)
    torch_dtype = parse_dtype(dtype, place)
    config = model_config(spec, role)
    gc.collect()
    torch.manual_seed(seed)
    with torch.device(place):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    return _ready(model, place, torch_dtype, True, role == "target", cuda_graphs, exact)


def load_tokenizer(model_dir: Path) -> Any:
    """The tokenizer saved in ``model_dir``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
