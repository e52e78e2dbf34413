"""Mamba (selective state-space LM): no attention and no KV cache; each layer carries a fixed-size
state (the last `conv_kernel` inputs of its causal convolution and the recurrent state [I, N]),
held in an `SSMStateCache` (kv/ssm.py).

Prefill runs the recurrence over the prompt in C (kernels/mamba_step.c's kvgen_selective_scan:
channels in parallel, the state in registers), or without a C compiler in torch, in chunks of
`SCAN_CHUNK` positions whose discretised A and B·u are materialised one chunk at a time. Decode is
one C call per token where the projections are quantized (models/mamba_decode.py), else the same
recurrence for one position. States at multiples of the
cache's `checkpoint_every` are captured during the scan and become checkpoints at commit, so a
later request sharing a prefix resumes from the latest one instead of recomputing everything.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.config import MambaConfig
from kvgen.kernels import load
from kvgen.kv.ssm import SSMSpec
from kvgen.models.recurrent import RecurrentLM, causal_conv, conv_state_after
from kvgen.models.weights import WeightSource, frozen, linear

SCAN_CHUNK = 64


class MambaMixer(nn.Module):
    def __init__(self, config: MambaConfig, weights: WeightSource, prefix: str):
        super().__init__()
        self.intermediate, self.state_size, self.rank = config.intermediate_size, config.state_size, config.time_step_rank

        def optional(name: str) -> torch.Tensor | None:
            return weights.take_tensor(name) if weights.has(name) else None

        self.in_proj = linear(weights.take(f"{prefix}.in_proj.weight"), optional(f"{prefix}.in_proj.bias"))
        self.conv_weight = frozen(weights.take_tensor(f"{prefix}.conv1d.weight").reshape(self.intermediate, 1, -1))  # [I, 1, K]
        self.conv_bias = optional(f"{prefix}.conv1d.bias")
        self.x_proj = linear(weights.take(f"{prefix}.x_proj.weight"))
        self.dt_proj = linear(weights.take(f"{prefix}.dt_proj.weight"), weights.take_tensor(f"{prefix}.dt_proj.bias"))
        # HF folders hold A_log; GGUF files A = -exp(A_log) itself (llama.cpp's converter takes the exp)
        a = optional(f"{prefix}.A")
        self.A = frozen(a.float() if a is not None else -torch.exp(weights.take_tensor(f"{prefix}.A_log").float()))  # [I, N]
        self.D = frozen(weights.take_tensor(f"{prefix}.D").float().reshape(-1))  # [I]
        self.out_proj = linear(weights.take(f"{prefix}.out_proj.weight"), optional(f"{prefix}.out_proj.bias"))
        self.dt_b_c_rms_eps = config.dt_b_c_rms_eps

    def forward(
        self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, capture: list[list[int]]
    ) -> tuple[torch.Tensor, list[list[tuple[torch.Tensor, torch.Tensor]]]]:
        """x [B, S, H], states of the B rows before it -> output [B, S, H] and, per row, the
        (conv, recurrent) states after each position listed in capture[row] (0-based, ascending)."""
        batch, seq, _ = x.shape
        u, gate = self.in_proj(x).transpose(1, 2).chunk(2, dim=1)  # [B, I, S] each
        u, extended = causal_conv(conv_state, u, self.conv_weight, self.conv_bias)  # [B, I, S], [B, I, K-1+S]
        time_step, B, C = self.x_proj(u.transpose(1, 2).contiguous()).split([self.rank, self.state_size, self.state_size], dim=-1)
        if self.dt_b_c_rms_eps is not None:  # Falcon-Mamba's weightless norms
            time_step, B, C = (_rms(t, self.dt_b_c_rms_eps) for t in (time_step, B, C))
        dt = F.softplus(self.dt_proj(time_step.contiguous())).float()  # [B, S, I]
        library = load() if x.device.type == "cpu" else None
        scan = self._scan_in_c if library is not None else self._scan
        y, states = scan(u.transpose(1, 2).float(), dt, B.float(), C.float(), gate.transpose(1, 2).float(), ssm_state.float(), capture)
        kernel = conv_state.shape[2]
        captured = [[(conv_state_after(extended, row, p, kernel), state[None]) for p, state in zip(capture[row], states[row])]
                    for row in range(batch)]  # fmt: skip
        return self.out_proj(y.to(x.dtype)), captured

    def _scan_in_c(self, u: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, gate: torch.Tensor, state: torch.Tensor,
                   capture: list[list[int]]) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:  # fmt: skip
        """The selective scan of each row by kernels/mamba_step.c's kvgen_selective_scan: u, dt,
        gate [B, S, I], B, C [B, S, N], states [B, I, N] -> y [B, S, I] and, per row, the states
        [I, N] after each capture point."""
        library = load()
        batch, seq, inner = u.shape
        y, states = torch.empty(batch, seq, inner), []
        A, D = self.A.contiguous(), self.D.contiguous()
        for row in range(batch):
            u_r, dt_r, gate_r, B_r, C_r = (t[row].contiguous() for t in (u, dt, gate, B, C))
            running = state[row].clone().contiguous()
            points = torch.tensor(capture[row], dtype=torch.int64)
            caught = torch.empty(len(capture[row]), inner, self.state_size)
            library.kvgen_selective_scan(u_r.data_ptr(), dt_r.data_ptr(), gate_r.data_ptr(), A.data_ptr(), B_r.data_ptr(),
                                         C_r.data_ptr(), D.data_ptr(), running.data_ptr(), y[row].data_ptr(), seq, inner,
                                         self.state_size, points.data_ptr(), len(capture[row]), caught.data_ptr())  # fmt: skip
            states.append(list(caught))
        return y, states

    def _scan(self, u: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, gate: torch.Tensor, state: torch.Tensor,
              capture: list[list[int]]) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:  # fmt: skip
        """`_scan_in_c` in torch (no C compiler): chunks of SCAN_CHUNK positions, the discretised A
        and B·u materialised for one chunk at a time ([B, T, I, N])."""
        batch, seq, _ = u.shape
        outputs, states = [], [[] for _ in range(batch)]
        wanted = {t: [r for r in range(batch) if t in capture[r]] for r in range(batch) for t in capture[r]}
        for start in range(0, seq, SCAN_CHUNK):
            end = min(start + SCAN_CHUNK, seq)
            step = dt[:, start:end, :, None]  # [B, T, I, 1]
            decay = torch.exp(self.A * step)  # [B, T, I, N]
            drive = step * B[:, start:end, None, :] * u[:, start:end, :, None]  # [B, T, I, N]
            chunk = []
            for t in range(end - start):
                state = decay[:, t] * state + drive[:, t]  # [B, I, N]
                chunk.append(state)
                for row in wanted.get(start + t, ()):
                    states[row].append(state[row].clone())
            outputs.append(torch.einsum("btin,btn->bti", torch.stack(chunk, dim=1), C[:, start:end]))  # [B, T, I]
        return (torch.cat(outputs, dim=1) + u * self.D) * F.silu(gate), states


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class MambaModel(RecurrentLM):
    """forward(input_ids, cache) like DecoderLM's, over an SSMStateCache (models/recurrent.py)."""

    def __init__(self, config: MambaConfig, weights: WeightSource):
        super().__init__(config)
        self._load_backbone(weights, MambaMixer)

    def state_spec(self, batch: int = 1) -> SSMSpec:
        c = self.config
        return SSMSpec(c.num_layers, (batch, c.intermediate_size, c.conv_kernel), (batch, c.intermediate_size, c.state_size))
