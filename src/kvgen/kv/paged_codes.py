"""Paged blocks stored as K/V codes: the engine's pool in fp16, bf16, fp8, int8, int4 (KIVI) or kvquant3.

Each pool block holds `block_size` positions of every layer as the codecs' codes and scales: two
PackedStores (kv/packed.py) whose block index is the pool's block id. A block is encoded once, when
it is full: KIVI's and kvquant3's keys share each channel's scale over the block's positions, so a
block cannot be encoded a position at a time. Until then the block is *staged*: its positions live
in fp32 in one of a few staging slots, exactly as a QuantizedCache's fp32 tail with no residual
window, so a sequence's unfilled last block and every position a forward writes are attended at
full precision, and the engine's output equals the single-sequence QuantizedCache's
(`residual=0, block_tokens=block_size`). Between steps at most one block per running sequence is
staged (two during a step whose tokens cross a block boundary), so `num_slots` is about
`max_num_seqs`, and its bytes are part of the pool's budget.

Life of a block:
    new -> staged (fp32 slot) -> full: encoded at commit, slot freed
    new, filled whole by one forward -> encoded straight from the forward's fp32 keys/values
    codes -> truncated into, then written again -> decoded into a slot (staged) -> re-encoded when full
Writes beyond `seq_len` land only in blocks the sequence reserved, and a staged block keeps its slot
until commit, so a forward that fails half-way leaves every committed position as it was.

Only full, encoded blocks are ever shared through the prefix index; `format_key` names the storage
so blocks are never shared (or read from disk) across formats.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvgen.kv.block_pool import Block, BlockPool
from kvgen.kv.codecs import Codec
from kvgen.kv.interface import CacheSpec
from kvgen.kv.layer_groups import LayerGroups
from kvgen.kv.packed import PackedStore
from kvgen.kv.paged import CacheFullError
from kvgen.kv.rotation import turn

# (layer, positions [N]) -> RoPE cos, sin [N, D] of that layer, fp32 (for keys stored before RoPE)
KeyRope = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class QuantizedPagedStorage:
    """The block store of the engine's pool when K/V are kept as codes (see the module docstring)."""

    def __init__(self, spec: CacheSpec, pool: BlockPool, key_codec: Codec, value_codec: Codec, num_slots: int,
                 key_rope: KeyRope | None = None, max_positions: int | None = None):  # fmt: skip
        if num_slots < 1:
            raise ValueError(f"a quantized paged pool needs at least one staging slot, got {num_slots}")
        if key_codec.keys_before_rope and key_rope is None:
            raise ValueError(f"key codec {key_codec.name!r} stores keys before RoPE: pass key_rope")
        self.spec, self.pool = spec, pool
        self.groups = LayerGroups.single(spec.num_layers)  # codes blocks hold every layer (no window groups)
        self.key_codec, self.value_codec, self.key_rope = key_codec, value_codec, key_rope
        layers, heads, dim, size = spec.num_layers, spec.num_kv_heads, spec.head_dim, pool.block_size
        self.key_store = PackedStore(key_codec, layers, heads, dim, pool.num_blocks, size)
        self.value_store = PackedStore(value_codec, layers, heads, dim, pool.num_blocks, size)
        stage_shape = (layers, num_slots, heads, size, dim)  # as PagedStorage's [L, N, H, bs, D]
        self.stage_keys, self.stage_values = torch.zeros(stage_shape), torch.zeros(stage_shape)
        self.slot_of = [-1] * pool.num_blocks  # staging slot of each block, -1 = its codes hold it
        self._free_slots = list(range(num_slots - 1, -1, -1))
        # The longest sequence the pool can hold (the RoPE tables of pre-RoPE keys cover it).
        self.max_positions = min(max_positions or pool.num_blocks * size, pool.num_blocks * size)
        self.descriptors = None  # kv/paged_codes_batch.py StorageDescriptors, built on first use

    @classmethod
    def bytes_per_block_for(cls, spec: CacheSpec, key_codec: Codec, value_codec: Codec, block_size: int) -> int:
        """Bytes one block of these codecs takes, measured on the codecs' real tensors."""
        stores = [PackedStore(c, spec.num_layers, spec.num_kv_heads, spec.head_dim, 1, block_size) for c in (key_codec, value_codec)]
        return sum(s.nbytes() for s in stores)

    @staticmethod
    def slot_bytes(spec: CacheSpec, block_size: int) -> int:
        return 2 * spec.num_layers * spec.num_kv_heads * block_size * spec.head_dim * 4

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_slots(self) -> int:
        return self.stage_keys.shape[1]

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def format_key(self) -> str:
        return f"{self.key_codec.format_name}/{self.value_codec.format_name}/bs{self.block_size}"

    def bytes_per_block(self) -> int:
        return self.key_store.nbytes() // self.pool.num_blocks + self.value_store.nbytes() // self.pool.num_blocks

    def memory_bytes(self) -> int:
        staged = self.stage_keys.numel() * 4 * 2
        return self.key_store.nbytes() + self.value_store.nbytes() + staged

    # --- staging slots -------------------------------------------------------------------------

    def is_staged(self, block: Block) -> bool:
        return self.slot_of[block.block_id] >= 0

    def take_slot(self, block: Block) -> int:
        """An empty staging slot for `block` (the caller checked that one is free)."""
        assert self.slot_of[block.block_id] < 0, f"block {block.block_id} is staged already"
        slot = self._free_slots.pop()
        self.slot_of[block.block_id] = slot
        return slot

    def stage_from_codes(self, block: Block, first_position: int) -> None:
        """Decode a full block's codes (positions first_position..) into a fresh slot: it is about
        to be written again (a truncation into it, then new tokens)."""
        slot = self.take_slot(block)
        ids = torch.tensor([block.block_id])
        for layer in range(self.spec.num_layers):
            keys = self.key_store.read_blocks(layer, ids)[:, 0]  # [H, B, D]
            if self.key_codec.keys_before_rope:
                keys = self._turn(layer, keys, first_position, inverse=False)
            self.stage_keys[layer, slot] = keys
            self.stage_values[layer, slot] = self.value_store.read_blocks(layer, ids)[:, 0]

    def release_slot(self, block: Block) -> None:
        slot = self.slot_of[block.block_id]
        if slot >= 0:
            self.slot_of[block.block_id] = -1
            self._free_slots.append(slot)

    def released(self, blocks: list[Block]) -> None:
        """Blocks whose last reference went: a staged one gives its slot back (its partial content
        is never reused; only full, encoded blocks are indexed)."""
        for block in blocks:
            if block.ref_count == 0:
                self.release_slot(block)

    def encode_staged(self, block: Block, first_position: int) -> None:
        """A staged block became full: encode its slot into codes (every layer) and free the slot."""
        slot = self.slot_of[block.block_id]
        if self.key_codec.keys_before_rope:  # turned back per layer, each with its own RoPE
            ids = torch.tensor([block.block_id])
            for layer in range(self.spec.num_layers):
                keys, values = self.stage_keys[layer, slot][:, None], self.stage_values[layer, slot][:, None]  # [H, 1, B, D]
                self._encode(layer, ids, keys, values, first_position)
        else:
            self.key_store.write_block_every_layer(block.block_id, self.stage_keys[:, slot])  # [L, H, B, D]
            self.value_store.write_block_every_layer(block.block_id, self.stage_values[:, slot])
        self.release_slot(block)

    def _encode(self, layer: int, ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_position: int) -> None:
        """keys/values [H, N, B, D] of N consecutive blocks from `first_position` -> codes at `ids`."""
        if self.key_codec.keys_before_rope:
            heads, n, size, dim = keys.shape
            flat = self._turn(layer, keys.reshape(heads, n * size, dim), first_position, inverse=True)
            keys = flat.reshape(heads, n, size, dim)
        self.key_store.write_blocks(layer, ids, keys)
        self.value_store.write_blocks(layer, ids, values)

    def _turn(self, layer: int, keys: torch.Tensor, first: int, inverse: bool) -> torch.Tensor:
        """keys [H, N, D] at positions first.. turned by RoPE (inverse: back to before RoPE)."""
        assert self.key_rope is not None
        cos, sin = self.key_rope(layer, torch.arange(first, first + keys.shape[1]))
        return turn(keys, cos, sin, inverse)

    # --- the data path ---------------------------------------------------------------------------

    def write(self, layer: int, blocks: list[Block], start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New keys/values [H, S, D] of one sequence at positions start.. of `layer`: staged blocks
        take them in their slot; blocks the forward fills whole are encoded now (all reserved)."""
        size, end = self.block_size, start + keys.shape[1]
        if end == start:
            return
        whole_ids, whole_first = [], None
        for index in range(start // size, -(-end // size)):
            block = blocks[index]
            lo, hi = max(start, index * size), min(end, (index + 1) * size)
            slot = self.slot_of[block.block_id]
            if slot >= 0:
                self.stage_keys[layer, slot, :, lo - index * size : hi - index * size] = keys[:, lo - start : hi - start]
                self.stage_values[layer, slot, :, lo - index * size : hi - index * size] = values[:, lo - start : hi - start]
                continue
            assert lo == index * size and hi == lo + size, f"block {block.block_id} is neither staged nor written whole"
            whole_ids.append(block.block_id)
            whole_first = lo if whole_first is None else whole_first
        if whole_ids:
            count = len(whole_ids)
            first = whole_first - start
            shape = (keys.shape[0], count, size, keys.shape[2])
            self._encode(layer, torch.tensor(whole_ids), keys[:, first : first + count * size].reshape(shape),
                         values[:, first : first + count * size].reshape(shape), whole_first)  # fmt: skip

    def read_codes(self, layer: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Full blocks decoded to fp32: keys, values [H, n * B, D] (the torch path's history)."""
        heads, dim = self.spec.num_kv_heads, self.spec.head_dim
        if not block_ids:
            empty = torch.zeros(heads, 0, dim)
            return empty, empty
        ids = torch.tensor(block_ids)
        keys = self.key_store.read_blocks(layer, ids).reshape(heads, -1, dim)
        if self.key_codec.keys_before_rope:
            keys = self._turn(layer, keys, 0, inverse=False)
        return keys, self.value_store.read_blocks(layer, ids).reshape(heads, -1, dim)

    def staged_prefix(self, layer: int, block: Block, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `count` positions of a staged block: keys, values [H, count, D] (views)."""
        slot = self.slot_of[block.block_id]
        assert slot >= 0 or count == 0, f"block {block.block_id} holds committed positions but is not staged"
        return self.stage_keys[layer, slot, :, :count], self.stage_values[layer, slot, :, :count]

    # --- copies, disk ----------------------------------------------------------------------------

    def copy_block(self, source: int, target: int) -> None:
        """Copy-on-write of a whole block: codes, and the staging slot when the source is staged."""
        for store in (self.key_store, self.value_store):
            for tensor in store.parts.values():
                tensor[:, :, target] = tensor[:, :, source]
        slot = self.slot_of[source]
        if slot >= 0:
            if not self._free_slots:
                raise CacheFullError("no staging slot left to copy a partly filled block into: raise max_num_seqs or the KV budget")
            copy = self._free_slots.pop()
            self.slot_of[target] = copy
            self.stage_keys[:, copy] = self.stage_keys[:, slot]
            self.stage_values[:, copy] = self.stage_values[:, slot]

    def export_block(self, block_id: int) -> dict[str, torch.Tensor]:
        """A full block's stored tensors, every layer (copies), for the disk tier."""
        assert self.slot_of[block_id] < 0, "only full, encoded blocks are exported"
        parts = {f"k.{n}": t[:, :, block_id].clone() for n, t in self.key_store.parts.items()}
        return parts | {f"v.{n}": t[:, :, block_id].clone() for n, t in self.value_store.parts.items()}

    def import_block(self, block_id: int, parts: dict[str, torch.Tensor]) -> None:
        expected = {f"k.{n}": t for n, t in self.key_store.parts.items()} | {f"v.{n}": t for n, t in self.value_store.parts.items()}
        if set(parts) != set(expected):
            raise ValueError(f"block parts {sorted(parts)} do not match this storage's {sorted(expected)}")
        for name, tensor in expected.items():
            given = parts[name]
            if given.dtype != tensor.dtype or given.shape != tensor[:, :, block_id].shape:
                raise ValueError(f"block part {name!r} is {given.dtype} {tuple(given.shape)}, expected "
                                 f"{tensor.dtype} {tuple(tensor[:, :, block_id].shape)}")  # fmt: skip
        for name, tensor in expected.items():
            tensor[:, :, block_id] = parts[name]
        self.release_slot(self.pool.blocks[block_id])

    def check_invariants(self) -> None:
        owned = [s for s in self.slot_of if s >= 0]
        assert len(owned) == len(set(owned)), "a staging slot is owned by two blocks"
        assert not set(owned) & set(self._free_slots), "a staging slot is both owned and free"
        assert len(owned) + len(self._free_slots) == self.num_slots, "a staging slot is lost"
        for block_id, slot in enumerate(self.slot_of):
            assert slot < 0 or self.pool.blocks[block_id].ref_count > 0, f"free block {block_id} still holds slot {slot}"
