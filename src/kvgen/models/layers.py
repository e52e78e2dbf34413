"""Building blocks shared by every model family: norm, attention over the cache contract, gated MLP."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.config import ModelConfig
from kvgen.kernels import load
from kvgen.kv.interface import KVCache
from kvgen.models.lora import LoraStacks, with_delta
from kvgen.models.rotary import apply_rotary, c_rows_take
from kvgen.models.weights import WeightSource, frozen, fused_linear, linear


class RMSNorm(nn.Module):
    """x / rms(x) * weight, in fp32. Gemma's (1 + w) is folded into `weight` once at build time."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = frozen(weight)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # c_rows_take first: torch.compile (the GPU step) must not trace load(), which hashes files
        library = load() if c_rows_take(x) else None
        if library is not None:  # the C decode step's norm, one pass per row
            rows = x.contiguous()
            out = torch.empty_like(rows)
            weight = self.weight if self.weight.dtype == torch.float32 else self.weight.float()
            library.kvgen_rms_norm_rows(rows.data_ptr(), weight.data_ptr(), self.eps, rows.numel() // rows.shape[-1],
                                        rows.shape[-1], out.data_ptr())  # fmt: skip
            return out
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


@dataclass
class AttentionMask:
    """What SDPA needs for one forward pass and one kind of layer (full or a given window)."""

    mask: torch.Tensor | None  # [B or 1, 1, S, L]: bool (True = may attend) or float (added to scores)
    is_causal: bool
    # Set for a batch of one-token rows over a PagedBatchView that attends in place: per row, the
    # first position its query sees (the mask is then not used).
    in_place_starts: torch.Tensor | None = None

    @classmethod
    def build(
        cls, query_start: int, num_queries: int, key_start: int, num_keys: int, window: int | None,
        sinks: int = 0, chunk: int | None = None, key_bias: torch.Tensor | None = None,
    ) -> "AttentionMask":  # fmt: skip
        """Causal mask for queries at query_start.. over keys at key_start.., narrowed to the last
        `window` positions (the first `sinks` stay visible) and to the query's own `chunk`.

        Decode without a window needs no mask at all, and a fresh prefill without a window uses SDPA's
        own causal path; only the other cases materialise an [S, L] mask. `key_bias` (the cache's
        `key_bias()`) makes it an additive float mask with the bias on the first keys.
        """
        if key_bias is not None:
            allowed = cls.allowed(query_start, num_queries, key_start, num_keys, window, sinks, chunk)
            return cls(cls.with_key_bias(allowed, [key_bias]), False)
        query_end = query_start + num_queries
        windowed = window is not None and query_end - key_start > window
        chunked = chunk is not None and key_start < (query_end - 1) // chunk * chunk
        if not windowed and not chunked and num_queries == 1:
            return cls(None, False)
        if not windowed and not chunked and query_start == 0 and key_start == 0:
            return cls(None, True)
        return cls(cls.allowed(query_start, num_queries, key_start, num_keys, window, sinks, chunk), False)

    def to(self, device: torch.device) -> "AttentionMask":
        """The mask on `device` (the model's: a GPU model's masks are built on the CPU, then moved)."""
        if self.mask is None or self.mask.device == device:
            return self
        return AttentionMask(self.mask.to(device), self.is_causal, self.in_place_starts)

    @staticmethod
    def with_key_bias(allowed: torch.Tensor, key_biases: list[torch.Tensor | None]) -> torch.Tensor:
        """Bool mask [B, 1, S, L] -> additive float mask, row b's bias added on its first keys."""
        additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        for row, bias in enumerate(key_biases):
            if bias is not None:
                additive[row, ..., : bias.shape[0]] += bias
        return additive

    @staticmethod
    def allowed(
        query_start: int, num_queries: int, key_start: int, num_keys: int, window: int | None,
        sinks: int = 0, chunk: int | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """[1, 1, S, L] bool, True where the query at query_start+i may see the key at key_start+j."""
        query_pos = torch.arange(query_start, query_start + num_queries)[:, None]
        key_pos = torch.arange(key_start, key_start + num_keys)[None, :]
        allowed = key_pos <= query_pos
        if window is not None:
            allowed &= (query_pos - key_pos < window) | (key_pos < sinks)
        if chunk is not None:
            allowed &= key_pos // chunk == query_pos // chunk
        return allowed[None, None]


class CachedAttention(nn.Module):
    """Attention of queries over the cache once their keys and values are in it: what grouped-query
    attention and DeepSeek's latent attention (models/mla.py) share. Subclasses set layer,
    num_heads, num_kv_heads, scale, softcap and sinks."""

    layer: int
    num_heads: int
    num_kv_heads: int
    scale: float
    softcap: float | None
    sinks: torch.Tensor | None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, mask: AttentionMask) -> torch.Tensor:
        """The new keys and values into the cache, and q's attention over it: [B, H, S, D]."""
        if self.softcap is not None or self.sinks is not None:
            return self._explicit(q, k, v, cache, mask)
        if mask.in_place_starts is not None:  # decodes over paged blocks, read where they are
            return cache.attend_in_place(self.layer, q, k, v, self.scale, mask.in_place_starts)  # type: ignore[attr-defined]
        keys, values = cache.update(self.layer, k, v)  # [B, H_kv, L, D]
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask.mask, is_causal=mask.is_causal, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # fmt: skip

    def _explicit(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, mask: AttentionMask) -> torch.Tensor:
        """softmax(cap * tanh(q.k * scale / cap) + mask) v, the eager attention of Gemma 2; with sinks
        (gpt-oss), each head's sink logit joins the softmax as a key with no value."""
        keys, values = cache.update(self.layer, k, v)  # [B, H_kv, L, D]
        groups = self.num_heads // self.num_kv_heads
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)  # [B, H, L, D]
        scores = torch.matmul(q, keys.transpose(2, 3)) * self.scale  # [B, H, S, L]
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        seq, num_keys = q.shape[2], keys.shape[2]
        allowed = mask.mask
        assert mask.in_place_starts is None, "explicit attention has no in-place kernel (see DecoderLM._forward_batch)"
        if mask.is_causal:
            allowed = AttentionMask.allowed(0, seq, 0, num_keys, None)
        if allowed is not None and allowed.dtype == torch.bool:
            scores = scores.masked_fill(~allowed, float("-inf"))
        elif allowed is not None:
            scores = scores + allowed
        if self.sinks is None:
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        else:
            sinks = self.sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
            probs = torch.softmax(torch.cat([scores.float(), sinks], dim=-1), dim=-1)[..., :-1].to(q.dtype)
        return torch.matmul(probs, values)  # [B, H, S, D]


