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
from safetensors.torch import save as save_tensors

from kvgen.errors import KvgenError

FORMAT_VERSION = "kvgen-block-1"
SUFFIX = ".kvblock"
_MAX_HEADER = 1 << 24  # a header longer than 16 MB is not one of ours
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


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


def _parse_header(path: Path, start: bytes, read_more) -> tuple[dict[str, str], int, dict]:
    """(metadata, the file size the header implies, the tensor table) from the first 8 bytes and a
    reader for the rest."""
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
    return metadata, 8 + length + end, header


def read_header(path: Path) -> dict[str, str]:
    """The metadata alone; BlockFileError if the header is bad or the file shorter/longer than it says."""
    try:
        with open(path, "rb") as f:
            metadata, size, _ = _parse_header(path, f.read(8), f.read)
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
    """(tensors, file size) after checking the size, the identity `expected` and the checksum. The
    file is read once into one buffer; the tensors are views of it (hashed in place, no copies)."""
    try:
        with open(path, "rb") as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            got = f.readinto(data)
    except OSError as error:
        raise BlockFileError(f"KV block file {path} cannot be read ({error})") from None
    metadata, size, table = _parse_header(path, bytes(data[:8]), lambda n: bytes(data[8 : 8 + n]))
    if got != size or len(data) != size:
        raise BlockFileError(f"KV block file {path} is {len(data)} bytes, its header says {size} (truncated or damaged)")
    check_identity(path, metadata, expected)
    base = size - max((entry["data_offsets"][1] for entry in table.values()), default=0)  # payload start
    view, digest, parts = memoryview(data), hashlib.sha256(), {}
    try:
        for name in sorted(table):
            (begin, end), dtype = table[name]["data_offsets"], _DTYPES[table[name]["dtype"]]
            digest.update(name.encode())
            digest.update(view[base + begin : base + end])
            count = (end - begin) // dtype.itemsize
            flat = torch.frombuffer(data, dtype=dtype, count=count, offset=base + begin) if count else torch.empty(0, dtype=dtype)
            parts[name] = flat.reshape(table[name]["shape"])
    except (KeyError, ValueError, TypeError, RuntimeError) as error:
        raise BlockFileError(f"KV block file {path} has a bad tensor table ({error})") from None
    if digest.hexdigest() != metadata.get("sha256"):
        raise BlockFileError(f"KV block file {path} fails its sha256 check (corrupted)")
    return parts, size


def _raw(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().view(torch.uint8).numpy())  # the tensor's bytes, not copied
