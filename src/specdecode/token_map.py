"""Token maps: the N most frequent target tokens, for a draft with a reduced LM head (FR-Spec).

FR-Spec (Zhao et al. 2025, arXiv 2502.14856) restricts the draft's LM head to the tokens that
occur most often, cutting the cost of the head (a large part of a small draft's forward pass). The
draft's ``q`` is then zero outside the map; rejection sampling stays exact, since the residual
``max(0, p - q)`` supplies the target's mass outside it (SGLang calls the file
``--speculative-token-map``).

A map is an int64 list of N distinct token ids: the tokenizer's special and added tokens first (so
that EOS can always be drafted), then the other tokens by descending corpus frequency (ties by id).
When the corpus has fewer distinct tokens than N, unseen ids follow in ascending order (in BPE
vocabularies, a lower id is an earlier, i.e. more frequent, merge).

The corpus ships offline with Python: the standard library's source (``*.py``) and the prose
packaged in site-packages (``.rst`` / ``.md`` / ``.txt`` documents, ``METADATA``, license texts).
That corpus is almost all code and technical English: a map counted on it alone misses everyday
words (" played", " actress", " vehicle"), a quarter of the target's output tokens on prose
prompts. Word-frequency lists (the ``wordfreq`` package, Speer 2022, from Wikipedia, subtitles,
news, books and web text; ``pip install 'specdecode[tokenmap]'``) supply everyday language: each
listed word is tokenized as it appears in running text and counted by its frequency
(:func:`word_list_counts`), and :func:`mix_counts` weighs the two kinds of corpus.
Benchmark prompts (Spec-Bench, HumanEval) are never read.

Files: ``.npy`` (int32 on disk, loaded as int64) or ``.pt`` (a ``torch.save``'d 1-D tensor, the
format of FR-Spec's and SGLang's maps). :data:`DEFAULT_TOKEN_MAP` ships in the package: the
65,536 most frequent tokens of the Qwen2.5 tokenizer (the default target's), counted by
``specdecode build-token-map --size 65536`` with the default corpus (standard library, packaged
prose and the English word list, half and half); ``draft_vocab_size`` takes its first N. It is
derived in part from wordfreq's data (Robyn Speer, CC BY-SA 4.0); it holds token ids only.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdecode.errors import MissingDependencyError

DEFAULT_TOKEN_MAP = Path(__file__).resolve().parent / "data" / "token_map_qwen2.5_65536.npy"
CORPORA = ("stdlib", "site-packages")
WORD_LIST_PREFIX = "wordfreq-"  # a corpus source "wordfreq-<language>", e.g. "wordfreq-en"
DEFAULT_CORPUS = ("stdlib", "site-packages", "wordfreq-en")
DEFAULT_WORD_LIST_WEIGHT = 0.5
DEFAULT_WORDS = 100_000
# How a listed (lower-case) word appears in running text, and the share of its occurrences given to
# each form: after a space, capitalised after a space (names, titles), capitalised at a line start.
WORD_FORMS = ((" ", False, 0.7), (" ", True, 0.2), ("", True, 0.1))
# Languages written without spaces between words: a listed word is counted as it is.
UNSPACED_LANGUAGES = ("zh", "ja")
PROSE_SUFFIXES = (".rst", ".md", ".txt")
PROSE_NAMES = ("METADATA", "LICENSE", "COPYING", "NOTICE", "AUTHORS")
MAX_PROSE_BYTES = 1 << 20
# Never read benchmark data, wherever it is installed (compared with '-' and '_' removed, lower case).
EXCLUDED = ("humaneval", "specbench", "mtbench")
REPORT_SIZES = (8192, 16384, 32768, 65536)


# ---------------------------------------------------------------- corpus
def _excluded(path: Path) -> bool:
    flat = str(path).lower().replace("-", "").replace("_", "")
    return any(name in flat for name in EXCLUDED)


def _is_prose(path: Path) -> bool:
    return path.suffix in PROSE_SUFFIXES or path.name.startswith(PROSE_NAMES)


def corpus_files(sources: Sequence[str] = CORPORA) -> list[Path]:
    """The files of the corpus, sorted (so that a map is reproducible on one installation).

    Args:
        sources: ``"stdlib"`` (``*.py`` under ``sysconfig.get_paths()["stdlib"]``, installed
            packages excluded), ``"site-packages"`` (prose files of at most 1 MiB under purelib and
            platlib), or a folder (its ``*.py`` and prose files).

    Raises:
        ValueError: a source that is neither a known name nor an existing folder.
    """
    files: set[Path] = set()
    for source in sources:
        if source == "stdlib":
            root = Path(sysconfig.get_paths()["stdlib"])
            files.update(p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.parts))
        elif source == "site-packages":
            for root in {Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}:
                files.update(p for p in root.rglob("*") if _is_prose(p) and p.is_file())
        elif Path(source).is_dir():
            files.update(p for p in Path(source).rglob("*") if (p.suffix == ".py" or _is_prose(p)) and p.is_file())
        else:
            raise ValueError(f"corpus: {source!r} is neither one of {list(CORPORA)} nor a folder")
    return sorted(p for p in files if not _excluded(p))


def read_texts(paths: Iterable[Path]) -> Iterator[str]:
    """The UTF-8 text of each file. Skipped: files that are not UTF-8, prose files over 1 MiB, and
    prose that is mostly not letters (numeric data shipped as ``.txt``)."""
    for path in paths:
        if _is_prose(path) and path.stat().st_size > MAX_PROSE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if _is_prose(path):
            visible = sum(not c.isspace() for c in text)
            if not visible or sum(c.isalpha() for c in text) < 0.5 * visible:
                continue
        if text:
            yield text


# ---------------------------------------------------------------- word-frequency lists
def word_list_language(source: str) -> str | None:
    """The language of a ``"wordfreq-<language>"`` corpus source, or None for any other source."""
    return source[len(WORD_LIST_PREFIX) :] if source.startswith(WORD_LIST_PREFIX) else None


def word_list_counts(tokenizer: Any, language: str, words: int = DEFAULT_WORDS) -> np.ndarray:
    """Expected token counts of running text in ``language``, from its word-frequency list.

    The ``words`` most frequent words of ``wordfreq.top_n_list(language, words)`` (Speer 2022) are
    tokenized in each form of :data:`WORD_FORMS` (``" word"``, ``" Word"``, ``"Word"``; as it is in
    Chinese and Japanese); every token of a form is counted ``word_frequency(word) * share(form)``
    times. Punctuation and digits are not in the lists (the file corpus supplies them).

    Args:
        tokenizer: a Hugging Face tokenizer (the target's).
        language: a wordfreq language code, e.g. ``"en"``, ``"de"``, ``"zh"``.
        words: how many of the most frequent words to count, >= 1.

    Returns:
        float64 ``[len(tokenizer)]`` counts summing to the mean number of tokens per word occurrence
        (about 1.2 for English).

    Raises:
        MissingDependencyError: ``wordfreq`` is not installed (the message gives the pip command).
        ValueError: ``language`` has no wordfreq list, or ``words`` < 1.
    """
    try:
        import wordfreq
    except ImportError as error:
        raise MissingDependencyError(
            "corpus source 'wordfreq-<language>' needs the wordfreq package: pip install 'specdecode[tokenmap]'"
        ) from error
    if not isinstance(words, int) or isinstance(words, bool) or words < 1:
        raise ValueError(f"words must be an integer >= 1, got {words!r}")
    languages = sorted(wordfreq.available_languages())
    if language not in languages:
        raise ValueError(f"corpus: no wordfreq list for language {language!r}; available: {', '.join(languages)}")
    listed = wordfreq.top_n_list(language, words)
    frequency = np.array([wordfreq.word_frequency(w, language) for w in listed], dtype=np.float64)  # (W,)
    counts = np.zeros(len(tokenizer), dtype=np.float64)
    forms = (("", False, 1.0),) if language in UNSPACED_LANGUAGES else WORD_FORMS
    for prefix, capitalise, share in forms:
        ids, lengths = encode_flat(tokenizer, [prefix + (w[:1].upper() + w[1:] if capitalise else w) for w in listed])
        counts += np.bincount(ids, weights=np.repeat(frequency * share, lengths), minlength=len(counts))[: len(counts)]
    return counts / frequency.sum()


def mix_counts(parts: Sequence[tuple[np.ndarray, float]]) -> np.ndarray:
    """Weigh several corpora's token counts: each part is scaled to ``weight`` of the total.

    Args:
        parts: ``(counts [V], weight)`` pairs; counts non-negative (int or float), weights > 0.
            Parts with no tokens are left out (their weight goes to the others).

    Returns:
        float64 ``[V]``: ``sum(weight * counts / counts.sum())`` over the parts, normalised by the weights used.

    Raises:
        ValueError: no part, a weight <= 0, or parts of different vocabulary sizes.
    """
    if not parts:
        raise ValueError("mix_counts needs at least one part")
    sizes = {int(c.shape[0]) for c, _ in parts}
    if len(sizes) != 1:
        raise ValueError(f"mix_counts: parts have different vocabulary sizes {sorted(sizes)}")
    mixed = np.zeros(sizes.pop(), dtype=np.float64)
    used = 0.0
    for counts, weight in parts:
        if not weight > 0:
            raise ValueError(f"mix_counts: weights must be > 0, got {weight!r}")
        total = float(counts.sum())
        if total > 0:
            mixed += weight * counts.astype(np.float64) / total
            used += weight
    return mixed / used if used else mixed


# ---------------------------------------------------------------- counting and building
def special_token_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's special and added tokens (EOS, chat markers, ...), sorted."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    ids.update(getattr(tokenizer, "added_tokens_decoder", None) or {})
    eos = getattr(tokenizer, "eos_token_id", None)
    ids.update([eos] if isinstance(eos, int) else eos or [])
    return sorted(int(i) for i in ids)


def encode_flat(tokenizer: Any, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize each text on its own (no special tokens) and join the ids.

    Returns:
        (ids int64 ``[sum of lengths]``, lengths int64 ``[len(texts)]``: tokens of each text).
    """
    rows = tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    lengths = np.array([len(row) for row in rows], dtype=np.int64)
    ids = np.concatenate([np.asarray(row, dtype=np.int64) for row in rows] + [np.zeros(0, np.int64)])
    return ids, lengths


def count_tokens(tokenizer: Any, texts: Iterable[str], batch_size: int = 64) -> np.ndarray:
    """How often each token occurs in ``texts`` (each tokenized on its own, no special tokens added).

    Returns:
        int64 ``[len(tokenizer)]`` counts.
    """
    counts = np.zeros(len(tokenizer), dtype=np.int64)
    batch: list[str] = []

    def flush() -> None:
        ids, _ = encode_flat(tokenizer, batch)
        counts[:] += np.bincount(ids, minlength=counts.shape[0])[: counts.shape[0]]
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    return counts


def token_map_from_counts(counts: np.ndarray, size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The ids of ``always``, then the others by descending count (ties: ascending id), ``size`` in all.

    Args:
        counts: int ``[V]`` token counts.
        size: N, 1 <= N <= V.
        always: ids placed first whatever their count (special tokens); at most N of them.

    Returns:
        int64 ``[N]`` distinct ids.

    Raises:
        ValueError: ``size`` outside [1, V], or more ``always`` ids than ``size``.
    """
    V = counts.shape[0]
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= V:
        raise ValueError(f"size must be an integer in [1, {V}] (the vocabulary), got {size!r}")
    first = list(dict.fromkeys(int(i) for i in always if 0 <= int(i) < V))
    if len(first) > size:
        raise ValueError(f"size {size} is smaller than the {len(first)} special tokens, which are always kept")
    order = np.lexsort((np.arange(V), -counts))  # by count descending, then id ascending; (V,)
    rest = order[~np.isin(order, first)][: size - len(first)]
    return torch.tensor(first + rest.tolist(), dtype=torch.int64)


def build_token_map(tokenizer: Any, texts: Iterable[str], size: int) -> torch.Tensor:
    """The ``size`` most frequent tokens of ``texts`` under ``tokenizer``, special tokens first.

    Args:
        tokenizer: a Hugging Face tokenizer (the target's).
        texts: the corpus, e.g. ``read_texts(corpus_files())``.
        size: N, the number of ids, in [1, len(tokenizer)].

    Returns:
        int64 ``[N]`` distinct token ids: :func:`special_token_ids`, then by descending frequency.

    Raises:
        ValueError: ``size`` out of range.
    """
    return token_map_from_counts(count_tokens(tokenizer, texts), size, special_token_ids(tokenizer))


def coverage(counts: np.ndarray, token_map: torch.Tensor) -> float:
    """Fraction of the counted tokens (``counts`` int ``[V]``) whose id is in ``token_map`` ``[N]``."""
    total = int(counts.sum())
    return float(counts[token_map.numpy()].sum()) / total if total else 0.0


# ---------------------------------------------------------------- files
def save_token_map(token_map: torch.Tensor, path: str | Path) -> Path:
    """Write ``token_map`` (int ``[N]``) to ``path``: ``.npy`` (stored as int32) or ``.pt``.

    Raises:
        ValueError: another suffix.
    """
    path = Path(path)
    ids = torch.as_tensor(token_map, dtype=torch.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".npy":
        np.save(path, ids.numpy().astype(np.int32))
    elif path.suffix == ".pt":
        torch.save(ids, path)
    else:
        raise ValueError(f"token map file must end in .npy or .pt, got {path}")
    return path


def resolve_token_map(spec: str | Path) -> Path:
    """``"default"`` -> :data:`DEFAULT_TOKEN_MAP`; a path -> itself.

    Raises:
        FileNotFoundError: no such file.
    """
    path = DEFAULT_TOKEN_MAP if str(spec) == "default" else Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no such token map file: {path}")
    return path


def load_token_map(spec: str | Path) -> torch.Tensor:
    """Read a token map (``"default"``, or a ``.npy`` / ``.pt`` file).

    Returns:
        int64 ``[N]`` distinct non-negative token ids, most frequent first.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a non-empty 1-D array of distinct non-negative integers, or an unreadable file.
    """
    path = resolve_token_map(spec)
    try:
        if path.suffix == ".pt":
            data = torch.as_tensor(torch.load(path, map_location="cpu", weights_only=True))
        else:
            data = torch.from_numpy(np.load(path, allow_pickle=False))
    except Exception as error:  # any unreadable file is a bad option value
        raise ValueError(f"cannot read token map {path}: {error}") from error
    if data.dim() != 1 or data.numel() == 0 or data.is_floating_point() or data.dtype == torch.bool:
        raise ValueError(f"token map {path} must be a non-empty 1-D integer array, got {data.dtype} {list(data.shape)}")
    ids = data.to(torch.int64)
    if int(ids.min()) < 0 or ids.unique().numel() != ids.numel():
        raise ValueError(f"token map {path} must hold distinct non-negative token ids")
    return ids


# ---------------------------------------------------------------- a corpus of files and word lists
def corpus_counts(
    tokenizer: Any,
    sources: Sequence[str],
    word_list_weight: float = DEFAULT_WORD_LIST_WEIGHT,
    words: int = DEFAULT_WORDS,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Token counts of a corpus made of files and word-frequency lists, and what it was made of.

    Args:
        tokenizer: the target's tokenizer.
        sources: names for :func:`corpus_files` and ``"wordfreq-<language>"`` entries.
        word_list_weight: share of all word lists together in the mix (:func:`mix_counts`), in (0, 1);
            each list gets an equal part of it. Unused when the sources are only files or only lists.
        words: words per list (:func:`word_list_counts`).

    Returns:
        (counts float64 ``[V]``, summary with ``files``, ``characters``, ``file_tokens``, ``word_lists``).

    Raises:
        ValueError: no source, a bad source, or ``word_list_weight`` outside (0, 1).
        MissingDependencyError: a word list without ``wordfreq`` installed.
    """
    if not sources:
        raise ValueError("--corpus is empty")
    if not 0.0 < word_list_weight < 1.0:
        raise ValueError(f"--word-list-weight must be in (0, 1), got {word_list_weight!r}")
    languages = [lang for s in sources if (lang := word_list_language(s)) is not None]
    if any(not lang for lang in languages):
        raise ValueError(f"corpus: {WORD_LIST_PREFIX!r} needs a language, e.g. {WORD_LIST_PREFIX}en")
    file_sources = [s for s in sources if word_list_language(s) is None]
    texts = list(read_texts(corpus_files(file_sources))) if file_sources else []
    file_counts = count_tokens(tokenizer, texts)
    parts: list[tuple[np.ndarray, float]] = []
    if file_sources:
        parts.append((file_counts, 1.0 - word_list_weight if languages else 1.0))
    share = (word_list_weight if file_sources else 1.0) / max(1, len(languages))
    parts.extend((word_list_counts(tokenizer, lang, words), share) for lang in languages)
    summary = {
        "files": len(texts),
        "characters": sum(len(t) for t in texts),
        "file_tokens": int(file_counts.sum()),
        "word_lists": {lang: words for lang in languages},
        "word_list_weight": word_list_weight if file_sources and languages else None,
    }
    return mix_counts(parts), summary
