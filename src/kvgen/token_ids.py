"""Small helpers over token id sequences, shared by sessions, speculative proposers and the engine."""

from __future__ import annotations

from typing import Sequence


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids two sequences share (what a cache of `a` can keep for `b`)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
