"""Carry a file larger than one device call allows (issue 49, item 3: the default target's GGUF,
1.1 GB, to the GPU machine) in parts, each SHA-256-checked, assembled and checked whole there.

A device call carries the checkout and the git-ignored folders it names, 64 MiB in all, and a warm
machine keeps ``/tmp`` for 30 s between calls. So: split here into folders of one part each (plus
the manifest), carry one folder per call, back to back, ``receive`` it into ``/tmp`` there, and
``assemble`` once every part is in. The standard library, and for the join the checkout's own
``specdecode.models.default.join_parts``.

Here::

    python lab/gpu/carry_parts.py plan --slim               # the part size beside a slimmed checkout
    python lab/gpu/carry_parts.py split FILE --out .gpu-parts   # parts of that size
    bash lab/gpu/gpu_check.sh hold --slim                   # before the calls (restore after them)

There (one call per part, ``carry=[".gpu-parts/NAME/part-007"]``)::

    python3 lab/gpu/carry_parts.py receive .gpu-parts/NAME/part-007 --into /tmp/carry
    python3 lab/gpu/carry_parts.py assemble /tmp/carry/NAME --out /tmp/models/NAME

``receive`` and ``assemble`` print what is in and what is missing, and exit 1 on a missing part and
2 on a checksum that differs (the part or the whole is then not kept).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20
CHUNK = 8 * MIB
CALL_MIB = 64
"""What one device call carries at most: the checkout's tracked files plus the carried folders."""
MARGIN_MIB = 4
"""Room left in a call for untracked files, the manifest and the checkout growing between calls."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def checkout_bytes(slim: bool = False) -> int:
    """Bytes of the tracked files a call carries, without what ``lab/gpu/gpu_check.sh hold`` moves
    out before a call (the drafters' weights; ``--slim``: lab/results too)."""
    names = subprocess.run(["git", "ls-files", "-z"], capture_output=True, check=True).stdout.split(b"\0")
    total = 0
    for raw in names:
        name = raw.decode()
        held = name.startswith("src/specdecode/data/drafters/") and name.endswith(".safetensors")
        if not name or held or (slim and name.startswith("lab/results/")):
            continue
        path = Path(name)
        total += path.stat().st_size if path.is_file() else 0
    return total


def plan(slim: bool = False) -> int:
    """The largest whole MiB a part may have beside this checkout (printed with the arithmetic)."""
    tracked = checkout_bytes(slim)
    part = CALL_MIB - MARGIN_MIB - -(-tracked // MIB)
    held = "drafter weights and lab/results held" if slim else "drafter weights held"
    print(f"checkout (tracked, {held}): {tracked / MIB:.1f} MiB; a call carries {CALL_MIB} MiB;")
    print(f"parts of at most {part} MiB (margin {MARGIN_MIB} MiB)")
    return part


def split(file: Path, out: Path, part_mib: int) -> Path:
    """``file`` cut into parts of ``part_mib`` MiB: ``out/NAME/part-NNN/{part.bin,manifest.json}``
    (each folder one call's load and self-describing) and ``out/NAME/manifest.json``; returns
    ``out/NAME``. The manifest: name, size and SHA-256 of the whole, and of every part."""
    if part_mib < 1:
        raise ValueError(f"--part-mib must be >= 1, got {part_mib}")
    home = out / file.name
    if home.exists():
        shutil.rmtree(home)
    parts, whole = [], hashlib.sha256()
    with file.open("rb") as f:
        index = 0
        while True:
            folder = home / f"part-{index:03d}"
            folder.mkdir(parents=True)
            digest, size = hashlib.sha256(), 0
            with (folder / "part.bin").open("wb") as dst:
                while size < part_mib * MIB and (block := f.read(min(CHUNK, part_mib * MIB - size))):
                    dst.write(block)
                    digest.update(block)
                    whole.update(block)
                    size += len(block)
            if size == 0:
                shutil.rmtree(folder)
                break
            parts.append({"index": index, "size": size, "sha256": digest.hexdigest()})
            index += 1
    manifest = {"name": file.name, "size": file.stat().st_size, "sha256": whole.hexdigest(), "parts": parts}
    text = json.dumps(manifest, indent=1)
    (home / "manifest.json").write_text(text)
    for part in parts:
        (home / f"part-{part['index']:03d}" / "manifest.json").write_text(text)
    return home


def _missing(home: Path, manifest: dict) -> list[int]:
    return [p["index"] for p in manifest["parts"] if not (home / f"part-{p['index']:03d}.bin").is_file()]


def receive(folder: Path, into: Path) -> int:
    """Check a carried ``part-NNN`` folder against its manifest and keep the part under
    ``into/NAME/``; 0 when kept, 2 on a checksum that differs (nothing kept)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    index = int(folder.name.removeprefix("part-"))
    (entry,) = [p for p in manifest["parts"] if p["index"] == index]
    data = folder / "part.bin"
    found = sha256_of(data)
    if data.stat().st_size != entry["size"] or found != entry["sha256"]:
        print(f"part {index}: SHA-256 {found} differs from the manifest's {entry['sha256']}: not kept")
        return 2
    home = into / manifest["name"]
    home.mkdir(parents=True, exist_ok=True)
    (home / "manifest.json").write_text(json.dumps(manifest, indent=1))
    shutil.copyfile(data, home / f"part-{index:03d}.bin")
    missing = _missing(home, manifest)
    total = len(manifest["parts"])
    print(f"part {index} kept; {total - len(missing)} of {total} in; missing {missing}")
    return 0


def assemble(home: Path, out: Path) -> int:
    """Join the parts under ``home`` into ``out`` and check the whole's SHA-256 (the product's own
    :func:`specdecode.models.default.join_parts`, which joins the default models' PyPI parts); 1
    while a part is missing, 2 when the whole differs (nothing left at ``out``), else 0."""
    manifest = json.loads((home / "manifest.json").read_text())
    missing = _missing(home, manifest)
    if missing:
        print(f"{manifest['name']}: parts missing {missing}")
        return 1
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))  # the checkout's specdecode
    from specdecode.models.default import join_parts

    parts = [home / f"part-{part['index']:03d}.bin" for part in manifest["parts"]]
    try:
        join_parts(parts, out, manifest["sha256"])
    except ValueError:
        print(f"{manifest['name']}: the joined file's SHA-256 differs from the manifest's: not kept")
        return 2
    print(f"{out}: {manifest['size']} bytes, SHA-256 {manifest['sha256']} (as the manifest)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="the part size that fits beside this checkout in one call")
    p.add_argument("--slim", action="store_true", help="after 'gpu_check.sh hold --slim' (lab/results out)")
    s = sub.add_parser("split", help="here: cut FILE into part folders")
    s.add_argument("file", type=Path)
    s.add_argument("--out", type=Path, default=Path(".gpu-parts"))
    s.add_argument("--part-mib", type=int, default=None, help="MiB per part (default: what plan --slim says)")
    r = sub.add_parser("receive", help="there: check a carried part folder and keep its part")
    r.add_argument("folders", type=Path, nargs="+")
    r.add_argument("--into", type=Path, default=Path("/tmp/carry"))
    a = sub.add_parser("assemble", help="there: join the kept parts and check the whole")
    a.add_argument("home", type=Path, help="the kept parts' folder (receive's --into / NAME)")
    a.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "plan":
        plan(args.slim)
        return 0
    if args.command == "split":
        home = split(args.file, args.out, args.part_mib or plan(slim=True))
        print(f"{home}: {len(list(home.glob('part-*')))} parts")
        return 0
    if args.command == "receive":
        return max(receive(folder, args.into) for folder in args.folders)
    return assemble(args.home, args.out)


if __name__ == "__main__":
    sys.exit(main())
