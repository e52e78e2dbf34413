"""PackedStore: one codec's stored tensors for every layer, in blocks of positions (BLOCK_TOKENS).

Each part the codec produces (codes, scales, offsets, outliers) lives in one preallocated tensor
[layers, H, max_blocks, ...], written block-wise in place and read as zero-copy views; it doubles
when a sequence outgrows it, so the history is copied O(log n) times in total, never per step.
"""

from __future__ import annotations

import torch

from kvgen.kv import huge_pages
from kvgen.kv.codecs import BLOCK_TOKENS, Codec, Parts


class PackedStore:
    def __init__(self, codec: Codec, num_layers: int, num_heads: int, head_dim: int, max_blocks: int,
                 block_tokens: int = BLOCK_TOKENS):  # fmt: skip
        self.codec, self.block_tokens, self.head_dim = codec, block_tokens, head_dim
        template = codec.encode(torch.zeros(num_heads, 1, block_tokens, head_dim), 0)  # shapes and dtypes
        self.parts: Parts = {
            name: huge_pages.zeros((num_layers, num_heads, max_blocks, *t.shape[2:]), dtype=t.dtype)
            for name, t in template.items()
        }

    @property
    def max_blocks(self) -> int:
        return next(iter(self.parts.values())).shape[2]

    def reserve(self, num_blocks: int, used_blocks: int) -> None:
        """Room for `num_blocks` blocks; the first `used_blocks` are kept."""
        if num_blocks <= self.max_blocks:
            return
        new_max = max(num_blocks, 2 * self.max_blocks)
        for name, old in self.parts.items():
            grown = huge_pages.zeros((*old.shape[:2], new_max, *old.shape[3:]), dtype=old.dtype)
            grown[:, :, :used_blocks] = old[:, :, :used_blocks]
            self.parts[name] = grown

    def write(self, layer: int, first_block: int, x: torch.Tensor) -> None:
        """Encode x [H, N, B, D] and store it as blocks first_block..first_block+N-1 of `layer`."""
        encoded = self.codec.encode(x, layer)
        for name, tensor in encoded.items():
            self.parts[name][layer, :, first_block : first_block + x.shape[1]] = tensor

    def read(self, layer: int, num_blocks: int) -> torch.Tensor:
        """Blocks 0..num_blocks-1 of `layer`, decoded: fp32 [H, num_blocks, B, D]."""
        views = {name: tensor[layer, :, :num_blocks] for name, tensor in self.parts.items()}
        return self.codec.decode(views, layer)

    def write_blocks(self, layer: int, block_ids: torch.Tensor, x: torch.Tensor) -> None:
        """Encode x [H, N, B, D] and store block i as block block_ids[i] of `layer` (a paged pool's ids)."""
        for name, tensor in self.codec.encode(x, layer).items():
            self.parts[name][layer, :, block_ids] = tensor

    def write_block_every_layer(self, block_id: int, x: torch.Tensor) -> None:
        """Encode x [L, H, B, D] as block `block_id` of every layer (one encode when the codec is
        the same for every layer)."""
        if not self.codec.same_for_every_layer:
            for layer in range(x.shape[0]):
                self.write_blocks(layer, torch.tensor([block_id]), x[layer][:, None])
            return
        layers, heads = x.shape[:2]
        for name, tensor in self.codec.encode(x.reshape(layers * heads, 1, *x.shape[2:]), 0).items():
            self.parts[name][:, :, block_id] = tensor.reshape(layers, heads, *tensor.shape[2:])

    def read_blocks(self, layer: int, block_ids: torch.Tensor) -> torch.Tensor:
        """Blocks block_ids of `layer`, decoded: fp32 [H, N, B, D]."""
        views = {name: tensor[layer, :, block_ids] for name, tensor in self.parts.items()}
        return self.codec.decode(views, layer)

    def read_block(self, layer: int, block: int) -> torch.Tensor:
        views = {name: tensor[layer, :, block : block + 1] for name, tensor in self.parts.items()}
        return self.codec.decode(views, layer)[:, 0]  # [H, B, D]

    def blocks(self, first_block: int, num_blocks: int) -> Parts:
        """A copy of blocks first_block..num_blocks-1 of every layer, as stored."""
        return {name: tensor[:, :, first_block:num_blocks].clone() for name, tensor in self.parts.items()}

    def move_positions(self, source: Parts, sources: torch.Tensor, first: int) -> None:
        """Stored position first + i (counted over the blocks, every layer) takes the codes of
        position sources[i] of `source` (from `blocks`): the values move as stored, not re-rounded.
        Only for codecs that encode each position on its own (seen as rows: Codec.to_rows)."""
        assert self.codec.per_position, f"codec {self.codec.name!r} shares scales across positions"
        if len(sources) == 0:
            return
        size = self.block_tokens
        lo, hi = first // size, (first + len(sources) + size - 1) // size  # the blocks written
        given = self.codec.to_rows(source)
        region = self.codec.to_rows({name: tensor[:, :, lo:hi] for name, tensor in self.parts.items()})
        for name, rows in region.items():
            flat = rows.view(*rows.shape[:2], -1, *rows.shape[4:])  # [L, H, blocks * B, ...]
            flat[:, :, first - lo * size : first - lo * size + len(sources)] = given[name].flatten(2, 3)[:, :, sources]
        for name, tensor in self.codec.from_rows(region).items():
            if tensor.data_ptr() != self.parts[name][:, :, lo:hi].data_ptr():  # rows were a copy: store back
                self.parts[name][:, :, lo:hi] = tensor

    def copy(self) -> "PackedStore":
        twin = PackedStore.__new__(PackedStore)
        twin.codec, twin.block_tokens, twin.head_dim = self.codec, self.block_tokens, self.head_dim
        twin.parts = {name: tensor.clone() for name, tensor in self.parts.items()}
        return twin

    def bits_per_value(self) -> float:
        """Stored bits per cached value (codes, scales, offsets, outliers), from the real tensors."""
        values = next(iter(self.parts.values())).shape[:3].numel() * self.block_tokens * self.head_dim
        return 8 * self.nbytes() / values if values else 0.0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())
