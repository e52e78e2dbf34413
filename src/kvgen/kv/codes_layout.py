"""How packed K/V storage describes itself to the C attention kernels (kernels/quantized_attention.c,
kernels/paged_codes_attention.c): one `PackedCodes` per layer and codec, pointing into a
PackedStore's tensors, so the kernels decode one tile of codes at a time and never a whole history.

The kernels read fp32, fp16, bf16, fp8, int8 (keys in Int8KeyCodec's groups), KIVI int4 keys, per-token int4 values and kvquant3
keys and values (its pre-RoPE keys rotated back with RoPE tables); plain int3 keeps the torch path.
"""

from __future__ import annotations

import ctypes
import torch

from kvgen.kv.codecs import CHANNEL_GROUP, CastCodec, Codec, Fp8Codec, Int8Codec, Int8KeyCodec, KiviKeyCodec, PerTokenIntCodec
from kvgen.kv.kvquant import KVQuantKeyCodec, KVQuantValueCodec
from kvgen.kv.packed import PackedStore

_ptr, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
MAX_TILE = 64  # quantized_attention.c: positions per tile (a packed block at most)
MAX_HEAD_DIM = 512  # its per-channel scale buffer


class PackedCodes(ctypes.Structure):  # quantized_attention.c packed_codes
    _fields_ = [("kind", _i32), ("rope_width", _i32), ("codes", _ptr), ("step", _ptr), ("low", _ptr), ("lut", _ptr),
                ("code_head_stride", _i64), ("code_block_stride", _i64),
                ("step_head_stride", _i64), ("step_block_stride", _i64),
                ("codebook", _ptr), ("outlier_index", _ptr), ("outlier_value", _ptr),
                ("outliers", _i64), ("outlier_head_stride", _i64), ("outlier_block_stride", _i64),
                ("rope_cos", _ptr), ("rope_sin", _ptr)]  # fmt: skip


_CAST_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # the value of each byte


def codes_kind(codec: Codec) -> int | None:
    """The kernel's name for how `codec` stores a block, or None when the kernel cannot read it."""
    if isinstance(codec, CastCodec):
        return _CAST_KINDS.get(codec.dtype)
    if isinstance(codec, Fp8Codec):
        return 3
    if isinstance(codec, Int8KeyCodec):  # before its base class: another layout
        return 9
    if isinstance(codec, Int8Codec):
        return 4
    if isinstance(codec, KiviKeyCodec):
        return 5
    if isinstance(codec, PerTokenIntCodec) and codec.bits == 4:
        return 6
    if isinstance(codec, KVQuantKeyCodec):
        return 7
    if isinstance(codec, KVQuantValueCodec):
        return 8
    return None


def rope_tables(key_rope, num_layers: int, num_positions: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, RoPE cos/sin [num_positions, D] fp32 for the kernels to turn pre-RoPE keys
    (layers with equal tables share one copy). key_rope: (layer, positions [N]) -> cos, sin [N, D]."""
    positions, tables, distinct = torch.arange(num_positions), [], []
    for layer in range(num_layers):
        cos, sin = (t.float().contiguous() for t in key_rope(layer, positions))
        same = next((seen for seen in distinct if torch.equal(seen[0], cos) and torch.equal(seen[1], sin)), None)
        if same is None:
            distinct.append(same := (cos, sin))
        tables.append(same)
    return tables


def kernel_reads(key: Codec, value: Codec, head_dim: int, block_tokens: int) -> bool:
    """Whether the C kernels can attend over blocks of these codecs directly."""
    shape_ok = block_tokens <= MAX_TILE and head_dim <= MAX_HEAD_DIM and head_dim % CHANNEL_GROUP == 0
    return shape_ok and codes_kind(key) is not None and codes_kind(value) is not None


def describe(store: PackedStore, layer: int, rope: tuple[torch.Tensor, torch.Tensor] | None) -> PackedCodes:
    """The kernel's view of one layer of `store`; rope: cos/sin [positions, rotary channels] for
    pre-RoPE keys."""
    kind = codes_kind(store.codec)
    assert kind is not None
    parts = store.parts
    codes = parts["x"] if "x" in parts else parts["codes"]
    step = parts.get("scale", parts.get("step", parts.get("span")))
    low, index, value = parts.get("low"), parts.get("outlier_index"), parts.get("outlier_value")
    assert all(t.is_contiguous() for t in parts.values())
    codebook = getattr(store.codec, "codebooks", None)  # kvquant3: [layers, 8] fp32
    assert codebook is None or (codebook.dtype == torch.float32 and codebook.is_contiguous())

    def address(t: torch.Tensor | None) -> int | None:
        return t[layer].data_ptr() if t is not None else None

    return PackedCodes(
        kind, rope[0].shape[1] if rope else 0, address(codes), address(step), address(low), FP8_VALUES.data_ptr(),
        codes.stride(1) * codes.element_size(), codes.stride(2) * codes.element_size(),
        step.stride(1) if step is not None else 0, step.stride(2) if step is not None else 0,
        address(codebook), address(index), address(value), index.shape[-1] if index is not None else 0,
        index.stride(1) if index is not None else 0, index.stride(2) if index is not None else 0,
        rope[0].data_ptr() if rope else None, rope[1].data_ptr() if rope else None,
    )  # fmt: skip


