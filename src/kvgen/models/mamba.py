"""Mamba (selective state-space LM): no attention and no KV cache; each layer carries a fixed-size
state (the last `conv_kernel` inputs of its causal convolution and the recurrent state [I, N]),
held in an `SSMStateCache` (kv/ssm.py).

Prefill runs the recurrence over the prompt in chunks of `SCAN_CHUNK` positions: the discretised
A and B·u of one chunk are materialised at a time ([B, T, I, N]), so prefill memory stays bounded in
the prompt length; decode is the same recurrence for one position. States at multiples of the
cache's `checkpoint_every` are captured during the scan and become checkpoints at commit, so a
later request sharing a prefix resumes from the latest one instead of recomputing everything.
"""

from __future__ import annotations

import threading
import torch
import torch.nn.functional as F
from torch import nn

from kvgen.config import MambaConfig
from kvgen.kv.ssm import SSMSpec, SSMStateCache
from kvgen.models.layers import RMSNorm
from kvgen.models.lora import refuse_adapters
from kvgen.models.recurrent import capture_points, causal_conv
from kvgen.models.weights import WeightSource, frozen, linear

SCAN_CHUNK = 64


def state_spec(config: MambaConfig, batch: int = 1) -> SSMSpec:
    return SSMSpec(config.num_layers, (batch, config.intermediate_size, config.conv_kernel), (batch, config.intermediate_size, config.state_size))


class MambaMixer(nn.Module):
    def __init__(self, config: MambaConfig, weights: WeightSource, prefix: str):
        super().__init__()
        self.intermediate, self.state_size, self.rank = config.intermediate_size, config.state_size, config.time_step_rank

        def optional(name: str) -> torch.Tensor | None:
            return weights.take_tensor(name) if weights.has(name) else None

        self.in_proj = linear(weights.take_tensor(f"{prefix}.in_proj.weight"), optional(f"{prefix}.in_proj.bias"))
        self.conv_weight = frozen(weights.take_tensor(f"{prefix}.conv1d.weight"))  # [I, 1, K]
        self.conv_bias = optional(f"{prefix}.conv1d.bias")
        self.x_proj = linear(weights.take_tensor(f"{prefix}.x_proj.weight"))
        self.dt_proj = linear(weights.take_tensor(f"{prefix}.dt_proj.weight"), weights.take_tensor(f"{prefix}.dt_proj.bias"))
        self.A = frozen(-torch.exp(weights.take_tensor(f"{prefix}.A_log").float()))  # [I, N]
        self.D = frozen(weights.take_tensor(f"{prefix}.D").float())  # [I]
        self.out_proj = linear(weights.take_tensor(f"{prefix}.out_proj.weight"), optional(f"{prefix}.out_proj.bias"))

    def forward(
        self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, capture: list[list[int]]
    ) -> tuple[torch.Tensor, list[list[tuple[torch.Tensor, torch.Tensor]]]]:
        """x [B, S, H], states of the B rows before it -> output [B, S, H] and, per row, the
        (conv, recurrent) states after each position listed in capture[row] (0-based, ascending)."""
        batch, seq, _ = x.shape
        u, gate = self.in_proj(x).transpose(1, 2).chunk(2, dim=1)  # [B, I, S] each
        u, extended = causal_conv(conv_state, u, self.conv_weight, self.conv_bias)  # [B, I, S], [B, I, K-1+S]
        kernel = conv_state.shape[2]
        time_step, B, C = self.x_proj(u.transpose(1, 2)).split([self.rank, self.state_size, self.state_size], dim=-1)
        dt = F.softplus(self.dt_proj(time_step)).float()  # [B, S, I]
        outputs, captured = [], [[] for _ in range(batch)]
        wanted = {t: [r for r in range(batch) if t in capture[r]] for r in range(batch) for t in capture[r]}
        state = ssm_state.float()  # [B, I, N]
        for start in range(0, seq, SCAN_CHUNK):
            end = min(start + SCAN_CHUNK, seq)
            step = dt[:, start:end, :, None]  # [B, T, I, 1]
            decay = torch.exp(self.A * step)  # [B, T, I, N]
            drive = step * B[:, start:end, None, :].float() * u.transpose(1, 2)[:, start:end, :, None].float()  # [B, T, I, N]
            states = []
            for t in range(end - start):
                state = decay[:, t] * state + drive[:, t]  # [B, I, N]
                states.append(state)
                for row in wanted.get(start + t, ()):
                    position = start + t  # the conv state after it: the last K inputs up to it
                    captured[row].append((extended[row : row + 1, :, position : position + kernel].clone(), state[row : row + 1].clone()))
            stacked = torch.stack(states, dim=1)  # [B, T, I, N]
            outputs.append(torch.einsum("btin,btn->bti", stacked, C[:, start:end].float()))  # [B, T, I]
        y = torch.cat(outputs, dim=1).transpose(1, 2) + u * self.D[None, :, None]  # [B, I, S]
        y = y * F.silu(gate)
        return self.out_proj(y.transpose(1, 2).to(x.dtype)), captured