class Attention(CachedAttention):
    """Grouped-query attention with fused QKV; keys and values go through the cache contract."""

    lora: LoraStacks | None = None  # set while adapters are loaded (kvgen/lora/registry.py)

    def __init__(self, config: ModelConfig, layer: int, weights: WeightSource, prefix: str, qk_norm_offset: float | None):
        super().__init__()
        self.layer = layer  # its keys' slot in the cache
        self.lora_layer = layer  # its model layer, which keys its adapters' weights (a hybrid's differs from its cache slot)
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = config.attention_scale
        # Attention logit soft-capping (Gemma 2) and sink logits (gpt-oss) need the scores, so they run outside SDPA.
        self.softcap = config.attn_logit_softcapping
        self.sinks = frozen(weights.take_tensor(f"{prefix}.sinks").float()) if config.attention_sinks else None  # [H]
        if weights.has(f"{prefix}.qkv_proj.weight"):  # Phi-3 checkpoints store QKV fused already
            fused = f"{prefix}.qkv_proj"
            self.qkv = linear(weights.take(f"{fused}.weight"), bias_of(weights, fused))
        else:
            names = [f"{prefix}.{p}_proj" for p in ("q", "k", "v")]
            self.qkv = fused_linear([weights.take(f"{n}.weight") for n in names], [bias_of(weights, n) for n in names])
        self.o_proj = linear(weights.take(f"{prefix}.o_proj.weight"), bias_of(weights, f"{prefix}.o_proj"))
        self.q_norm = self.k_norm = None
        self.qk_norm_full = False
        if qk_norm_offset is not None:  # Gemma 3 and Qwen3 normalise each head's q and k before RoPE
            eps = config.rms_norm_eps
            self.q_norm = RMSNorm(weights.take_tensor(f"{prefix}.q_norm.weight") + qk_norm_offset, eps)
            self.k_norm = RMSNorm(weights.take_tensor(f"{prefix}.k_norm.weight") + qk_norm_offset, eps)
            # OLMo 2's norms span all heads at once (a weight per projection row, not per head channel)
            self.qk_norm_full = self.q_norm.weight.numel() == self.num_heads * self.head_dim != self.head_dim

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache, mask: AttentionMask
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv(x)
        if self.lora is not None:
            qkv = self.lora.add_delta(self.lora_layer, "qkv", x, qkv)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, seq, self.num_heads, self.head_dim)
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), *rope)  # [B, H, S, D]
        k = apply_rotary(k.transpose(1, 2), *rope)  # [B, H_kv, S, D]
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, S, D]
        out = self.attend(q, k, v, cache, mask).transpose(1, 2).reshape(batch, seq, q_size)
        y = self.o_proj(out)
        return with_delta(self.lora, self.lora_layer, "o", out, y)


