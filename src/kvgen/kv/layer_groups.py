"""LayerGroups: how a block pool's pages are shared out among a model's layers (vLLM's hybrid allocator).

A model with both full-attention and sliding-window layers (Gemma 3: five local layers per global
one) needs every position of its global layers but only the last `window` positions of its local
ones. If one pool block held a position range for every layer, no block could ever be freed before
the sequence ends. So the layers are split into groups of one attention kind, each at most `width`
layers, and a pool block (a *page*) holds `width` layers' keys/values for one group: a sequence has
one block table per group, and a sliding group's pages that fell out of its window go back to the
pool while the full-attention group keeps its pages.

Group 0 is always full attention (the *anchor*: its table is `PagedCache.blocks`, what the prefix
index and everything else that knows one table see); groups 1.. are windowed. A model whose layers
are all of one kind has a single group of every layer: one page per block, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgen.config import ModelConfig


@dataclass(frozen=True)
class LayerGroups:
    group_of: tuple[int, ...]  # per layer: its group
    slot_of: tuple[int, ...]  # per layer: its place among the page's `width` layer slots
    windows: tuple[int | None, ...]  # per group: its sliding window (None: full attention)
    width: int  # layer slots per page

    @classmethod
    def single(cls, num_layers: int) -> "LayerGroups":
        """One group of every layer (a full-attention model, or grouping turned off)."""
        return cls(tuple([0] * num_layers), tuple(range(num_layers)), (None,), num_layers)

    @classmethod
    def for_model(cls, config: ModelConfig) -> "LayerGroups":
        """Groups of the model's full-attention layers and of each window size, `width` = the
        number of full-attention layers (so the anchor group is one page wide and no slot is spare
        there); single when the model has no window or no full-attention layer."""
        windows = [config.window_for(layer) for layer in range(config.num_layers)]
        full = [layer for layer, w in enumerate(windows) if w is None]
        if not full or len(full) == len(windows):
            return cls.single(config.num_layers)
        width = len(full)
        group_of, slot_of = [0] * len(windows), [0] * len(windows)
        group_windows: list[int | None] = [None]
        for slot, layer in enumerate(full):
            slot_of[layer] = slot
        for window in sorted({w for w in windows if w is not None}):
            members = [layer for layer, w in enumerate(windows) if w == window]
            for start in range(0, len(members), width):
                group_windows.append(window)
                for slot, layer in enumerate(members[start : start + width]):
                    group_of[layer], slot_of[layer] = len(group_windows) - 1, slot
        return cls(tuple(group_of), tuple(slot_of), tuple(group_windows), width)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def is_single(self) -> bool:
        return self.num_groups == 1

    def first_block_needed(self, group: int, position: int, block_size: int) -> int:
        """The first block of `group` that a query at `position` (or later) still reads."""
        window = self.windows[group]
        return 0 if window is None else max(0, position - window + 1) // block_size

    def most_blocks(self, num_tokens: int, chunk: int, block_size: int) -> int:
        """The most pool blocks one sequence of `num_tokens` positions holds at once when forwards
        take at most `chunk` tokens: every page of the full-attention group, and of each window
        group the pages that its window and one forward span (a forward over [start, end) holds a
        window group's pages from before start - window + 1 to end), never more than all of them."""
        every = -(-num_tokens // block_size)
        return sum(every if w is None else min(every, (chunk + w - 1) // block_size + 2) for w in self.windows)

    def describe(self) -> str:
        """"g1" for one group; "g6w3" for six groups of three layer slots (a format_key part)."""
        return f"g{self.num_groups}" if self.is_single else f"g{self.num_groups}w{self.width}"