class MambaBlock(nn.Module):
    def __init__(self, config: MambaConfig, layer: int, weights: WeightSource):
        super().__init__()
        prefix = f"backbone.layers.{layer}"
        self.norm = RMSNorm(weights.take_tensor(f"{prefix}.norm.weight"), config.rms_norm_eps)
        self.mixer = MambaMixer(config, weights, f"{prefix}.mixer")


class MambaModel(nn.Module):
    """forward(input_ids, cache) like DecoderLM's, over an SSMStateCache instead of a KV cache."""

    use_fast_decode = False  # the C decode path is for attention blocks

    def __init__(self, config: MambaConfig, weights: WeightSource):
        super().__init__()
        self.config = config
        self._forward_lock = threading.Lock()
        self.embed_tokens = frozen(weights.take_tensor("backbone.embeddings.weight"))  # [V, H]
        self.layers = nn.ModuleList([MambaBlock(config, i, weights) for i in range(config.num_layers)])
        self.norm = RMSNorm(weights.take_tensor("backbone.norm_f.weight"), config.rms_norm_eps)
        head = weights.take_tensor("lm_head.weight") if weights.has("lm_head.weight") else self.embed_tokens.data
        self.lm_head = linear(head)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        """The CPU: this family runs there only (models/device.py refuses to move it)."""
        return self.embed_tokens.device

    def fast_decoder(self) -> None:
        return None

    def new_state_cache(self, checkpoint_every: int = 64, max_checkpoints: int = 32) -> SSMStateCache:
        return SSMStateCache(state_spec(self.config), checkpoint_every, max_checkpoints)

    def forward(
        self, input_ids: torch.Tensor, cache: SSMStateCache, positions: torch.Tensor | None = None, logits_to_keep: int | None = 1,
        adapter: str | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """input_ids [1, S] after cache.seq_len tokens -> logits [1, logits_to_keep or S, V]; the
        state after them is committed to `cache` (with checkpoints passed on the way)."""
        refuse_adapters(self.config.architecture, [adapter])
        if positions is not None:
            raise ValueError("Mamba has no positions: its state orders the tokens; call without positions")
        if input_ids.shape[0] != 1:
            raise ValueError(f"forward takes one row (got {input_ids.shape[0]}); use forward_batch for several caches")
        logits = self.forward_batch(input_ids.tolist(), [cache], [logits_to_keep or input_ids.shape[1]])
        return logits[None]  # [1, S', V]

    def forward_batch(
        self, token_ids: list[list[int]], caches: list[SSMStateCache], num_logits: list[int] | None = None,
        adapters: list[str | None] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Ragged rows, each continuing its own cache, in one scan (padded on the right; each row's
        state is taken at its own last token) -> logits of each row's last num_logits[i] tokens [sum, V]."""
        refuse_adapters(self.config.architecture, adapters)
        if len(token_ids) != len(caches) or not caches or any(len(ids) == 0 for ids in token_ids):
            raise ValueError("forward_batch needs one cache per row and at least one token in every row")
        if not all(isinstance(c, SSMStateCache) for c in caches):
            raise ValueError("a Mamba model keeps its state in an SSMStateCache (model.new_state_cache()), not a KV cache")
        num_logits = num_logits or [1] * len(caches)
        with self._forward_lock:
            return self._forward_batch(token_ids, caches, num_logits)

    def _forward_batch(self, token_ids: list[list[int]], caches: list[SSMStateCache], num_logits: list[int]) -> torch.Tensor:
        lengths = [len(ids) for ids in token_ids]
        longest = max(lengths)
        padded = torch.tensor([ids + [0] * (longest - len(ids)) for ids in token_ids])  # [B, S]
        capture = [self._capture_points(cache, n) for cache, n in zip(caches, lengths)]
        h = F.embedding(padded, self.embed_tokens)  # [B, S, H]
        per_layer = []
        for i, block in enumerate(self.layers):
            conv = torch.cat([c.conv_state(i) for c in caches])  # [B, I, K]
            ssm = torch.cat([c.recurrent_state(i) for c in caches])  # [B, I, N]
            out, captured = block.mixer(block.norm(h), conv, ssm, capture)
            h = h + out
            per_layer.append(captured)
        for row, (cache, n) in enumerate(zip(caches, lengths)):
            snapshots = {point + 1: [per_layer[i][row][k] for i in range(len(self.layers))] for k, point in enumerate(capture[row])}
            final = snapshots.pop(n)
            for i, (conv, ssm) in enumerate(final):
                cache.write(i, conv, ssm)
            cache.commit(n, snapshots)
        rows = [r for r, k in enumerate(num_logits) for _ in range(k)]
        columns = [lengths[r] - k + j for r, k in enumerate(num_logits) for j in range(k)]
        return self.lm_head(self.norm(h[torch.tensor(rows), torch.tensor(columns)]))  # [sum, V]

    @staticmethod
    def _capture_points(cache: SSMStateCache, num_tokens: int) -> list[int]:
        return capture_points(cache, num_tokens)
