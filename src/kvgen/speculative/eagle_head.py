"""The EAGLE draft head: one decoder layer over the target's features since generation began.

At reply position j its input is the target's last block output f_j (before the final norm) and the
embedding of the token x_{j+1} chosen after it; a linear map of the two (RMS-normalised, scaled)
starts the residual stream, one attention + gated-MLP block runs over it, causal over the earlier
reply positions, and f_j plus the block's output is the predicted f_{j+1} (Li et al., EAGLE, 2024).
The attention is what an MLP over (f_j, x_{j+1}) lacks: the head sees the features of every earlier
reply position, as the target's own layers do. Positions count from the first generated token, the
first one whose feature the decoder hands over (the prompt's are not computed by the prefill).

`EagleHead.forward_sequences` runs whole replies at once (training, teacher-forced);
`HeadCache` keeps the head's keys and values for one request and runs new positions at inference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.kv.rotation import turn
from kvgen.models.rotary import inverse_frequencies


RMS_EPS = 1e-6  # every norm of the head's


def rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS)


def rope_tables(count: int, dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [count, dim] for positions 0..count-1 (the rotate-half layout)."""
    angles = torch.arange(count, dtype=torch.float32)[:, None] * inverse_frequencies(dim, theta, None)[None]
    angles = torch.cat([angles, angles], -1)
    return angles.cos(), angles.sin()


# What a saved head records to be rebuilt: EagleHead's size arguments.
SHAPE = ("hidden_size", "heads", "kv_heads", "head_dim", "inner_size")


