"""Large CPU buffers (K/V stores, repacked weights) on transparent huge pages.

Decode attention streams every stored position once per step: at 8,192 tokens SmolLM2's int8
codes are ~97 MB, ~24,000 4 KB pages, each a TLB miss and a page walk per step, and a fresh start
for the hardware prefetchers, which stop at 4 KB boundaries. Asking the kernel for 2 MB pages
(madvise MADV_HUGEPAGE, before the buffer is first touched) made one layer's int8 attention ~10%
faster with two threads and ~3% with one (SmolLM2's shape, 8,192 positions). Advice only: where
the system gives no huge pages (THP off, not Linux) the buffer is an ordinary one.

The advice only shapes pages not yet touched, and torch's allocator hands out recycled heap
memory (a model's load frees hundreds of MB it touched): `empty` therefore takes a fresh private
anonymous mapping for a buffer of a huge page or more, never touched before the advice.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
import threading
from functools import cache

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux <sys/mman.h>


@cache
def _madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    function = libc.madvise
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def advise(tensor: torch.Tensor) -> bool:
    """Ask for huge pages under the 2 MB-aligned part of a CPU tensor's memory; True if asked.
    Pages already touched keep their size (the kernel may merge them later)."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return False
    return madvise(first, last - first, MADV_HUGEPAGE) == 0


def _fresh(nbytes: int) -> torch.Tensor:
    """nbytes of a new mapping (uint8), starting on a 2 MB boundary, advised before any touch."""
    # MAP_PRIVATE: a shared anonymous mapping is shmem, whose huge pages THP's madvise mode leaves off.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds a reference: the mapping lives as long
    offset = -whole.data_ptr() % HUGE_PAGE
    tensor = whole[offset : offset + nbytes]
    advise(tensor)
    return tensor


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty on the CPU, its memory advised onto huge pages before anything touches it (a
    buffer of a huge page or more: a fresh mapping, starting on a 2 MB boundary)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes < HUGE_PAGE or _madvise() is None:
        return torch.empty(shape, dtype=dtype)
    return _fresh(nbytes).view(dtype).view(shape)


# Buffers under a huge page are carved one after another from shared arenas of ARENA bytes (only
# the 2 MB pages touched take memory). An arena lives while any buffer carved from it does.
ARENA = 64 << 20
_arena_lock = threading.Lock()
_arena: list = [None, 0]  # the current arena, and its bytes handed out


def packed(nbytes: int) -> torch.Tensor:
    """nbytes (uint8, 64-byte aligned) on huge pages, for long-lived buffers read as one stream
    (a model's weights): large ones get their own mapping, small ones follow each other in an arena."""
    if _madvise() is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    if nbytes >= HUGE_PAGE:
        return _fresh(nbytes)
    with _arena_lock:
        arena, used = _arena
        if arena is None or used + nbytes > ARENA:
            arena, used = _fresh(ARENA), 0
        _arena[:] = [arena, -(-(used + nbytes) // 64) * 64]
        return arena[used : used + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch.zeros on the CPU, on huge pages where the system gives them."""
    return empty(shape, dtype).zero_()
