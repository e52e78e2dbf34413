"""Storage for the tiered cache's lower tiers: the warm packing and the checksummed cold files.

A block is K and V for `block_size` positions of every layer, [L, H, bs, D] each. Warm blocks are
packed by a codec of kv/codecs.py into real smaller tensors (fp16/bf16 casts; int8 with an fp16
scale per position: the int8 KV codec's own encoding). Cold blocks are one file each:

    b"KVGTIER1" | u32 header length | JSON header | per layer: the packed tensors' raw bytes

The header lists, per layer, the payload's offset, length and sha256, so one layer is read and
verified on its own (attention reads layer by layer); a missing, truncated or altered file raises
ColdBlockError naming the file, never hands back wrong keys.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch

from kvgen.errors import KvgenError
from kvgen.kv.codecs import CODECS

MAGIC = b"KVGTIER1"
WARM_DTYPES = ("fp32", "fp16", "bf16", "int8")
_CASTS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

Packed = dict[str, torch.Tensor]  # name -> [L, ...] tensors; layer i is each tensor's [i]


class ColdBlockError(KvgenError, RuntimeError):
    """A cold block's file is missing or does not match its checksum."""


def pack(keys: torch.Tensor, values: torch.Tensor, dtype: str) -> Packed:
    """K, V [L, H, bs, D] fp32 -> the warm representation."""
    if dtype in _CASTS:
        return {"k": keys.to(_CASTS[dtype]).contiguous(), "v": values.to(_CASTS[dtype]).contiguous()}
    if dtype == "int8":
        packed: Packed = {}
        for name, x in (("k", keys), ("v", values)):
            parts = CODECS["int8"].encode(x, 0)  # per position: int8 codes and an fp16 scale
            packed[name], packed[name + "_scale"] = parts["codes"].contiguous(), parts["scale"].contiguous()
        return packed
    raise ValueError(f"unknown warm tier dtype {dtype!r}; choose one of {', '.join(WARM_DTYPES)}")


def unpack_layer(layer: Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's packed tensors ([H, bs, D] and scales) -> K, V [H, bs, D] fp32."""
    if "k_scale" in layer:
        return layer["k"].float() * layer["k_scale"], layer["v"].float() * layer["v_scale"]
    return layer["k"].float(), layer["v"].float()


def packed_bytes(packed: Packed) -> int:
    return sum(t.numel() * t.element_size() for t in packed.values())


def write_block(path: Path, packed: Packed) -> None:
    """Write a packed block (all layers) with a per-layer sha256; the file appears complete or not at all."""
    num_layers = next(iter(packed.values())).shape[0]
    payloads = [b"".join(_raw(t[layer]) for t in packed.values()) for layer in range(num_layers)]
    layout, offset = [], 0
    for payload in payloads:
        layout.append({"offset": offset, "length": len(payload), "sha256": hashlib.sha256(payload).hexdigest()})
        offset += len(payload)
    tensors = {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape[1:])} for name, t in packed.items()}
    header = json.dumps({"tensors": tensors, "layers": layout}).encode()
    partial = path.with_suffix(".partial")
    with open(partial, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(header)) + header)
        for payload in payloads:
            f.write(payload)
    partial.replace(path)


def read_layer(path: Path, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read and verify one layer of a cold block -> K, V [H, bs, D] fp32. Raises ColdBlockError."""
    advice = "the KV cache cannot be rebuilt from it; drop the request's cache (release) and recompute the prompt"
    try:
        with open(path, "rb") as f:
            start = f.read(len(MAGIC) + 4)
            if len(start) < len(MAGIC) + 4 or start[: len(MAGIC)] != MAGIC:
                raise ColdBlockError(f"cold KV block {path} is not a kvgen tier file (bad header): {advice}")
            (header_length,) = struct.unpack("<I", start[len(MAGIC) :])
            header = json.loads(f.read(header_length))
            entry = header["layers"][layer]
            f.seek(len(MAGIC) + 4 + header_length + entry["offset"])
            payload = f.read(entry["length"])
    except FileNotFoundError:
        raise ColdBlockError(f"cold KV block {path} was deleted while the cache still needs it: {advice}") from None
    except (OSError, ValueError, KeyError, IndexError) as error:
        raise ColdBlockError(f"cold KV block {path} could not be read ({error}): {advice}") from error
    if len(payload) != entry["length"] or hashlib.sha256(payload).hexdigest() != entry["sha256"]:
        raise ColdBlockError(f"cold KV block {path} layer {layer} fails its sha256 check (corrupted or truncated): {advice}")
    tensors, offset = {}, 0
    for name, meta in header["tensors"].items():
        dtype = getattr(torch, meta["dtype"])
        size = torch.Size(meta["shape"]).numel() * torch.empty((), dtype=dtype).element_size()
        raw = torch.frombuffer(bytearray(payload[offset : offset + size]), dtype=torch.uint8)
        tensors[name] = raw.view(dtype).reshape(meta["shape"])
        offset += size
    return unpack_layer(tensors)


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()
