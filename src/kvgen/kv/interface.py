"""The per-sequence KV cache contract every cache implements.

The model's attention talks to the cache through `update` only; the generation loop uses the rest.

A forward pass over S new tokens calls `update(layer, k, v)` once per layer, each time writing the S
new positions that start at `seq_len`, and then `commit(S)` once. Until `commit`, `seq_len` does not
move, so a forward pass that fails half-way leaves the cache exactly as it was.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from typing import Callable

import torch

from kvgen.config import ModelConfig

# (layer, keys [B, H, S, D], delta) -> the keys as RoPE would have rotated them delta positions later.
Rerotate = Callable[[int, torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class CacheSpec:
    """Shape of what one cache stores: the same for every layer of the models kvgen runs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    # Keys are stored after RoPE in the caches of this contract's first implementations; a cache that
    # stores them before RoPE (for exact context shift / better quantization) says so here.
    keys_before_rope: bool = False
    # A position's value is its key (DeepSeek's latent attention, models/mla.py: one vector per token
    # serves both, only its latent part read as the value). The float stores (contiguous, paged, the
    # engine's pool) then keep one copy, hand the keys back as the values and ignore values passed
    # to them, as llama.cpp's and vLLM's MLA caches do; every other kind stores what it is given.
    values_are_keys: bool = False

    @classmethod
    def for_model(cls, config: ModelConfig, dtype: torch.dtype = torch.float32) -> "CacheSpec":
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, dtype, values_are_keys=config.kv_lora_rank > 0)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one position in a float store: keys and values, or the keys alone where values are keys."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return (1 if self.values_are_keys else 2) * self.num_layers * self.num_kv_heads * self.head_dim * element


