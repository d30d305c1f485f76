"""A GGUF target's input embeddings and LM-head rows in torch, for drafters that borrow them.

The Medusa heads and the EAGLE head (:mod:`specdecode.drafters.heads`) score their drafts with the
target's LM head restricted to their token map, and the EAGLE head embeds tokens with the target's
input embeddings. On the llamacpp backend the target is a GGUF file run by llama.cpp, so these
tensors are read from the file with the ``gguf`` package (``GGUFReader``, memory-mapped) and
dequantized to float32 with its numpy kernels (``gguf.quants.dequantize``: Q4_K, Q6_K, Q8_0, F16,
...), only the rows needed: the map's head rows once, embedding rows per call. ``output.weight``
is the LM head; a GGUF without it ties the head to ``token_embd.weight`` (as llama.cpp does).
The drafter then reads the same (quantized) weights llama.cpp multiplies by.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn


class GGUFTensor:
    """One 2-D tensor of a GGUF file, rows dequantized on demand.

    Args:
        tensor: a ``gguf.ReaderTensor`` (its ``data`` is the file's bytes, one row per token).

    Attributes:
        rows, cols: the matrix shape (GGUF writes it as ``[cols, rows]``).
    """

    def __init__(self, tensor: Any) -> None:
        self._tensor = tensor
        self.cols, self.rows = (int(n) for n in tensor.shape[:2])
        self.name = str(tensor.name)
        self.qtype = tensor.tensor_type

    def take(self, ids: np.ndarray | list[int]) -> torch.Tensor:
        """float32 ``[len(ids), cols]``: rows ``ids`` dequantized.

        Raises:
            ValueError: an id outside ``[0, rows)``.
        """
        from gguf.quants import dequantize

        index = np.asarray(ids, dtype=np.int64).reshape(-1)
        if index.size and (int(index.min()) < 0 or int(index.max()) >= self.rows):
            raise ValueError(f"{self.name}: row ids must be in [0, {self.rows}), got {index.min()}..{index.max()}")
        data = np.asarray(self._tensor.data)[index]  # (n, bytes per row) or (n, cols) for float types
        values = dequantize(data, self.qtype).reshape(len(index), self.cols)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


class GGUFEmbedding(nn.Module):
    """The target's input embeddings from its GGUF file: int64 ids ``[...] -> float32 [..., H]``
    (rows dequantized per call; no parameters, nothing trained)."""

    def __init__(self, table: GGUFTensor) -> None:
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu().numpy()
        return self.table.take(flat).view(*ids.shape, self.table.cols).to(ids.device)


class GGUFTargetParts:
    """The embeddings and LM head of a GGUF model.

    Args:
        path: the ``.gguf`` file.

    Attributes:
        embeddings: ``token_embd.weight`` (V rows of H).
        head: ``output.weight``, or the embeddings when the file ties them.

    Raises:
        ImportError: the ``gguf`` package is missing.
        ValueError: the file has no ``token_embd.weight``.
    """

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        tensors = {t.name: t for t in reader.tensors}
        if "token_embd.weight" not in tensors:
            raise ValueError(f"{path}: no token_embd.weight in this GGUF file")
        self.embeddings = GGUFTensor(tensors["token_embd.weight"])
        self.head = GGUFTensor(tensors["output.weight"]) if "output.weight" in tensors else self.embeddings

    def embedding_module(self) -> GGUFEmbedding:
        return GGUFEmbedding(self.embeddings)
