"""lab/gpu/carry_parts.py: a file split into checked parts, received part by part, joined and
checked whole; a changed or missing part is refused."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "carry_parts", Path(__file__).resolve().parents[1] / "gpu" / "carry_parts.py"
)
carry_parts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(carry_parts)


def test_split_receive_assemble_and_refuse(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(carry_parts, "MIB", 1024)  # parts of a few KiB: the same code paths
    monkeypatch.setattr(carry_parts, "CHUNK", 1000)  # blocks that do not divide a part
    data = os.urandom(10 * 1024 + 17)
    original = tmp_path / "model.gguf"
    original.write_bytes(data)
    home = carry_parts.split(original, tmp_path / "parts", part_mib=3)
    folders = sorted(home.glob("part-*"))
    assert [f.name for f in folders] == ["part-000", "part-001", "part-002", "part-003"]
    assert [len((f / "part.bin").read_bytes()) for f in folders] == [3072, 3072, 3072, 1041]

    there = tmp_path / "there"
    assert all(carry_parts.receive(f, there) == 0 for f in folders[:3])
    assert carry_parts.assemble(there / "model.gguf", tmp_path / "joined.gguf") == 1  # one missing
    assert not (tmp_path / "joined.gguf").exists()

    last = folders[3] / "part.bin"
    last.write_bytes(b"x" + last.read_bytes()[1:])  # changed in transit
    assert carry_parts.receive(folders[3], there) == 2
    last.write_bytes(data[3 * 3072 :])
    assert carry_parts.receive(folders[3], there) == 0
    assert carry_parts.assemble(there / "model.gguf", tmp_path / "joined.gguf") == 0
    assert (tmp_path / "joined.gguf").read_bytes() == data

    kept = there / "model.gguf" / "part-001.bin"  # a kept part spoiled before the join: the whole differs
    kept.write_bytes(bytes(len(kept.read_bytes())))
    assert carry_parts.assemble(there / "model.gguf", tmp_path / "again.gguf") == 2
    assert not (tmp_path / "again.gguf").exists()
