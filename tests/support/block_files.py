"""Reading a disk tier's directory from outside: the block files of a token path, in order."""

from __future__ import annotations

from pathlib import Path

from kvgen.kv.block_file import SUFFIX, read_header


def block_chain(directory: Path) -> list[Path]:
    """The block files of the one token path in `directory`, first block first (each file's
    metadata names its parent's key; the first block's parent is a root, not a file)."""
    files = {p.name.removesuffix(SUFFIX): p for p in directory.glob("*" + SUFFIX)}
    children = {read_header(p)["parent"]: key for key, p in files.items()}
    ordered = [next(key for parent, key in children.items() if parent not in files)]
    while ordered[-1] in children:
        ordered.append(children[ordered[-1]])
    return [files[key] for key in ordered]