@dataclass(frozen=True)
class AttentionSpan:
    """Which earlier positions a query may attend to, besides itself and causality.

    window: only the last `window` positions (the query's own included); None = all.
    sinks: the first `sinks` positions stay visible whatever the window (StreamingLLM's sinks).
    chunk: only positions in the query's own chunk of `chunk` positions (Llama 4's chunked layers).
    """

    window: int | None = None
    sinks: int = 0
    chunk: int | None = None

    def first_needed(self, position: int) -> int:
        """First position a query at `position` sees, sinks aside."""
        first = 0
        if self.window is not None:
            first = max(first, position - self.window + 1)
        if self.chunk is not None:
            first = max(first, position // self.chunk * self.chunk)
        return first

    def decode_start(self, position: int, key_start: int) -> int:
        """Index, among keys that start at position `key_start`, of the first key one query at
        `position` sees; everything from there on is visible (what a one-range kernel needs)."""
        first = max(key_start, self.first_needed(position))
        assert self.sinks <= key_start or first <= self.sinks, (
            f"query at {position} sees sinks 0..{self.sinks - 1} and then {first}..: not one range of keys"
        )
        return (key_start if self.sinks > key_start else first) - key_start

    def narrowed(self, window: int | None) -> "AttentionSpan":
        """This span with a further window (the model's own), the narrower of the two."""
        if window is None or (self.window is not None and self.window <= window):
            return self
        return AttentionSpan(window, self.sinks, self.chunk)


@dataclass
class KVLayout:
    """Addresses of a cache's fp32 storage: element (layer, head, pos, d) of K is at
    keys + layer*layer_stride + block*block_stride + head*head_stride + offset*pos_stride + d, where
    block = block_table[pos // block_size] and offset = pos % block_size when there is a block table,
    and block = 0, offset = pos for one contiguous buffer."""

    keys: torch.Tensor
    values: torch.Tensor
    layer_stride: int
    head_stride: int
    pos_stride: int
    block_stride: int = 0
    block_size: int = 0
    block_table: torch.Tensor | None = None  # int64 [num_blocks of this sequence]

    def position_offsets(self, positions: torch.Tensor) -> torch.Tensor:
        """Element offsets (from keys / values) of each position's (layer 0, head 0) row: the block
        table a kernel reads with one-position blocks, where a row may see any positions in any order."""
        if self.block_table is None:
            return positions * self.pos_stride
        blocks = self.block_table[positions // self.block_size]
        return blocks * self.block_stride + positions % self.block_size * self.pos_stride

    def copy_position(self, source: int, target: int, spec: CacheSpec) -> None:
        """Every layer's and head's key and value at position `source` to position `target` (spec:
        the cache's shape)."""
        source_at, target_at = self.position_offsets(torch.tensor([source, target])).tolist()
        shape, strides = (spec.num_layers, spec.num_kv_heads, spec.head_dim), (self.layer_stride, self.head_stride, 1)
        for store in (self.keys, self.values):
            base = store.storage_offset()
            store.as_strided(shape, strides, base + target_at).copy_(store.as_strided(shape, strides, base + source_at))


@dataclass
class CodesView:
    """What a cache that stores packed codes offers the one-call C decode step for one sequence:
    `storage` is the kernel's descriptor of the cache (kernels/quantized_attention.c quantized_kv),
    valid for this step; `num_packed_blocks` how many of its blocks hold codes."""

    storage: object  # a ctypes structure
    num_packed_blocks: int


class KVCache(ABC):
    """One sequence's (or one fixed batch's) keys and values for every layer."""

    spec: CacheSpec
    # True where the kernels read this cache's storage only through its batch view (the engine's
    # blocks of codes): the model then runs even a single row as a batch of one.
    batch_path_only: bool = False

    @property
    @abstractmethod
    def seq_len(self) -> int:
        """Number of committed positions (all layers hold exactly these)."""

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Positions that fit without reallocating (growable caches may exceed it later)."""

    @abstractmethod
    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `keys`/`values` [B, H_kv, S, D] at positions seq_len..seq_len+S-1 of `layer`.

        Returns everything that layer's queries may attend to, [B, H_kv, L, D], whose first position is
        `visible_start(layer)` (0 unless the cache drops old positions).
        """

    @abstractmethod
    def commit(self, num_tokens: int) -> None:
        """Make the positions written by the last forward pass part of the sequence."""

    @abstractmethod
    def truncate(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` positions (rewind, speculative rollback, shared prefixes)."""

    @abstractmethod
    def fork(self) -> "KVCache":
        """An independent cache with the same contents (copy-on-write where the storage allows)."""

    @abstractmethod
    def memory_bytes(self) -> int:
        """Bytes of storage this cache holds now (allocated, not only used)."""

    def reset(self) -> None:
        self.truncate(0)

    def release(self) -> None:
        """Give back what the cache holds (a finished, cancelled or failed request). For caches over
        a shared pool this returns their blocks; resetting is all the others need."""
        self.reset()

    def remove_range(self, start: int, end: int, rerotate: "Rerotate") -> None:
        """Drop positions start..end-1; later positions move back by end - start. Keys stored after
        RoPE are turned by `rerotate(layer, keys, -(end - start))` so they read as their new positions.
        Optional: caches that cannot move positions raise NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} cannot remove a range of positions")

    def removable_range(self, start: int, end: int) -> tuple[int, int]:
        """The smallest range around start..end-1 that `remove_range` drops exactly: the range itself,
        except where one slot stands for several positions (CompressedCache's pooled chunks)."""
        return start, end

    def kernel_layout(self, num_tokens: int) -> "KVLayout | None":
        """Optional: where positions 0..num_tokens-1 live, for kernels that append at seq_len in
        place and read keys directly (the caller then `commit`s). Room for `num_tokens` is made first.

        Only caches that store plain fp32 K/V return a layout; every other cache returns None and is
        written through `update`.
        """
        return None

    def static_buffers(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Optional: keys and values [L, 1, H, C, D] (C >= num_tokens, room made now) that stay where
        they are until the cache grows or is released and may be written in place at any position:
        what a decode step replayed from a CUDA graph needs (models/cuda_graphs.py), which then
        commits what it wrote. Positions not yet written hold finite values (the graph attends over
        them under a mask). None (the default): no such storage, or no room for num_tokens."""
        return None

    def codes_view(self, num_tokens: int) -> CodesView | None:
        """Optional: for caches that store packed codes the C kernels read, room for `num_tokens`
        positions and the kernels' view of the storage (the caller then `commit`s); None for every
        other cache (written through `update`)."""
        return None

    @classmethod
    def batch_view(cls, caches: list["KVCache"], lengths: list[int]) -> object | None:
        """Optional: one object that reads and writes a ragged batch of these caches at once (it
        duck-types `update`, and may attend in place: models/layers.py Attention), when every cache
        can be served by it; None (the default) means each row goes through its own `update`.
        Asked of the first row's class; `lengths[i]` new tokens are about to be written to row i."""
        return None

    def visible_start(self, layer: int) -> int:
        return 0

    def key_bias(self) -> torch.Tensor | None:
        """Optional: an additive attention bias [n] for the first n slots `update` returns (the same
        for every layer, all older than the next forward's queries). A cache whose slot stands for
        several positions (a pooled chunk) gives it log(count); None (the default) means no bias."""
        return None

    def attention_span(self, layer: int, model_window: int | None) -> AttentionSpan:
        """What a query of `layer` may see: the model's own window, unless the cache narrows it
        (a sliding window imposed on every layer, attention sinks, chunked attention)."""
        return AttentionSpan(model_window)

    @property
    def positions_removed(self) -> int:
        """Positions dropped from the middle of the sequence (remove_range, sink eviction). While it is
        not 0, position i no longer holds token i, so the cache is no prefix of any token sequence."""
        return 0

    def can_resume(self, num_tokens: int) -> bool:
        """Whether the sequence can go on from its first `num_tokens` positions (dropping the rest)
        exactly as if the later ones had never been added (ollama's CanResume). False where a window
        has dropped positions a query at `num_tokens` needs."""
        return 0 <= num_tokens <= self.seq_len

    def copy_prefix(self, source: "KVCache", num_tokens: int) -> None:
        """Replace this cache's contents with `source`'s first `num_tokens` positions (ollama's
        CopyPrefix; shared storage is shared, not copied, where the cache allows)."""
        raise NotImplementedError(f"{type(self).__name__} cannot copy a prefix from another cache")

    def _check_copy_source(self, source: "KVCache", num_tokens: int) -> None:
        """The checks every copy_prefix makes before it changes anything."""
        if source is self:
            raise ValueError("copy_prefix needs two different caches: use truncate to shorten one cache")
        if type(source) is not type(self) or source.spec != self.spec:
            raise ValueError(
                f"cannot copy a prefix from a {type(source).__name__} ({source.spec}) into a "
                f"{type(self).__name__} ({self.spec}): both caches must be of the same kind and shape"
            )
        if not 0 <= num_tokens <= source.seq_len:
            raise ValueError(f"cannot copy {num_tokens} positions: the source holds {source.seq_len}")
        if not source.can_resume(num_tokens):
            raise ValueError(
                f"the source cannot resume from position {num_tokens} (positions it needs were dropped): "
                "recompute the prefix instead"
            )

    def check_invariants(self) -> None:
        assert 0 <= self.seq_len <= self.capacity, f"seq_len {self.seq_len} outside [0, {self.capacity}]"
