"""One KV block in one file: a safetensors file whose metadata says whose block it is.

    u64 header length | JSON header (tensor layout + "__metadata__") | tensor bytes

The metadata holds the block's identity (model fingerprint, weight mode, storage format, block
size, namespace, its tokens and parent hash) and `sha256`, the hash of the payload (every tensor's
bytes, by name). `read_header` parses the header alone (the restart scan, no payload read) and
checks the file is as long as the header says; `read_block_file` reads everything and verifies the
checksum and the identity. Anything wrong raises BlockFileError; a caller never gets wrong tensors.
Files are written under a temporary name and renamed, so a crash leaves no half-written block.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from kvgen.errors import KvgenError

FORMAT_VERSION = "kvgen-block-1"
SUFFIX = ".kvblock"
_MAX_HEADER = 1 << 24  # a header longer than 16 MB is not one of ours


class BlockFileError(KvgenError, ValueError):
    """A block file is damaged, truncated, or belongs to another model/format (`mismatch`)."""

    def __init__(self, message: str, mismatch: bool = False):
        super().__init__(message)
        self.mismatch = mismatch


def payload_sha256(parts: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(parts):
        digest.update(name.encode())
        digest.update(_raw(parts[name]))
    return digest.hexdigest()


def encode_block(parts: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The file's bytes: the tensors, the identity `metadata` and the payload checksum."""
    full = {**metadata, "format_version": FORMAT_VERSION, "sha256": payload_sha256(parts)}
    return save_tensors({name: t.contiguous() for name, t in parts.items()}, full)


def write_block_file(path: Path, parts: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Write the block atomically; returns the file's size. OSError (a full disk) leaves nothing."""
    data = encode_block(parts, metadata)
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as f:
            f.write(data)
        os.replace(partial, path)
    except OSError:
        partial.unlink(missing_ok=True)
        raise
    return len(data)


def _parse_header(path: Path, start: bytes, read_more) -> tuple[dict[str, str], int]:
    """(metadata, the file size the header implies) from the first 8 bytes and a reader for the rest."""
    if len(start) < 8:
        raise BlockFileError(f"KV block file {path} is truncated (no header)")
    (length,) = struct.unpack("<Q", start)
    if length > _MAX_HEADER:
        raise BlockFileError(f"KV block file {path} has an impossible header length {length}")
    try:
        header = json.loads(read_more(length))
        metadata = header.pop("__metadata__", None) or {}
        end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    except (ValueError, KeyError, TypeError, IndexError) as error:
        raise BlockFileError(f"KV block file {path} has an unreadable header ({error})") from None
    if metadata.get("format_version") != FORMAT_VERSION:
        raise BlockFileError(f"KV block file {path} is not a {FORMAT_VERSION} file", mismatch=True)
    return metadata, 8 + length + end


def read_header(path: Path) -> dict[str, str]:
    """The metadata alone; BlockFileError if the header is bad or the file shorter/longer than it says."""
    try:
        with open(path, "rb") as f:
            metadata, size = _parse_header(path, f.read(8), f.read)
        actual = path.stat().st_size
    except OSError as error:
        raise BlockFileError(f"KV block file {path} cannot be read ({error})") from None
    if actual != size:
        raise BlockFileError(f"KV block file {path} is {actual} bytes, its header says {size} (truncated or damaged)")
    return metadata


def check_identity(path: Path, metadata: dict[str, str], expected: dict[str, str]) -> None:
    wrong = [k for k, v in expected.items() if metadata.get(k) != v]
    if wrong:
        found = {k: metadata.get(k) for k in wrong}
        raise BlockFileError(f"KV block file {path} is for {found}, not {({k: expected[k] for k in wrong})}", mismatch=True)


def read_block_file(path: Path, expected: dict[str, str]) -> tuple[dict[str, torch.Tensor], int]:
    """(tensors, file size) after checking the size, the identity `expected` and the checksum."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise BlockFileError(f"KV block file {path} cannot be read ({error})") from None
    metadata, size = _parse_header(path, data[:8], lambda n: data[8 : 8 + n])
    if len(data) != size:
        raise BlockFileError(f"KV block file {path} is {len(data)} bytes, its header says {size} (truncated or damaged)")
    check_identity(path, metadata, expected)
    try:
        parts = load_tensors(data)
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error types
        raise BlockFileError(f"KV block file {path} does not parse as safetensors ({error})") from None
    if payload_sha256(parts) != metadata.get("sha256"):
        raise BlockFileError(f"KV block file {path} fails its sha256 check (corrupted)")
    return parts, len(data)


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()
