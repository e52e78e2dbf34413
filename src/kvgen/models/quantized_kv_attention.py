"""Decode attention over a QuantizedCache's stored codes, in C (kernels/quantized_attention.c).

The torch path reads a quantized cache through `update`, which decodes every layer's whole history
into a scratch buffer on each step. FastDecoder uses this instead when both codecs are ones the
kernel reads (fp32, fp16, bf16, fp8, int8, KIVI int4 keys, per-token int4 values, kvquant3 keys
and values): the new key and value go in with `write`, and attention decodes one block of codes at
a time for one kv head (kvquant3's pre-RoPE keys rotated back with tables of the cache's RoPE),
scores it and moves on. Plain int3 keeps the torch path.
"""

from __future__ import annotations

import ctypes

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


def supports(cache: object) -> bool:
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


def _storage_key(cache: QuantizedCache) -> tuple:
    """Changes whenever a tensor the descriptors point into is replaced (grown, rebuilt, forked),
    or the positions the RoPE tables must cover grow."""
    tensors = [*cache.key_store.parts.values(), *cache.value_store.parts.values(), cache.sink_store, cache.tail_store]
    return (cache.capacity, *((t.data_ptr(), t.shape) for t in tensors))


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
    """Per-layer descriptors of one quantized cache's storage, rebuilt when that storage moves."""

    def __init__(self, library: ctypes.CDLL):
        self.library = library
        self._key: tuple | None = None
        self._keys: list[PackedCodes] = []
        self._values: list[PackedCodes] = []
        self._ropes: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self._rows: list[tuple[int, int, int, int]] = []  # per layer: sink K, sink V, tail K, tail V addresses
        self._strides = (0, 0)  # head strides of the sink and the tail

    def prepare(self, cache: QuantizedCache, end: int) -> None:
        """Make room for positions up to `end` (so this step's writes move nothing), then point
        the descriptors at the cache's storage."""
        cache.reserve(end)
        key = (id(cache), _storage_key(cache))
        if key != self._key:
            layers = range(cache.spec.num_layers)
            sink, tail = cache.sink_store, cache.tail_store
            self._ropes = _rope_tables(cache)  # kept alive: the key descriptors point into them
            self._keys = [_describe(cache.key_store, layer, self._ropes[layer]) for layer in layers]
            self._values = [_describe(cache.value_store, layer, None) for layer in layers]
            self._rows = [(sink[0, layer].data_ptr(), sink[1, layer].data_ptr(), tail[0, layer].data_ptr(),
                           tail[1, layer].data_ptr()) for layer in layers]  # fmt: skip
            self._strides = (sink.stride(2), tail.stride(2))
            self._key = key

    def attend(self, cache: QuantizedCache, layer: int, q: int, out: int, heads: int, scale: float, start: int,
               end: int) -> None:  # fmt: skip
        """out [heads, D] = attention of q [heads, D] (addresses) over positions start..end-1."""
        sink_k, sink_v, tail_k, tail_v = self._rows[layer]
        sink_stride, tail_stride = self._strides
        spec = cache.spec
        self.library.kvgen_quantized_decode_attention(
            q, out, heads, spec.num_kv_heads, spec.head_dim, scale, sink_k, sink_v, sink_stride, cache.sink_tokens,
            ctypes.byref(self._keys[layer]), ctypes.byref(self._values[layer]), cache.num_packed_blocks,
            cache.block_tokens, tail_k, tail_v, tail_stride, start, end,
        )  # fmt: skip
