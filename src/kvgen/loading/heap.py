"""Handing back to the system the heap memory a model's load freed.

A load allocates and frees hundreds of MB of temporaries (dequantized rows, the tokenizer's merges
built from its vocabulary). glibc keeps freed memory inside its heaps for reuse, so a process that
loaded Gemma 3 stayed ~100 MB above what it holds; `malloc_trim` returns those pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
from functools import cache
from typing import Callable


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim  # glibc only: musl has none
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Collect garbage, then return the heap's free pages to the system; True where glibc did."""
    # Loading leaves ~185k new Python objects (Gemma 3's tokenizer) pending for the garbage
    # collector's oldest generation: collected now, its next full pass (~90 ms) does not land
    # inside a decode later.
    gc.collect()
    trim = _malloc_trim()
    return trim is not None and trim(0) == 1
