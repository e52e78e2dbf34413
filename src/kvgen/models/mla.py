"""DeepSeek-V2's multi-head latent attention (MLA), run as multi-query attention over the latent.

Per token, kv_a_proj gives a latent c (kv_lora_rank values, RMS-normed) and a key part k_pe
(qk_rope_head_dim values, turned by RoPE) shared by every head; kv_b_proj would expand c into each
head's key part k_nope and value. Expanded, head h's score is q_nope . (W_UK[h] c) + q_pe . k_pe
and its output W_UV[h] (softmax . c). Absorbing W_UK into the query (q_lat = W_UK[h]^T q_nope)
makes every head attend over the same per-token vector [k_pe, c] with the query [q_pe, q_lat]:
one KV head of qk_rope_head_dim + kv_lora_rank channels, its first qk_rope_head_dim turned by RoPE
(partial rotary), its value the same vector before RoPE (the output's latent part is softmax . c). The cache
therefore holds the latent, as DeepSeek's own inference and vLLM's MLA do, not each head's
expanded keys and values (for DeepSeek-V2-Lite 2 x 576 values a token and layer, the key and value
slots holding the same vector, against 16 x (192 + 128) expanded), and every cache kind serves it
as any one-KV-head model. The scores
keep DeepSeek's scale, 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim) (times YaRN's mscale²).
"""

from __future__ import annotations

import torch
from torch import nn

from kvgen.config import ModelConfig
from kvgen.kv.interface import KVCache
from kvgen.models.layers import AttentionMask, CachedAttention, RMSNorm, bias_of
from kvgen.models.rotary import apply_rotary
from kvgen.models.weights import WeightSource, frozen, fused_linear, linear


class LatentAttention(CachedAttention):
    def __init__(self, config: ModelConfig, layer: int, weights: WeightSource, prefix: str):
        super().__init__()
        self.layer, self.num_heads, self.num_kv_heads = layer, config.num_heads, 1
        self.scale, self.softcap, self.sinks = config.attention_scale, None, None
        self.rope_dim, self.rank = config.qk_rope_head_dim, config.kv_lora_rank
        self.nope_dim, self.v_dim = config.qk_nope_head_dim, config.v_head_dim
        eps = config.rms_norm_eps
        kv_a = f"{prefix}.kv_a_proj_with_mqa"
        if config.q_lora_rank:  # V2: queries from their own latent; kv_a apart
            self.q_a = linear(weights.take(f"{prefix}.q_a_proj.weight"), bias_of(weights, f"{prefix}.q_a_proj"))
            self.q_a_norm = RMSNorm(weights.take_tensor(f"{prefix}.q_a_layernorm.weight"), eps)
            self.q = linear(weights.take(f"{prefix}.q_b_proj.weight"))
            self.kv_a, self.qkv = linear(weights.take(f"{kv_a}.weight"), bias_of(weights, kv_a)), None
        else:  # V2-Lite: q_proj and kv_a read the same input: one matmul, as QKV is elsewhere (and in decode.c)
            self.q_a = self.q_a_norm = self.q = self.kv_a = None
            self.qkv = fused_linear([weights.take(f"{prefix}.q_proj.weight"), weights.take(f"{kv_a}.weight")],
                                    [None, bias_of(weights, kv_a)])  # fmt: skip
        self.kv_norm = RMSNorm(weights.take_tensor(f"{prefix}.kv_a_layernorm.weight"), eps)
        if weights.has(f"{prefix}.k_b"):  # GGUFs converted for absorption: [H, rank, nope] and [H, v, rank]
            w_uk, w_uv = weights.take_tensor(f"{prefix}.k_b").float().transpose(1, 2), weights.take_tensor(f"{prefix}.v_b").float()
        else:
            kv_b = linear(weights.take(f"{prefix}.kv_b_proj.weight"))  # [H * (nope + v), rank]
            kv_b = kv_b.dequantized() if hasattr(kv_b, "dequantized") else kv_b.weight.data
            w_uk, w_uv = kv_b.float().view(self.num_heads, self.nope_dim + self.v_dim, self.rank).split([self.nope_dim, self.v_dim], dim=1)
        self.w_uk = frozen(w_uk.contiguous())  # [H, nope, rank]: absorbed into the queries
        self.w_uv = frozen(w_uv.contiguous())  # [H, v, rank]: applied to each head's output
        self.o_proj = linear(weights.take(f"{prefix}.o_proj.weight"), bias_of(weights, f"{prefix}.o_proj"))

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache, mask: AttentionMask
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        if self.qkv is not None:
            q, kv = self.qkv(x).split([self.num_heads * (self.nope_dim + self.rope_dim), self.rank + self.rope_dim], dim=-1)
        else:
            q, kv = self.q(self.q_a_norm(self.q_a(x))), self.kv_a(x)
        q_nope, q_pe = q.reshape(batch, seq, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        q_lat = torch.einsum("bshn,hnr->bhsr", q_nope.float(), self.w_uk).to(x.dtype)  # [B, H, S, rank]
        c, k_pe = kv.split([self.rank, self.rope_dim], dim=-1)
        value = torch.cat([k_pe, self.kv_norm(c)], dim=-1)[:, None]  # [B, 1, S, rope + rank]: the key before RoPE
        query = apply_rotary(torch.cat([q_pe.transpose(1, 2), q_lat], dim=-1), *rope)  # [B, H, S, rope + rank]
        key = apply_rotary(value, *rope)
        out = self.attend(query, key, value, cache, mask)[..., self.rope_dim :]  # the value's latent part: softmax . c
        heads = torch.einsum("bhsr,hvr->bshv", out.float(), self.w_uv).to(x.dtype)  # [B, S, H, v]
        return self.o_proj(heads.reshape(batch, seq, self.num_heads * self.v_dim))
