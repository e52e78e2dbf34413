"""DeepSeek-V2's multi-head latent attention (MLA), run as multi-query attention over the latent.

Per token, kv_a_proj gives a latent c (kv_lora_rank values, RMS-normed) and a key part k_pe
(qk_rope_head_dim values, turned by RoPE) shared by every head; kv_b_proj would expand c into each
head's key part k_nope and value. Expanded, head h's score is q_nope . (W_UK[h] c) + q_pe . k_pe
and its output W_UV[h] (softmax . c). Absorbing W_UK into the query (q_lat = W_UK[h]^T q_nope)
makes every head attend over the same per-token vector [k_pe, c] with the query [q_pe, q_lat]:
one KV head of qk_rope_head_dim + kv_lora_rank channels, its first qk_rope_head_dim turned by RoPE
(partial rotary), its value the same vector (only the output's latent part, softmax . c, is read,
so the value's RoPE channels may as well be turned). The cache therefore holds the latent, as
DeepSeek's own inference and vLLM's MLA do, not each head's expanded keys and values: for
DeepSeek-V2-Lite 576 values a token and layer against 16 x (192 + 128) expanded. Its spec says the
values are the keys (CacheSpec.values_are_keys): the contiguous and paged stores and the engine's
pool keep one copy, the other cache kinds store both. The scores
keep DeepSeek's scale, 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim) (times YaRN's mscale²).
"""

from __future__ import annotations

import torch
from torch import nn

from kvgen.config import ModelConfig
from kvgen.kernels.formats import QK, QuantizedWeight, requantize
from kvgen.kv.interface import KVCache
from kvgen.models.layers import AttentionMask, CachedAttention, RMSNorm, bias_of
from kvgen.models.rotary import apply_rotary
from kvgen.models.weights import Weight, WeightSource, frozen, fused_linear, linear


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
        self.w_uk, self.w_uv, self.uk_heads, self.uv_heads = self._expansions(weights, prefix)
        self.o_proj = linear(weights.take(f"{prefix}.o_proj.weight"), bias_of(weights, f"{prefix}.o_proj"))

    def _expansions(
        self, weights: WeightSource, prefix: str
    ) -> tuple[nn.Parameter, nn.Parameter, nn.ModuleList | None, nn.ModuleList | None]:
        """W_UK [H, nope, rank] (absorbed into the queries) and W_UV [H, v, rank] (applied to each
        head's output) in fp32, or, where the weights are quantized, per-head linears in their
        place (empty fp32 tensors returned): W_UK[h]^T [rank, nope] and W_UV[h] [v, rank] in
        blocks, int8 activations as every other linear's. A V2-Lite layer holds 16 x 2 x 128 x 512
        of these values: 8.4 MB in fp32, read every step. A file's attn_k_b / attn_v_b rows keep
        their blocks; kv_b_proj's value rows are row slices of its blocks, and its key rows,
        transposed, are quantized again to 8 bits."""
        heads, nope, v, rank = self.num_heads, self.nope_dim, self.v_dim, self.rank
        blocks = nope % QK == 0 and rank % QK == 0  # every row whole int8 blocks
        if weights.has(f"{prefix}.k_b"):  # GGUFs converted for absorption: [H, rank, nope] and [H, v, rank]
            k_b, v_b = weights.take(f"{prefix}.k_b"), weights.take(f"{prefix}.v_b")
            if blocks and isinstance(k_b, QuantizedWeight) and isinstance(v_b, QuantizedWeight):  # [H * rank, nope], [H * v, rank]
                return _per_head(_row_slices(k_b, heads), _row_slices(v_b, heads))
            w_uk, w_uv = _as_float(k_b).reshape(heads, rank, nope).transpose(1, 2), _as_float(v_b).reshape(heads, v, rank)
        else:
            kv_b = weights.take(f"{prefix}.kv_b_proj.weight")  # [H * (nope + v), rank]
            w_uk, w_uv = _as_float(kv_b).view(heads, nope + v, rank).split([nope, v], dim=1)
            if blocks and isinstance(kv_b, QuantizedWeight):
                return _per_head([requantize(w_uk[h].t().contiguous(), "q8") for h in range(heads)],
                                 [_rows(kv_b, h * (nope + v) + nope, (h + 1) * (nope + v)) for h in range(heads)])  # fmt: skip
        return frozen(w_uk.float().contiguous()), frozen(w_uv.float().contiguous()), None, None

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache, mask: AttentionMask
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        if self.qkv is not None:
            q, kv = self.qkv(x).split([self.num_heads * (self.nope_dim + self.rope_dim), self.rank + self.rope_dim], dim=-1)
        else:
            q, kv = self.q(self.q_a_norm(self.q_a(x))), self.kv_a(x)
        q_nope, q_pe = q.reshape(batch, seq, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        if self.uk_heads is not None:  # per head W_UK[h]^T q_nope over int8 blocks, as decode.c's mla_query
            q_lat = torch.stack([uk(q_nope[:, :, h]) for h, uk in enumerate(self.uk_heads)], dim=1)  # [B, H, S, rank]
        else:
            q_lat = torch.einsum("bshn,hnr->bhsr", q_nope.float(), self.w_uk).to(x.dtype)
        c, k_pe = kv.split([self.rank, self.rope_dim], dim=-1)
        key = apply_rotary(torch.cat([k_pe, self.kv_norm(c)], dim=-1)[:, None], *rope)  # [B, 1, S, rope + rank]
        query = apply_rotary(torch.cat([q_pe.transpose(1, 2), q_lat], dim=-1), *rope)  # [B, H, S, rope + rank]
        out = self.attend(query, key, key, cache, mask)[..., self.rope_dim :]  # the value's latent part: softmax . c
        if self.uv_heads is not None:
            heads = torch.stack([uv(out[:, h]) for h, uv in enumerate(self.uv_heads)], dim=2)  # [B, S, H, v]
        else:
            heads = torch.einsum("bhsr,hvr->bshv", out.float(), self.w_uv).to(x.dtype)
        return self.o_proj(heads.reshape(batch, seq, self.num_heads * self.v_dim))


def _per_head(uk_rows: list[QuantizedWeight], uv_rows: list[QuantizedWeight]) -> tuple[nn.Parameter, nn.Parameter, nn.ModuleList, nn.ModuleList]:
    """`_expansions`' answer with per-head linears: empty fp32 tensors in place of W_UK / W_UV."""
    unused = frozen(torch.empty(0))
    return unused, unused, nn.ModuleList(linear(w) for w in uk_rows), nn.ModuleList(linear(w) for w in uv_rows)


def _as_float(weight: Weight) -> torch.Tensor:
    """A weight's values in fp32 (dequantized blocks, or the tensor)."""
    return linear(weight).dequantized().float() if isinstance(weight, QuantizedWeight) else weight.float()


def _rows(weight: QuantizedWeight, start: int, end: int) -> QuantizedWeight:
    """Rows [start, end) of a quantized weight, their blocks as they are."""
    return QuantizedWeight(kind=weight.kind, blocks=weight.blocks[start:end], out_features=end - start, in_features=weight.in_features)


def _row_slices(weight: QuantizedWeight, heads: int) -> list[QuantizedWeight]:
    per = weight.out_features // heads
    return [_rows(weight, h * per, (h + 1) * per) for h in range(heads)]
