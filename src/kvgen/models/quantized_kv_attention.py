"""Decode attention over a QuantizedCache's stored codes, in C (kernels/quantized_attention.c).

The torch path reads a quantized cache through `update`, which decodes every layer's whole history
into a scratch buffer on each step. FastDecoder uses this instead when both codecs are ones the
kernel reads (fp32, fp16, bf16, fp8, int8, KIVI int4 keys, per-token int4 values, kvquant3 keys
and values): one C call runs every block, writing the new key and value into the cache's fp32
tail (or sink) slot, and attention decodes one block of codes at a time for one kv head
(kvquant3's pre-RoPE keys rotated back with tables of the cache's RoPE), scores it and moves on.
Plain int3 keeps the torch path.
"""

from __future__ import annotations

import ctypes
from typing import TypeGuard

import torch

from kvgen.kv.codecs import CHANNEL_GROUP, CastCodec, Codec, Fp8Codec, Int8Codec, KiviKeyCodec, PerTokenIntCodec
from kvgen.kv.kvquant import KVQuantKeyCodec, KVQuantValueCodec
from kvgen.kv.packed import PackedStore
from kvgen.kv.quantized import QuantizedCache

_ptr, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
MAX_TILE = 64  # quantized_attention.c: positions per tile (a packed block at most)
MAX_HEAD_DIM = 512  # its per-channel scale buffer


class PackedCodes(ctypes.Structure):  # quantized_attention.c packed_codes
    _fields_ = [("kind", _i32), ("pad", _i32), ("codes", _ptr), ("step", _ptr), ("low", _ptr), ("lut", _ptr),
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


def supports(cache: object) -> TypeGuard[QuantizedCache]:
    if not isinstance(cache, QuantizedCache):
        return False
    if cache.keys_stored_before_rope and (not isinstance(cache.key_codec, KVQuantKeyCodec) or cache.key_rope is None):
        return False
    head_dim = cache.spec.head_dim
    shape_ok = cache.block_tokens <= MAX_TILE and head_dim <= MAX_HEAD_DIM and head_dim % CHANNEL_GROUP == 0
    return shape_ok and codes_kind(cache.key_codec) is not None and codes_kind(cache.value_codec) is not None


def _describe(store: PackedStore, layer: int, rope: tuple[torch.Tensor, torch.Tensor] | None) -> PackedCodes:
    """The kernel's view of one layer of `store`; rope: cos/sin [positions, D] for pre-RoPE keys."""
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
        kind, 0, address(codes), address(step), address(low), FP8_VALUES.data_ptr(),
        codes.stride(1) * codes.element_size(), codes.stride(2) * codes.element_size(),
        step.stride(1) if step is not None else 0, step.stride(2) if step is not None else 0,
        address(codebook), address(index), address(value), index.shape[-1] if index is not None else 0,
        index.stride(1) if index is not None else 0, index.stride(2) if index is not None else 0,
        rope[0].data_ptr() if rope else None, rope[1].data_ptr() if rope else None,
    )  # fmt: skip


class QuantizedKV(ctypes.Structure):  # quantized_attention.c quantized_kv
    _fields_ = [("sink", _ptr), ("sink_kv_stride", _i64), ("sink_layer_stride", _i64), ("sink_head_stride", _i64),
                ("sink_len", _i64), ("tail", _ptr), ("tail_kv_stride", _i64), ("tail_layer_stride", _i64),
                ("tail_head_stride", _i64), ("block_size", _i64), ("key_codes", _ptr), ("value_codes", _ptr)]  # fmt: skip


def _storage_key(cache: QuantizedCache) -> tuple:
    """Changes whenever a tensor the descriptors point into is replaced (grown, rebuilt, forked)."""
    tensors = [*cache.key_store.parts.values(), *cache.value_store.parts.values(), cache.sink_store, cache.tail_store]
    return tuple((t.data_ptr(), t.shape) for t in tensors)


def _rope_tables(cache: QuantizedCache) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per layer, cos/sin [capacity, D] of positions 0.. for keys stored before RoPE (layers with
    the same tables share one copy); None per layer otherwise."""
    if not cache.keys_stored_before_rope:
        return [None] * cache.spec.num_layers
    assert cache.key_rope is not None
    positions, tables = torch.arange(cache.capacity), []
    distinct: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in range(cache.spec.num_layers):
        cos, sin = (t.float().contiguous() for t in cache.key_rope(layer, positions))
        same = next((seen for seen in distinct if torch.equal(seen[0], cos) and torch.equal(seen[1], sin)), None)
        if same is None:
            distinct.append(same := (cos, sin))
        tables.append(same)
    return tables


class QuantizedKVAttention:
    """The kernel's view of one quantized cache (`storage`), rebuilt only when that storage moves;
    RoPE tables for pre-RoPE keys, rebuilt only when the cache's capacity grows."""

    def __init__(self, library: ctypes.CDLL):
        self.library = library
        self.storage = QuantizedKV()
        self._key: tuple | None = None
        self._codes: tuple[ctypes.Array, ctypes.Array] | None = None  # per layer K, V; `storage` points into them
        self._rope_key: tuple | None = None
        self._ropes: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # the key descriptors point into them

    def prepare(self, cache: QuantizedCache, end: int) -> None:
        """Make room for positions up to `end` (so this step's writes move nothing), then point
        `storage` at the cache."""
        cache.reserve(end)
        key = (id(cache), _storage_key(cache))
        if key == self._key:
            return
        rope_key = (cache.key_rope, cache.capacity) if cache.keys_stored_before_rope else None
        if rope_key != self._rope_key or not self._ropes:
            self._ropes, self._rope_key = _rope_tables(cache), rope_key
        layers = range(cache.spec.num_layers)
        keys = (PackedCodes * len(layers))(*(_describe(cache.key_store, layer, self._ropes[layer]) for layer in layers))
        values = (PackedCodes * len(layers))(*(_describe(cache.value_store, layer, None) for layer in layers))
        sink, tail = cache.sink_store, cache.tail_store
        self.storage = QuantizedKV(
            sink.data_ptr(), sink.stride(0), sink.stride(1), sink.stride(2), cache.sink_tokens,
            tail.data_ptr(), tail.stride(0), tail.stride(1), tail.stride(2), cache.block_tokens,
            ctypes.addressof(keys), ctypes.addressof(values),
        )  # fmt: skip
        self._codes, self._key = (keys, values), key

    def attend(self, cache: QuantizedCache, layer: int, q: int, out: int, heads: int, scale: float, start: int,
               end: int) -> None:  # fmt: skip
        """One layer's attention alone, after `prepare`: out [heads, D] = attention of q [heads, D]
        (addresses) over positions start..end-1 (the decode step runs it inside
        kvgen_decode_layers_over_codes)."""
        assert self._codes is not None
        sink, tail, spec = cache.sink_store, cache.tail_store, cache.spec
        self.library.kvgen_quantized_decode_attention(
            q, out, heads, spec.num_kv_heads, spec.head_dim, scale, sink[0, layer].data_ptr(),
            sink[1, layer].data_ptr(), sink.stride(2), cache.sink_tokens, ctypes.byref(self._codes[0][layer]),
            ctypes.byref(self._codes[1][layer]), cache.num_packed_blocks, cache.block_tokens,
            tail[0, layer].data_ptr(), tail[1, layer].data_ptr(), tail.stride(2), start, end,
        )  # fmt: skip
