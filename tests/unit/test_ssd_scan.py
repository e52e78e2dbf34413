"""Mamba-2's scan: the C recurrence (kernels/mamba_step.c's kvgen_ssd_scan, one position at a time)
against the chunked SSD form in torch (models/ssd.py) on random inputs, with states captured on the
way. Shapes cover the kernel's four-channel path (head_dim a multiple of 4, N of 8) and its
one-channel path (neither)."""

from __future__ import annotations

import pytest
import torch

from kvgen.kernels import load
from kvgen.models.ssd import ScanShape, scan_chunked, scan_in_c

pytestmark = pytest.mark.skipif(load() is None, reason="the kernel needs a C compiler")


@pytest.mark.parametrize("shape", [ScanShape(heads=4, head_dim=8, groups=2, state_size=16), ScanShape(heads=3, head_dim=5, groups=1, state_size=12)],
                         ids=["four channels at a time", "one channel at a time"])  # fmt: skip
def test_c_scan_equals_the_chunked_form(shape: ScanShape) -> None:
    generator = torch.Generator().manual_seed(0)
    batch, seq = 2, 37
    columns = torch.randn(batch, seq, shape.inner + 2 * shape.groups * shape.state_size, generator=generator)
    dt = torch.rand(batch, seq, shape.heads, generator=generator) * 0.5
    A, D = -torch.rand(shape.heads, generator=generator) * 4, torch.randn(shape.heads, generator=generator)
    state = torch.randn(batch, shape.heads, shape.head_dim, shape.state_size, generator=generator) * 0.1
    capture = [[0, 9, 36], [20]]
    y_c, states_c = scan_in_c(columns, dt, A, D, state, capture, shape)
    y_t, states_t = scan_chunked(columns, dt, A, D, state, capture, shape, chunk=8)
    assert y_c.shape == y_t.shape == (batch, seq, shape.inner)
    assert (y_c - y_t).abs().max().item() < 1e-5 * max(1.0, y_t.abs().max().item())
    assert [len(row) for row in states_c] == [len(row) for row in states_t] == [3, 1]
    for row_c, row_t in zip(states_c, states_t):
        for c, t in zip(row_c, row_t):
            assert c.shape == t.shape == (1, shape.heads, shape.head_dim, shape.state_size)
            assert (c - t).abs().max().item() < 1e-5


def test_c_scan_takes_the_steps_softplus_from_raw_steps_and_their_bias() -> None:
    """dt before softplus with dt_bias: the C scan computes softplus(dt + dt_bias) itself, as the
    decode step does, and follows the chunked form over torch's softplus."""
    shape = ScanShape(heads=4, head_dim=8, groups=2, state_size=16)
    generator = torch.Generator().manual_seed(1)
    columns = torch.randn(1, 23, shape.inner + 2 * shape.groups * shape.state_size, generator=generator)
    raw, bias = torch.randn(1, 23, shape.heads, generator=generator), torch.randn(shape.heads, generator=generator)
    A, D, state = -torch.rand(shape.heads, generator=generator), torch.randn(shape.heads, generator=generator), torch.zeros(1, 4, 8, 16)
    y_c, _ = scan_in_c(columns, raw, A, D, state, [[22]], shape, dt_bias=bias)
    y_t, _ = scan_chunked(columns, torch.nn.functional.softplus(raw + bias), A, D, state, [[22]], shape, chunk=8)
    assert (y_c - y_t).abs().max().item() < 1e-5 * max(1.0, y_t.abs().max().item())


def test_c_scan_leaves_the_callers_states_as_they_were() -> None:
    shape = ScanShape(heads=2, head_dim=4, groups=1, state_size=8)
    state = torch.randn(1, 2, 4, 8)
    before = state.clone()
    scan_in_c(torch.randn(1, 5, shape.inner + 16), torch.rand(1, 5, 2), -torch.rand(2), torch.ones(2), state, [[4]], shape)
    assert torch.equal(state, before)
