"""QuantizedCache: K and V packed through separate codecs, with full-precision sink and recent tokens.

Storage per layer (all positions of a sequence, in order):
  sink    the first `sink_tokens` positions, fp32 (KVQuant keeps the attention sink exact)
  packed  blocks of BLOCK_TOKENS positions, stored only as the codecs' codes and scales (PackedStore)
  tail    the most recent positions, fp32: at least `residual` of them (KIVI's full-precision window)
          plus the part of a block not yet full

Writes go to the tail; `commit` packs every whole block that has left the residual window, so a
forward pass that fails half-way changes nothing (only committed positions are ever packed).

Attention reads ONE scratch buffer per cache, [H, capacity, D] for K and V, shared by all layers
(they run one after another): `update` decodes the layer's blocks into it block-wise, so no fp32 copy
of the history is held per layer. The returned views are valid until the next `update`.
Keys of a codec with `keys_before_rope` are un-rotated before packing and rotated back on reading.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from kvgen.kv.codecs import BLOCK_TOKENS, Codec, Parts, key_codec, value_codec
from kvgen.kv.interface import CacheSpec, CodesView, KVCache, Rerotate
from kvgen.kv import quantized_decode_view
from kvgen.kv.packed import PackedStore
from kvgen.kv.rotation import turn

# (layer, positions [N]) -> RoPE cos, sin [N, D] of that layer, fp32
KeyRope = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class QuantizedCache(KVCache):
    def __init__(self, spec: CacheSpec, capacity: int, max_capacity: int, k_dtype: str | Codec, v_dtype: str | Codec,
                 residual: int = 32, key_rope: KeyRope | None = None, block_tokens: int = BLOCK_TOKENS):  # fmt: skip
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if residual < 0:
            raise ValueError(f"residual must be >= 0, got {residual}")
        self.key_codec = key_codec(k_dtype) if isinstance(k_dtype, str) else k_dtype
        self.value_codec = value_codec(v_dtype) if isinstance(v_dtype, str) else v_dtype
        if self.key_codec.keys_before_rope and key_rope is None:
            raise ValueError(f"key codec {self.key_codec.name!r} stores keys before RoPE: pass key_rope (the model's rotary tables)")
        self.spec, self.residual, self.key_rope, self.block_tokens = spec, residual, key_rope, block_tokens
        self.max_capacity = max(max_capacity, capacity)
        self.keys_stored_before_rope = self.key_codec.keys_before_rope
        self.sink_tokens = max(self.key_codec.sink_tokens, self.value_codec.sink_tokens)
        layers, heads, dim = spec.num_layers, spec.num_kv_heads, spec.head_dim
        blocks = max(1, math.ceil((capacity - self.sink_tokens) / block_tokens))
        self.key_store = PackedStore(self.key_codec, layers, heads, dim, blocks, block_tokens)
        self.value_store = PackedStore(self.value_codec, layers, heads, dim, blocks, block_tokens)
        self._sink = torch.zeros(2, layers, heads, self.sink_tokens, dim)  # [K/V, L, H, sink, D]
        self._tail = torch.zeros(2, layers, heads, self._tail_size(0), dim)  # [K/V, L, H, T, D]
        self._scratch = torch.zeros(2, heads, capacity, dim)  # [K/V, H, C, D], one layer at a time
        self._seq_len = 0
        self._num_blocks = 0  # packed blocks (the same for every layer)
        self._removed = 0  # positions dropped by remove_range since the cache was last empty
        self._decode_view = None  # QuantizedDecodeView, built on the first codes_view()

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def capacity(self) -> int:
        return self._scratch.shape[2]

    @property
    def packed_end(self) -> int:
        """First position not packed (the tail starts here)."""
        return self.sink_tokens + self._num_blocks * self.block_tokens

    @property
    def stored_bytes_per_token(self) -> float:
        """Bytes the codecs store per packed position, all layers, K and V (sink and tail excluded)."""
        values = self.spec.num_layers * self.spec.num_kv_heads * self.spec.head_dim
        return values * (self.key_store.bits_per_value() + self.value_store.bits_per_value()) / 8

    def _tail_size(self, needed: int) -> int:
        return max(needed, self.residual + self.block_tokens)

    def _reserve(self, end: int) -> None:
        if end > self.max_capacity:
            raise ValueError(f"cache needs {end} positions but is limited to {self.max_capacity}")
        if end > self.capacity:
            grown = torch.zeros((*self._scratch.shape[:2], min(max(end, 2 * self.capacity), self.max_capacity), self.spec.head_dim))
            self._scratch = grown  # scratch content is rebuilt by every update
        needed = end - self.packed_end
        if needed > self._tail.shape[3]:
            self._resize_tail(needed)

    def _resize_tail(self, size: int) -> None:
        kept = max(0, self._seq_len - self.packed_end)
        tail = torch.zeros((*self._tail.shape[:3], self._tail_size(size), self.spec.head_dim))
        tail[:, :, :, :kept] = self._tail[:, :, :, :kept]
        self._tail = tail

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.write(layer, keys, values)
        return self._assemble(layer, self._seq_len + keys.shape[2])

    def reserve(self, end: int) -> None:
        """Room for positions up to `end`, so that the writes of a step move no storage."""
        self._reserve(end)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store new keys/values [1, H, S, D] at seq_len.. of `layer` without reading the history
        back (for kernels that attend over the stored codes: kernels/quantized_attention.c)."""
        if keys.shape[0] != 1:
            raise ValueError(f"QuantizedCache holds one sequence; got a batch of {keys.shape[0]}")
        start, end = self._seq_len, self._seq_len + keys.shape[2]
        self._reserve(end)
        new = torch.stack((keys[0], values[0]))  # [K/V, H, S, D]
        sink_end = min(end, self.sink_tokens)
        if start < sink_end:
            self._sink[:, layer, :, start:sink_end] = new[:, :, : sink_end - start]
        first = max(start, self.sink_tokens)  # first new position that goes to the tail
        if first < end:
            offset = first - self.packed_end
            self._tail[:, layer, :, offset : offset + end - first] = new[:, :, first - start :]

    def codes_view(self, num_tokens: int) -> CodesView | None:
        if not quantized_decode_view.supports(self) or quantized_decode_view.library() is None:
            return None
        if self._decode_view is None:
            self._decode_view = quantized_decode_view.QuantizedDecodeView()
        self._decode_view.prepare(self, num_tokens)
        return CodesView(self._decode_view.storage, self._num_blocks)

    @property
    def sink_store(self) -> torch.Tensor:
        """[K/V, L, H, sink_tokens, D] fp32: the positions kept whole at the start."""
        return self._sink

    @property
    def tail_store(self) -> torch.Tensor:
        """[K/V, L, H, T, D] fp32: positions packed_end.. (the recent window, the unfilled block)."""
        return self._tail

    @property
    def num_packed_blocks(self) -> int:
        return self._num_blocks

    def _assemble(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0..end-1 of `layer` into the scratch buffer: sink, decoded blocks, tail."""
        scratch, heads, dim = self._scratch, self.spec.num_kv_heads, self.spec.head_dim
        num_sink, packed_end = min(end, self.sink_tokens), self.packed_end
        scratch[:, :, :num_sink] = self._sink[:, layer, :, :num_sink]
        if self._num_blocks:
            packed = slice(self.sink_tokens, packed_end)
            keys = self.key_store.read(layer, self._num_blocks).reshape(heads, -1, dim)  # [H, n, D]
            if self.keys_stored_before_rope:
                keys = self._rotate(layer, keys, self.sink_tokens, inverse=False)
            scratch[0, :, packed] = keys
            scratch[1, :, packed] = self.value_store.read(layer, self._num_blocks).reshape(heads, -1, dim)
        if end > packed_end:
            scratch[:, :, packed_end:end] = self._tail[:, layer, :, : end - packed_end]
        return scratch[0, None, :, :end], scratch[1, None, :, :end]  # [1, H, L, D] views

    def _rotate(self, layer: int, keys: torch.Tensor, first: int, inverse: bool) -> torch.Tensor:
        """keys [H, n, D] at positions first.. rotated by RoPE (inverse: un-rotated; exact, angles negate)."""
        assert self.key_rope is not None
        cos, sin = self.key_rope(layer, torch.arange(first, first + keys.shape[1]))  # [n, D]
        return turn(keys, cos, sin, inverse)

    def commit(self, num_tokens: int) -> None:
        if self._seq_len + num_tokens > self.capacity:
            raise AssertionError(f"commit of {num_tokens} past capacity {self.capacity} at {self._seq_len}")
        self._seq_len += num_tokens
        self._pack_ready()

    def _pack_ready(self) -> None:
        """Pack every whole block of the tail that has left the residual window."""
        packed_end = self.packed_end
        ready = (self._seq_len - packed_end - self.residual) // self.block_tokens
        if self._seq_len < self.sink_tokens or ready <= 0:
            return
        count, heads, dim = ready * self.block_tokens, self.spec.num_kv_heads, self.spec.head_dim
        for store in (self.key_store, self.value_store):
            store.reserve(self._num_blocks + ready, self._num_blocks)
        for layer in range(self.spec.num_layers):
            keys, values = self._tail[:, layer, :, :count]  # [H, n, D] each
            if self.keys_stored_before_rope:
                keys = self._rotate(layer, keys, packed_end, inverse=True)
            self.key_store.write(layer, self._num_blocks, keys.reshape(heads, ready, self.block_tokens, dim))
            self.value_store.write(layer, self._num_blocks, values.reshape(heads, ready, self.block_tokens, dim))
        rest = self._seq_len - packed_end - count
        self._tail[:, :, :, :rest] = self._tail[:, :, :, count : count + rest].clone()
        self._num_blocks += ready
        if self._tail.shape[3] > 2 * self._tail_size(0):  # a long prefill grew it: give that back
            self._resize_tail(rest)

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._seq_len:
            raise ValueError(f"cannot truncate to {num_tokens}: the cache holds {self._seq_len} positions")
        if num_tokens < self.packed_end and self._num_blocks:
            # Blocks wholly before num_tokens stay; the kept start of a cut block returns to the tail
            # as stored (already rounded; it is rounded again when packed anew).
            kept_blocks, partial = divmod(max(0, num_tokens - self.sink_tokens), self.block_tokens)
            if partial:
                for layer in range(self.spec.num_layers):
                    keys = self.key_store.read_block(layer, kept_blocks)[:, :partial]  # [H, p, D]
                    if self.keys_stored_before_rope:
                        keys = self._rotate(layer, keys, self.sink_tokens + kept_blocks * self.block_tokens, inverse=False)
                    self._tail[0, layer, :, :partial] = keys
                    self._tail[1, layer, :, :partial] = self.value_store.read_block(layer, kept_blocks)[:, :partial]
            self._num_blocks = kept_blocks
        self._seq_len = num_tokens
        self._removed = self._removed if num_tokens else 0

    @property
    def positions_removed(self) -> int:
        return self._removed

    def remove_range(self, start: int, end: int, rerotate: Rerotate) -> None:
        """Drop positions start..end-1; later ones move back by end - start (see KVCache).

        Packed blocks wholly before `start` stay as they are. From the block holding `start` on, the
        cache is rebuilt: each layer is read as attention reads it, the range dropped, the moved keys
        turned by `rerotate`, and the result written back as a long prefill would be (sink, tail,
        then every block that has left the residual window is packed). Stored codes are then put
        back wherever they still hold their position's value, so what was packed is not rounded
        twice:
          - values, and keys a per-position codec stores before RoPE: every position that was
            packed and lands in a packed block keeps its codes (a pre-RoPE key needs no turning:
            RoPE is applied at its new index when read). Exact.
          - keys stored after RoPE move turned, so they are re-encoded: one more rounding of the
            codec (int8 ~amax/254 per position, fp8 / fp16 / bf16 one more cast; int4 KIVI keys
            also regroup per channel over their new block). kvquant3's pre-RoPE keys are not
            turned but regroup per channel too, so they are re-encoded as well. Positions before
            `start` in that block keep their codes for per-position codecs; a per-channel group
            straddling `start` is re-rounded.
          - fewer than BLOCK_TOKENS positions that were packed may land in the fp32 tail: they hold
            their decoded values and are rounded again when packed anew (idempotent for the fp,
            int8 and integer min/max codecs; kvquant3's values move by up to one level).
        Peak memory: fp32 K and V of every layer from the rebuilt block on, as a prefill of that
        length holds. Positions stay index-based, so sink, tail and blocks keep their meaning.
        """
        if not 0 <= start <= end <= self._seq_len:
            raise ValueError(f"cannot remove positions {start}..{end}: the cache holds {self._seq_len}")
        removed, old_blocks = end - start, self._num_blocks
        if removed == 0:
            return
        kept_blocks = max(0, start - self.sink_tokens) // self.block_tokens  # wholly before `start`
        stores = [(self.value_store, True), (self.key_store, self.keys_stored_before_rope)]
        saved = [(store, moves, store.blocks(kept_blocks, old_blocks)) for store, moves in stores
                 if store.codec.per_position and old_blocks > kept_blocks]  # fmt: skip
        self._rebuild(kept_blocks, start, end, rerotate)
        self._pack_ready()
        for store, moves, parts in saved:
            self._restore_codes(store, parts, kept_blocks, old_blocks, start, removed if moves else None)
        self._removed += removed

    def _rebuild(self, kept_blocks: int, start: int, end: int, rerotate: Rerotate) -> None:
        """Keep the first `kept_blocks` packed blocks; every later position but start..end-1 becomes
        fp32 sink or tail content again, moved keys turned back by end - start."""
        removed, new_len = end - start, self._seq_len - (end - start)
        tail_from = self.sink_tokens + kept_blocks * self.block_tokens  # the new tail's first position
        first = min(start, tail_from)  # first position rewritten (inside the sink when start is)
        tail = torch.zeros((*self._tail.shape[:3], self._tail_size(new_len - tail_from), self.spec.head_dim))
        for layer in range(self.spec.num_layers):
            keys, values = self._assemble(layer, self._seq_len)  # [1, H, L, D] at the old positions
            moved = rerotate(layer, keys[:, :, end:], -removed)[0]  # [H, n, D]
            kept = torch.stack((torch.cat((keys[0, :, first:start], moved), 1),
                                torch.cat((values[0, :, first:start], values[0, :, end:]), 1)))  # fmt: skip
            in_sink = max(0, min(self.sink_tokens, new_len) - first)  # [K/V, H, new_len - first, D]
            self._sink[:, layer, :, first : first + in_sink] = kept[:, :, :in_sink]
            tail[:, layer, :, : kept.shape[2] - in_sink] = kept[:, :, in_sink:]
        self._tail, self._num_blocks, self._seq_len = tail, kept_blocks, new_len

    def _restore_codes(self, store: PackedStore, saved: Parts, kept_blocks: int, old_blocks: int,
                       start: int, moved_by: int | None) -> None:  # fmt: skip
        """Give each newly packed position the codes it had before the move, where it had some that
        still hold its value: always for positions before `start`, for moved ones only when
        `moved_by` is given (their stored value needs no turning)."""
        first, old_end = kept_blocks * self.block_tokens, old_blocks * self.block_tokens  # counted over the blocks
        new = torch.arange(first, self._num_blocks * self.block_tokens)
        before = new + self.sink_tokens < start
        old = torch.where(before, new, new + (moved_by or 0))
        usable = (old < old_end) & (before | (moved_by is not None))  # a prefix of `new`: old grows with new
        store.move_positions(saved, old[usable] - first, first)

    def copy_prefix(self, source: KVCache, num_tokens: int) -> None:
        self._check_copy_source(source, num_tokens)
        assert isinstance(source, QuantizedCache)
        mine = (self.key_codec, self.value_codec, self.residual, self.block_tokens)
        if (source.key_codec, source.value_codec, source.residual, source.block_tokens) != mine:
            raise ValueError("copy_prefix between quantized caches needs the same codecs, residual window and block size")
        copy, max_capacity = source.fork(), self.max_capacity
        copy.truncate(num_tokens)
        copy._removed = source._removed if num_tokens == source.seq_len else 0  # as ContiguousCache
        self.__dict__.update(copy.__dict__)
        self.max_capacity = max(max_capacity, self.capacity)

    def fork(self) -> "QuantizedCache":
        twin = QuantizedCache.__new__(QuantizedCache)
        twin.__dict__.update(self.__dict__)
        twin.key_store, twin.value_store = self.key_store.copy(), self.value_store.copy()
        twin._sink, twin._tail = self._sink.clone(), self._tail.clone()
        twin._scratch = torch.zeros_like(self._scratch)
        twin._decode_view = None
        return twin

    def memory_bytes(self) -> int:
        held = (self._sink, self._tail, self._scratch)
        return self.key_store.nbytes() + self.value_store.nbytes() + sum(t.numel() * t.element_size() for t in held)

    def check_invariants(self) -> None:
        super().check_invariants()
        if self._num_blocks:
            assert self.packed_end <= self._seq_len, f"packed up to {self.packed_end} past seq_len {self._seq_len}"
            assert self._seq_len - self.packed_end < self.residual + self.block_tokens, "a ready block was left unpacked"
        assert self._num_blocks <= self.key_store.max_blocks, "more blocks than the store holds"
