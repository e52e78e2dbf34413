"""Mamba-2's scan in its chunked "state space duality" form, and its gated RMSNorm.

Per head h (a scalar decay A[h] < 0) and position t, with x_t [P] and B_t, C_t [N] of h's group:
    state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_tᵀ        ([P, N])
    y_t     = state_t C_t
Over a segment of T positions this is, with a_t = dt_t A and L[t, s] = exp(a_{s+1} + ... + a_t)
for s <= t (0 above the diagonal):
    y = ((C Bᵀ) ∘ L) (dt x)  +  exp(a_1 + ... + a_t) state_0 C_t
    state_T = exp(a_1 + ... + a_T) state_0 + Σ_s L[T, s] dt_s x_s B_sᵀ
so a segment costs a few [T, T] matmuls per head instead of T sequential steps, and memory stays
bounded by the segment length. Segments end at least every `chunk` positions and wherever a state
is wanted (checkpoints, a row's last token), so captured states are exact, not interpolated.

On a CPU the C scan (kernels/mamba_step.c's kvgen_ssd_scan) takes the recurrence one position at a
time instead, as the decode step does: there the chunked form costs as many multiply-adds per
position (T/2 P for the segment, 2 P N for the state) and several times more memory traffic. The
chunked form is the path without a C compiler and on other devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvgen.kernels import load


@dataclass(frozen=True)
class ScanShape:
    """A Mamba-2 mixer's heads of head_dim channels, reading B and C [state_size] from one of
    `groups` groups (head h reads group h // (heads // groups))."""

    heads: int
    head_dim: int
    groups: int
    state_size: int

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    def split(self, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [B, S, inner + 2 groups N] -> u [B, S, heads, head_dim], B and C [B, S, groups, N]."""
        grouped = self.groups * self.state_size
        u, B, C = columns.split([self.inner, grouped, grouped], dim=-1)
        return u.unflatten(-1, (self.heads, self.head_dim)), B.unflatten(-1, (self.groups, -1)), C.unflatten(-1, (self.groups, -1))


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a [..., T] -> [..., T, T]: out[t, s] = a[s+1] + ... + a[t] for s <= t, -inf above the
    diagonal (exp gives L). Summed directly, not as a difference of cumulative sums, which loses
    precision once those grow large."""
    length = a.shape[-1]
    strictly_below = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1)
    terms = a[..., :, None].expand(*a.shape, length).masked_fill(~strictly_below, 0)  # [.., t (term), s]: a[t] where t > s
    sums = terms.cumsum(dim=-2)
    return sums.masked_fill(~strictly_below.logical_or(torch.eye(length, dtype=torch.bool, device=a.device)), float("-inf"))


def segment_ends(length: int, chunk: int, wanted: set[int]) -> list[int]:
    """Ends (exclusive) of the segments covering [0, length): every `chunk`, and at each wanted end."""
    return sorted({*range(chunk, length, chunk), *(e for e in wanted if 0 < e < length), length})


def ssd_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor, ends: list[int],
    keep: set[int],
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:  # fmt: skip
    """x [b, S, H, P], dt [b, S, H] (after softplus), A [H], B and C [b, S, G, N], state [b, H, P, N]
    before position 0, segment ends ascending (the last S) -> (y [b, S, H, P] without D's skip,
    {end: the state after position end - 1} for the ends in `keep`)."""
    batch, _, heads, head_dim = x.shape
    groups = B.shape[2]
    per_group = heads // groups  # head h reads group h // per_group
    state = state.view(batch, groups, per_group, head_dim, -1)
    outputs, states, start = [], {}, 0
    for end in ends:
        a = (dt[:, start:end] * A).view(batch, end - start, groups, per_group)  # [b, T, G, K]
        xdt = (x[:, start:end] * dt[:, start:end, :, None]).view(batch, end - start, groups, per_group, head_dim)
        b, c = B[:, start:end], C[:, start:end]  # [b, T, G, N]
        decay = torch.exp(segment_sums(a.permute(0, 2, 3, 1)))  # [b, G, K, T, T]
        scores = torch.einsum("btgn,bsgn->bgts", c, b)[:, :, None] * decay  # [b, G, K, T, T]
        y = torch.einsum("bgkts,bsgkp->btgkp", scores, xdt)
        from_state = torch.einsum("btgn,bgkpn->btgkp", c, state)
        y = y + from_state * torch.exp(a.cumsum(dim=1))[..., None]
        state = state * torch.exp(a.sum(dim=1))[..., None, None] + torch.einsum("bgks,bsgkp,bsgn->bgkpn", decay[..., -1, :], xdt, b)
        if end in keep:
            states[end] = state.reshape(batch, heads, head_dim, -1)
        outputs.append(y.reshape(batch, end - start, heads, head_dim))
        start = end
    return torch.cat(outputs, dim=1), states


def scan_in_c(columns: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, D: torch.Tensor, state: torch.Tensor,
              capture: list[list[int]], shape: ScanShape, dt_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:  # fmt: skip
    """The scan of each row by kernels/mamba_step.c's kvgen_ssd_scan, one position at a time as the
    decode step takes it: columns [B, S, inner + 2 groups N] (u, B, C side by side, contiguous), dt
    [B, S, heads] after softplus, or before it with `dt_bias` [heads] (softplus(dt + dt_bias) in C,
    as the decode step takes it: torch's softplus rounds an element by where it falls in the call's
    vectors), A and D [heads], states [B, heads, head_dim, N] before position 0 -> y + D u
    [B, S, inner] and, per row, the states [1, heads, head_dim, N] after each position in
    capture[row] (0-based, ascending)."""
    library = load()
    batch, seq, width = columns.shape
    grouped = shape.groups * shape.state_size
    y, states = torch.empty(batch, seq, shape.inner), []
    A, D, dt = A.float().contiguous(), D.float().contiguous(), dt.float().contiguous()
    bias = dt_bias.float().contiguous() if dt_bias is not None else None
    for row in range(batch):
        base, floats = columns[row].data_ptr(), columns.element_size()
        running = state[row].clone().contiguous()
        points = torch.tensor(capture[row], dtype=torch.int64)
        caught = torch.empty(len(capture[row]), shape.heads, shape.head_dim, shape.state_size)
        library.kvgen_ssd_scan(base, dt[row].data_ptr(), bias.data_ptr() if bias is not None else None, A.data_ptr(),
                               base + floats * shape.inner,
                               base + floats * (shape.inner + grouped), D.data_ptr(), width, running.data_ptr(),
                               y[row].data_ptr(), seq, shape.heads, shape.head_dim, shape.groups, shape.state_size,
                               points.data_ptr(), len(capture[row]), caught.data_ptr())  # fmt: skip
        states.append(list(caught.unsqueeze(1)))
    return y, states


def scan_chunked(columns: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, D: torch.Tensor, state: torch.Tensor,
                 capture: list[list[int]], shape: ScanShape, chunk: int) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:  # fmt: skip
    """`scan_in_c` in torch, the chunked form: segments of at most `chunk` positions, ending at
    every capture point."""
    batch, seq, _ = columns.shape
    u, B, C = shape.split(columns)
    wanted = {p + 1 for points in capture for p in points}  # segment ends whose states rows keep
    y, ends = ssd_scan(u, dt, A, B, C, state, segment_ends(seq, chunk, wanted), wanted)
    states = [[ends[p + 1][row : row + 1].clone() for p in points] for row, points in enumerate(capture)]
    return (y + u * D[:, None]).reshape(batch, seq, -1), states


def gated_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """transformers' MambaRMSNormGated: y · silu(gate), RMS-normalised over each of `groups` equal
    slices of the channels, times weight (the gate before the norm: mamba_ssm's norm_before_gate=False)."""
    gated = (y * F.silu(gate)).unflatten(-1, (groups, -1))
    normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + eps)
    return normed.flatten(-2) * weight
