"""Mamba-2 (HF Mamba2ForCausalLM): Mamba's blocks with a simpler, faster mixer. Per layer,
in_proj -> [z (gate), xBC, dt]; a causal depthwise conv + SiLU over xBC; heads of head_dim channels,
each with one scalar decay A[h] and a step dt[h] per token, reading B and C from one of n_groups
groups (as grouped-query attention shares keys); y + D x, gated by z in a per-group RMSNorm; out_proj.

Each layer's state is the conv window [1, conv_dim, K] and the recurrent state [1, heads, head_dim,
N], held in an SSMStateCache like Mamba's. Prefill runs the chunked SSD form (models/ssd.py), decode
the same for one position; states at checkpoint multiples are captured exactly on the way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.config import Mamba2Config
from kvgen.errors import UnsupportedModelError
from kvgen.kernels import load
from kvgen.kernels.formats import QuantizedWeight
from kvgen.kv.ssm import SSMSpec
from kvgen.models.lora import LoraStacks, with_delta
from kvgen.models.recurrent import Captured, RecurrentLM, causal_conv, conv_state_after
from kvgen.models.ssd import ScanShape, gated_rms_norm, scan_chunked, scan_in_c
from kvgen.models.weights import WeightSource, frozen, linear


class Mamba2Mixer(nn.Module):
    lora: LoraStacks | None = None  # set with `layer` while adapters are loaded (a hybrid's mixers: in_proj, out_proj)
    layer: int = -1

    def __init__(self, config: Mamba2Config, weights: WeightSource, prefix: str):
        super().__init__()
        c = config
        self.heads, self.head_dim, self.groups, self.state_size, self.chunk = c.num_heads, c.head_dim, c.n_groups, c.state_size, c.chunk_size
        self.widths = [c.intermediate_size, c.conv_dim, c.num_heads]  # in_proj's rows: z, xBC, dt
        self.eps = c.rms_norm_eps

        def optional(name: str) -> torch.Tensor | None:
            return weights.take_tensor(name) if weights.has(name) else None

        in_proj = weights.take(f"{prefix}.in_proj.weight")
        rows = in_proj.out_features if isinstance(in_proj, QuantizedWeight) else in_proj.shape[0]
        if rows != sum(self.widths):  # mamba_ssm's d_mlp: a gated MLP beside the SSM, which transformers lacks
            raise UnsupportedModelError(f"{prefix}.in_proj has {rows} rows, not z + xBC + dt = {sum(self.widths)}: "
                                        f"a Mamba-2 with an MLP in its mixer (d_mlp = {(rows - sum(self.widths)) // 2}) "
                                        "is not supported")  # fmt: skip
        self.in_proj = linear(in_proj, optional(f"{prefix}.in_proj.bias"))
        self.conv_weight = frozen(weights.take_tensor(f"{prefix}.conv1d.weight").reshape(c.conv_dim, 1, -1))  # [conv_dim, 1, K]
        self.conv_bias = optional(f"{prefix}.conv1d.bias")
        self.dt_bias = frozen(weights.take_tensor(f"{prefix}.dt_bias").float())  # [H]
        # HF folders hold A_log; GGUF files A = -exp(A_log) itself, and A, D and the norm reshaped
        a = optional(f"{prefix}.A")
        self.A = frozen((a.float() if a is not None else -torch.exp(weights.take_tensor(f"{prefix}.A_log").float())).reshape(-1))  # [H]
        d = weights.take_tensor(f"{prefix}.D").float()
        self.D = frozen(d.reshape(-1) if d.dim() == 2 and d.shape[-1] == 1 else d)  # [H]
        if self.D.shape != (self.heads,):  # mamba_ssm's D_has_hdim: one D per channel
            raise UnsupportedModelError(f"{prefix}.D has shape {tuple(self.D.shape)}, not one value per head ({self.heads})")
        # Falcon-H1 without mamba_rms_norm: y SiLU(z) goes to out_proj unnormed (the C step: gate_w NULL)
        self.norm_weight = frozen(weights.take_tensor(f"{prefix}.norm.weight").reshape(-1)) if c.gated_norm else None  # [I]
        self.out_proj = linear(weights.take(f"{prefix}.out_proj.weight"), optional(f"{prefix}.out_proj.bias"))

    def _gate(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """y SiLU(gate), then the gated norm where the mixer has one. On the CPU in fp32 in C, each row
        as the decode step computes it (kvgen_gated_norm_rows), so a prompt's outputs, and the states
        after them, have the bits decoding its tokens one by one gives."""
        library = load() if y.device.type == "cpu" else None
        if library is not None and y.dtype == torch.float32 and (self.norm_weight is None or self.norm_weight.dtype == torch.float32):
            y, gate = y.contiguous(), gate.float().contiguous()
            weight = self.norm_weight.contiguous() if self.norm_weight is not None else None
            library.kvgen_gated_norm_rows(y.data_ptr(), gate.data_ptr(), weight.data_ptr() if weight is not None else None,
                                          y.numel() // y.shape[-1], y.shape[-1], self.groups, self.eps)  # fmt: skip
            return y
        if self.norm_weight is not None:
            return gated_rms_norm(y, gate.float(), self.norm_weight.float(), self.groups, self.eps)
        return y * F.silu(gate.float())

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, capture: list[list[int]]) -> tuple[torch.Tensor, Captured]:
        """x [B, S, H], states of the B rows before it -> output [B, S, H] and, per row, the
        (conv, recurrent) states after each position listed in capture[row] (0-based, ascending)."""
        batch, seq, _ = x.shape
        gate, xbc, dt = with_delta(self.lora, self.layer, "mixer_in", x, self.in_proj(x)).split(self.widths, dim=-1)
        xbc, extended = causal_conv(conv_state, xbc.transpose(1, 2), self.conv_weight, self.conv_bias)  # [B, conv_dim, S]
        columns = xbc.transpose(1, 2).float().contiguous()  # [B, S, conv_dim]: u, B, C side by side
        shape = ScanShape(self.heads, self.head_dim, self.groups, self.state_size)
        if x.device.type == "cpu" and load() is not None:  # softplus(dt + dt_bias) in C, as the decode step
            y, states = scan_in_c(columns, dt, self.A, self.D, ssm_state.float(), capture, shape, self.dt_bias)
        else:
            dt = F.softplus(dt.float() + self.dt_bias)  # [B, S, heads]
            y, states = scan_chunked(columns, dt, self.A, self.D, ssm_state.float(), capture, shape, self.chunk)
        y = self._gate(y, gate)
        kernel = conv_state.shape[2]
        captured = [[(conv_state_after(extended, row, p, kernel), state) for p, state in zip(points, states[row])]
                    for row, points in enumerate(capture)]  # fmt: skip
        y = y.to(x.dtype)
        return with_delta(self.lora, self.layer, "mixer_out", y, self.out_proj(y)), captured


class Mamba2Model(RecurrentLM):
    """forward(input_ids, cache) like DecoderLM's, over an SSMStateCache (models/recurrent.py)."""

    def __init__(self, config: Mamba2Config, weights: WeightSource):
        super().__init__(config)
        self._load_backbone(weights, Mamba2Mixer)

    def state_spec(self, batch: int = 1) -> SSMSpec:
        c = self.config
        return SSMSpec(c.num_layers, (batch, c.conv_dim, c.conv_kernel), (batch, c.num_heads, c.head_dim, c.state_size))