class EagleHead(nn.Module):
    def __init__(self, hidden_size: int, heads: int, kv_heads: int, head_dim: int, inner_size: int,
                 draft_vocab: torch.Tensor):  # fmt: skip
        super().__init__()
        self.hidden_size, self.heads, self.kv_heads, self.head_dim = hidden_size, heads, kv_heads, head_dim
        self.inner_size = inner_size
        self.feature_scale = nn.Parameter(torch.ones(hidden_size))
        self.token_scale = nn.Parameter(torch.ones(hidden_size))
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.attn_norm = nn.Parameter(torch.ones(hidden_size))
        self.q = nn.Linear(hidden_size, heads * head_dim, bias=False)
        self.k = nn.Linear(hidden_size, kv_heads * head_dim, bias=False)
        self.v = nn.Linear(hidden_size, kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, hidden_size, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(hidden_size))
        self.gate = nn.Linear(hidden_size, inner_size, bias=False)
        self.up = nn.Linear(hidden_size, inner_size, bias=False)
        self.down = nn.Linear(inner_size, hidden_size, bias=False)
        self.register_buffer("draft_vocab", draft_vocab.long())  # [N] target token ids the head drafts from

    def shape(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in SHAPE}

    def stream_input(self, features: torch.Tensor, token_embeddings: torch.Tensor) -> torch.Tensor:
        """What `fc` maps to the start of the residual stream: both inputs normalised and scaled."""
        pair = torch.stack([features, token_embeddings], dim=-2)  # [..., 2, H]: one norm for both (fewer ops a draft)
        return (rms(pair) * torch.stack([self.feature_scale, self.token_scale])).flatten(-2)

    def stream(self, features: torch.Tensor, token_embeddings: torch.Tensor) -> torch.Tensor:
        return self.fc(self.stream_input(features, token_embeddings))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., S, H] -> q [..., heads, S, D], k and v [..., kv_heads, S, D]."""
        n = rms(x) * self.attn_norm
        split = x.shape[:-1]
        q = self.q(n).view(*split, self.heads, self.head_dim).transpose(-2, -3)
        k = self.k(n).view(*split, self.kv_heads, self.head_dim).transpose(-2, -3)
        v = self.v(n).view(*split, self.kv_heads, self.head_dim).transpose(-2, -3)
        return turn(q, cos, sin), turn(k, cos, sin), v

    def finish(self, features: torch.Tensor, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """attended [..., heads, S, D] -> predicted next features [..., S, H]."""
        h = x + self.o(attended.transpose(-2, -3).flatten(-2))
        n = rms(h) * self.mlp_norm
        return features + h + self.down(F.silu(self.gate(n)) * self.up(n))

    def forward_sequences(self, features: torch.Tensor, token_embeddings: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: features, token_embeddings [B, S, H] from reply position 0 -> predicted
        next features [B, S, H]. Padding goes at the end (causal attention never reads it)."""
        cos, sin = rope_tables(features.shape[1], self.head_dim)
        x = self.stream(features, token_embeddings)
        q, k, v = self.qkv(x, cos, sin)
        return self.finish(features, x, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))

    def forward_chains(self, features: torch.Tensor, token_embeddings: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Training-time test (EAGLE-3): every reply position j starts a chain of `depth` drafts, the
        first teacher-forced as in `forward_sequences`, each next one run on the head's own predicted
        feature, as the proposer chains. features [B, S, H] from reply position 0; token_embeddings
        [B, S + depth - 1, H], the token after each position. -> predicted features per chain step,
        [B, S, H] each (step t at index j predicts the feature at j + t + 1). Step t of chain j
        attends to the target-fed positions 0..j and to its own chain's earlier drafts, at RoPE
        position j + t, exactly what HeadCache gives a draft."""
        seq = features.shape[1]
        cos, sin = rope_tables(seq + depth, self.head_dim)
        x = self.stream(features, token_embeddings[:, :seq])
        q, k0, v0 = self.qkv(x, cos[:seq], sin[:seq])
        outputs = [self.finish(features, x, F.scaled_dot_product_attention(q, k0, v0, is_causal=True, enable_gqa=True))]
        group = self.heads // self.kv_heads
        k0, v0 = k0.repeat_interleave(group, dim=-3), v0.repeat_interleave(group, dim=-3)  # [B, heads, S, D]
        earlier = torch.ones(seq, seq, dtype=torch.bool).tril().logical_not()  # key i > query j: not seen
        own_k: list[torch.Tensor] = []
        own_v: list[torch.Tensor] = []
        scale = self.head_dim**-0.5
        for step in range(1, depth):
            drafted = outputs[-1]
            x = self.stream(drafted, token_embeddings[:, step : step + seq])
            q, k, v = self.qkv(x, cos[step : step + seq], sin[step : step + seq])
            own_k.append(k.repeat_interleave(group, dim=-3))
            own_v.append(v.repeat_interleave(group, dim=-3))
            shared = (q @ k0.transpose(-1, -2) * scale).masked_fill(earlier, float("-inf"))  # [B, heads, S, S]
            chain = torch.stack([(q * key).sum(-1) for key in own_k], -1) * scale  # [B, heads, S, step]
            weights = torch.softmax(torch.cat([shared, chain], -1), -1)
            attended = weights[..., :seq] @ v0 + (weights[..., seq:, None] * torch.stack(own_v, -2)).sum(-2)
            outputs.append(self.finish(drafted, x, attended))
        return outputs


class HeadCache:
    """One request's head keys and values, one entry per reply position, grown as needed.

    `run` appends positions; `truncate` drops drafted ones once the target has verified them."""

    def __init__(self, head: EagleHead, capacity: int = 256):
        self.head, self.length = head, 0
        self.k = torch.empty(head.kv_heads, capacity, head.head_dim)
        self.v = torch.empty(head.kv_heads, capacity, head.head_dim)
        self._rope_rows(capacity)

    def _reserve(self, length: int) -> None:
        capacity = self.k.shape[1]
        if length <= capacity:
            return
        capacity = max(length, 2 * capacity)
        grown_k, grown_v = (torch.empty(self.head.kv_heads, capacity, self.head.head_dim) for _ in range(2))
        grown_k[:, : self.length], grown_v[:, : self.length] = self.k[:, : self.length], self.v[:, : self.length]
        self.k, self.v = grown_k, grown_v
        self._rope_rows(capacity)

    def _rope_rows(self, capacity: int) -> None:
        """rope [capacity, 2, D]: each position's cos and sin side by side, the row layout the C
        decode step reads; cos and sin are views of it."""
        self.rope = torch.stack(rope_tables(capacity, self.head.head_dim), 1)
        self.cos, self.sin = self.rope[:, 0], self.rope[:, 1]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def run(self, features: torch.Tensor, token_embeddings: torch.Tensor) -> torch.Tensor:
        """features, token_embeddings [n, H] at the next n positions -> predicted next features [n, H]."""
        head, n, start = self.head, features.shape[0], self.length
        self._reserve(start + n)
        x = head.stream(features, token_embeddings)
        q, k, v = head.qkv(x, self.cos[start : start + n], self.sin[start : start + n])  # q [heads, n, D]
        self.k[:, start : start + n], self.v[:, start : start + n] = k, v
        self.length = end = start + n
        causal = torch.ones(n, end, dtype=torch.bool).tril(start) if n > 1 else None  # one row sees every key
        attended = F.scaled_dot_product_attention(q, self.k[:, :end], self.v[:, :end], attn_mask=causal, enable_gqa=True)
        return head.finish(features, x, attended)
