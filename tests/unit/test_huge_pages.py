"""Large CPU K/V buffers and repacked weights ask for transparent huge pages (kv/huge_pages.py): the
int8 codes of a QuantizedCache, a ContiguousCache's fp32 buffers and every quantized linear's blocks
carry the advice; small buffers of their own ask nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvgen.kv import huge_pages
from kvgen.kv.contiguous import ContiguousCache
from kvgen.kv.interface import CacheSpec
from kvgen.kv.quantized import QuantizedCache
from kvgen.models.quantized_linear import QuantizedLinear

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="no transparent huge pages on this system",
)


def advised_huge(tensor: torch.Tensor, first_byte: bool = False) -> bool:
    """Whether the mapping that holds the tensor's first 2 MB-aligned byte (first_byte: its first
    byte) carries the huge-page advice (`hg` in /proc/self/smaps VmFlags; advice splits a mapping at
    the aligned bounds). The advice, not the pages: whether the kernel finds free 2 MB pages
    depends on the machine's memory at that moment."""
    address = tensor.data_ptr() if first_byte else -(-tensor.data_ptr() // huge_pages.HUGE_PAGE) * huge_pages.HUGE_PAGE
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    return False


def test_large_buffers_sit_on_huge_pages() -> None:
    spec = CacheSpec(num_layers=4, num_kv_heads=3, head_dim=64)
    quantized = QuantizedCache(spec, 8192, 8192, "int8", "int8")
    contiguous = ContiguousCache(spec, 8192)
    contiguous.update(0, torch.randn(1, 3, 8192, 64), torch.randn(1, 3, 8192, 64))  # first touch
    codes = quantized.key_store.parts["codes"]
    assert codes.dtype == torch.int8 and codes.numel() >= 4 * 3 * 8192 * 64
    assert advised_huge(codes) and advised_huge(contiguous._keys)
    small = huge_pages.zeros((1000,))  # under one huge page: nothing to ask for
    assert not huge_pages.advise(small) and torch.count_nonzero(small) == 0


def test_quantized_weights_sit_on_huge_pages(smollm2_q4) -> None:
    """The repacked blocks come from advised mappings, small linears' one after another."""
    blocks = [m.blocks for m in smollm2_q4.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(blocks) == 4 * smollm2_q4.config.num_layers + 1
    assert all(advised_huge(b, first_byte=True) for b in blocks)
    first, second = huge_pages.packed(1000), huge_pages.packed(3000)
    first.fill_(1)
    second.fill_(2)
    assert second.data_ptr() % 64 == 0 and second.data_ptr() >= first.data_ptr() + 1000
    assert int(first.sum()) == 1000 and int(second.sum()) == 6000 and advised_huge(second, first_byte=True)
