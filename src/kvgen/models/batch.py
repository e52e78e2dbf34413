"""Ragged batching glue: one forward pass over rows that each append to their own cache.

Row i brings `lengths[i]` new tokens at positions `caches[i].seq_len..`. The model sees one padded
batch [B, S_max]; `BatchCacheView.update` writes each row's real tokens (never the padding) into that
row's cache and returns every row's visible keys/values padded to the longest, [B, H_kv, L_max, D].
`build_batch_mask` gives each row its own causal (and windowed) mask over its own key length, so the
padding is invisible: padded keys are masked out and padded queries are never written anywhere.
"""

from __future__ import annotations

import torch

from kvgen.kv.interface import AttentionSpan, KVCache


class BatchCacheView:
    """Duck-types the one method Attention uses (`update`) over a list of per-row caches."""

    def __init__(self, caches: list[KVCache], lengths: list[int]):
        self.caches, self.lengths = caches, lengths

    def in_place_starts(self, lengths: list[int], spans: tuple[AttentionSpan, ...]) -> None:
        """Rows of arbitrary caches never attend in place: every layer goes through `update`."""
        return None

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys/values [B, H_kv, S_max, D] -> each row's visible keys/values, [B, H_kv, L_max, D]."""
        rows = [
            cache.update(layer, keys[i : i + 1, :, :n], values[i : i + 1, :, :n])
            for i, (cache, n) in enumerate(zip(self.caches, self.lengths))
        ]  # each ([1, H_kv, L_i, D], [1, H_kv, L_i, D])
        return _pad_cat([k for k, _ in rows]), _pad_cat([v for _, v in rows])


def _pad_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """[1, H, L_i, D] each -> [B, H, max L_i, D], zeros after each row's end (masked out anyway)."""
    longest = max(p.shape[2] for p in parts)
    if all(p.shape[2] == longest for p in parts):
        return torch.cat(parts)
    out = parts[0].new_zeros((len(parts), parts[0].shape[1], longest, parts[0].shape[3]))
    for i, part in enumerate(parts):
        out[i, :, : part.shape[2]] = part[0]
    return out


def build_batch_mask(
    starts: list[int], lengths: list[int], key_starts: list[int], spans: list[AttentionSpan]
) -> torch.Tensor:
    """Per-row mask [B, 1, S_max, L_max], True = may attend.

    Row i: query j (< lengths[i]) sits at position starts[i] + j; key k at key_starts[i] + k, and the
    row holds starts[i] + lengths[i] - key_starts[i] keys; spans[i] narrows what it sees (window,
    sinks, chunk) as AttentionMask.build does for one row. Padded queries may see key 0 only, so SDPA
    never meets an all-False row (whose softmax would be NaN); their outputs are discarded.
    """
    num_queries = max(lengths)
    num_keys = [s + n - ks for s, n, ks in zip(starts, lengths, key_starts)]
    longest = max(num_keys)
    q = torch.arange(num_queries)[None, :, None]  # [1, S, 1]
    k = torch.arange(longest)[None, None, :]  # [1, 1, L]
    query_pos = torch.tensor(starts)[:, None, None] + q  # [B, S, 1]
    key_pos = torch.tensor(key_starts)[:, None, None] + k  # [B, 1, L]
    allowed = (key_pos <= query_pos) & (k < torch.tensor(num_keys)[:, None, None])
    unlimited = query_pos.max().item() + 1  # a window or chunk this long narrows nothing
    window = _per_row([s.window for s in spans], unlimited)
    sinks = _per_row([s.sinks for s in spans], 0)
    chunk = _per_row([s.chunk for s in spans], unlimited)
    allowed &= (query_pos - key_pos < window) | (key_pos < sinks)
    allowed &= key_pos // chunk == query_pos // chunk
    padded_query = q >= torch.tensor(lengths)[:, None, None]  # [B, S, 1]
    allowed = torch.where(padded_query, k == 0, allowed)
    return allowed[:, None]  # [B, 1, S, L]


def _per_row(values: list[int | None], default: int) -> torch.Tensor:
    """One value per row as a [B, 1, 1] tensor, `default` where a row has none."""
    return torch.tensor([default if v is None else v for v in values])[:, None, None]
