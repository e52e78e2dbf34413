"""Returning the heap a load freed to the system (glibc's malloc_trim)."""

from __future__ import annotations

import platform
import sys

import pytest

from kvgen.loading import heap


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_free_pages_inside_the_heap_are_handed_back() -> None:
    # Blocks under glibc's mmap threshold live in the heap; freeing every other one leaves free pages
    # between live blocks, which free() cannot give back and malloc_trim can.
    blocks = [bytearray(100_000) for _ in range(400)]
    del blocks[::2]
    assert heap.release_freed_memory()
    assert len(blocks) == 200