def bias_of(weights: WeightSource, name: str) -> torch.Tensor | None:
    """Projection `name`'s bias where the checkpoint has one."""
    return weights.take_tensor(f"{name}.bias") if weights.has(f"{name}.bias") else None


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g =
    min(gate, limit)."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


# hidden_act -> kernels/rows_ops.c's kvgen_gated_rows code (gpt-oss's clamped SwiGLU stays in torch)
GATED_ACT_CODES = {"silu": 0, "gelu_tanh": 1}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul (SwiGLU / GeGLU)."""

    lora: LoraStacks | None = None  # set with `layer` while adapters are loaded
    layer: int = -1

    def __init__(self, config: ModelConfig, weights: WeightSource, prefix: str, intermediate: int | None = None):
        super().__init__()
        self.intermediate = intermediate or config.intermediate_size  # a mixture's experts have their own width
        if weights.has(f"{prefix}.gate_up_proj.weight"):  # Phi-3 stores gate and up fused (gate first)
            self.gate_up = linear(weights.take(f"{prefix}.gate_up_proj.weight"), bias_of(weights, f"{prefix}.gate_up_proj"))
        else:
            names = (f"{prefix}.gate_proj", f"{prefix}.up_proj")
            self.gate_up = fused_linear([weights.take(f"{n}.weight") for n in names], [bias_of(weights, n) for n in names])
        self.down = linear(weights.take(f"{prefix}.down_proj.weight"), bias_of(weights, f"{prefix}.down_proj"))
        self.act = F.silu if config.hidden_act == "silu" else lambda t: F.gelu(t, approximate="tanh")
        self.act_code = GATED_ACT_CODES.get(config.hidden_act)  # the C row op's, where it has this one
        self.clamped = (config.swiglu_alpha, config.swiglu_limit) if config.hidden_act == "swiglu_oai" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if self.lora is not None:
            gate_up = self.lora.add_delta(self.layer, "gate_up", x, gate_up)
        library = load() if self.act_code is not None and c_rows_take(gate_up) else None
        if library is not None:
            # the C decode step's SwiGLU / GeGLU, one pass per row (torch: the activation, then the product)
            gate_up = gate_up.contiguous()
            hidden = torch.empty(*gate_up.shape[:-1], self.intermediate)
            rows = gate_up.numel() // gate_up.shape[-1]
            library.kvgen_gated_rows(gate_up.data_ptr(), rows, self.intermediate, self.act_code, hidden.data_ptr())
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            hidden = self.act(gate) * up if self.clamped is None else clamped_swiglu(gate, up, *self.clamped)
        y = self.down(hidden)
        return with_delta(self.lora, self.layer, "down", hidden, y)


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x))²): Nemotron-H's ungated MLP (its experts' and shared expert's too). `gate_up`
    holds the up projection alone: the C steps read it where a gated MLP's fused gate and up go, and
    their activation 3 squares its relu (kernels/decode.c)."""

    lora: LoraStacks | None = None  # set with `layer` while adapters are loaded; `gate_up` takes the up projection's
    layer: int = -1

    def __init__(self, config: ModelConfig, weights: WeightSource, prefix: str, intermediate: int | None = None):
        super().__init__()
        self.intermediate = intermediate or config.intermediate_size
        self.gate_up = linear(weights.take(f"{prefix}.up_proj.weight"), bias_of(weights, f"{prefix}.up_proj"))
        self.down = linear(weights.take(f"{prefix}.down_proj.weight"), bias_of(weights, f"{prefix}.down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.relu(with_delta(self.lora, self.layer, "gate_up", x, self.gate_up(x))).square()
        return with_delta(self.lora, self.layer, "down", hidden, self.down(hidden))


def feed_forward(config: ModelConfig, weights: WeightSource, prefix: str, intermediate: int | None = None) -> GatedMLP | ReluSquaredMLP:
    """The MLP `config.hidden_act` names: ungated ReLU² (relu2) or gated (SwiGLU, GeGLU, gpt-oss's clamped SwiGLU)."""
    kind = ReluSquaredMLP if config.hidden_act == "relu2" else GatedMLP
    return kind(config, weights, prefix, intermediate)
