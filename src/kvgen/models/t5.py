"""T5 encoder-decoder. The prompt is the encoder's input; the decoder starts from
`decoder_start_token_id` and keeps its self-attention keys/values in a KV cache, while every decoder
layer's cross-attention K/V are projected from the encoder output once per distinct input and
shared through an `EncoderCache` (kv/encoder.py) keyed by the input's token ids: requests that
repeat an input run neither the encoder nor the cross projections again (`encoder_runs` counts).
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.config import T5Config
from kvgen.kv.contiguous import ContiguousCache
from kvgen.kv.encoder import EncoderCache, EncoderHandle, LayerKV
from kvgen.kv.interface import CacheSpec
from kvgen.models.lora import refuse_adapters
from kvgen.models.layers import RMSNorm
from kvgen.models.weights import WeightSource, frozen, linear

ENCODER_BUDGET_BYTES = 256 << 20


def relative_buckets(relative: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucket of (key position - query position): exact for small offsets, log-spaced beyond."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0).long() * num_buckets
        relative = relative.abs()
    else:
        relative = -torch.min(relative, torch.zeros_like(relative))
    exact = num_buckets // 2
    large = exact + (torch.log(relative.float() / exact) / math.log(max_distance / exact) * (num_buckets - exact)).long()
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(relative < exact, relative, large)


class T5Attention(nn.Module):
    """Unscaled dot-product attention (T5 folds the scale into its weights) with an additive bias."""

    def __init__(self, config: T5Config, weights: WeightSource, prefix: str):
        super().__init__()
        self.heads, self.d_kv = config.num_heads, config.d_kv
        self.q, self.k, self.v, self.o = (linear(weights.take_tensor(f"{prefix}.{n}.weight")) for n in "qkvo")

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], self.heads, self.d_kv).transpose(1, 2)  # [B, H, S, D]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=1.0)  # [B, H, S, D]
        return self.o(out.transpose(1, 2).reshape(q.shape[0], q.shape[2], self.heads * self.d_kv))

    def attend_rows(self, q: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], biases: list[torch.Tensor | None]) -> torch.Tensor:
        """q [n, H, 1, D], one query per row, each over its own K, V [1, H, L_r, D] -> [n, 1, H * D] projected."""
        out = torch.cat([F.scaled_dot_product_attention(q[r : r + 1], k, v, attn_mask=bias, scale=1.0)
                         for r, ((k, v), bias) in enumerate(zip(kv, biases))])  # fmt: skip
        return self.o(out.transpose(1, 2).reshape(q.shape[0], 1, self.heads * self.d_kv))


class T5FeedForward(nn.Module):
    def __init__(self, config: T5Config, weights: WeightSource, prefix: str):
        super().__init__()
        self.gated = config.gated_gelu
        names = ("wi_0", "wi_1") if self.gated else ("wi",)
        self.wi = nn.ModuleList([linear(weights.take_tensor(f"{prefix}.{n}.weight")) for n in names])
        self.wo = linear(weights.take_tensor(f"{prefix}.wo.weight"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.wo(F.gelu(self.wi[0](x), approximate="tanh") * self.wi[1](x))
        return self.wo(F.relu(self.wi[0](x)))


class T5Cache:
    """One request's decoder state: the encoder entry it holds and its self-attention KV.

    Lengths count as the generator sees them: the prompt (the encoder input), then one per decoder
    token after the start token; so `seq_len` = prompt tokens + decoded tokens fed back."""

    positions_removed = False

    def __init__(self, spec: CacheSpec, capacity: int, salt: str = ""):
        self.kv = ContiguousCache(spec, capacity=capacity, max_capacity=1 << 20)
        self.encoder: EncoderHandle | None = None
        self.encoder_len = 0
        self.salt = salt  # requests with different salts never share an encoder entry

    @property
    def seq_len(self) -> int:
        return self.encoder_len + max(self.kv.seq_len - 1, 0)

    def truncate(self, num_tokens: int) -> None:
        if num_tokens == 0:
            self.release()
        elif num_tokens >= self.encoder_len and self.encoder is not None:
            self.kv.truncate(num_tokens - self.encoder_len + 1)
        else:
            raise ValueError(f"cannot keep {num_tokens} tokens of a T5 request: its prompt is the encoder input "
                             f"({self.encoder_len} tokens), kept whole or not at all")  # fmt: skip

    def fork(self) -> "T5Cache":
        """A twin for another sample of the same input: it shares the encoder entry (one more
        reference) and copies the decoder's self-attention K/V."""
        twin = T5Cache(self.kv.spec, 1, self.salt)
        twin.kv = self.kv.fork()
        twin.encoder = self.encoder.share() if self.encoder is not None else None
        twin.encoder_len = self.encoder_len
        return twin

    def release(self) -> None:
        if self.encoder is not None:
            self.encoder.release()
        self.encoder, self.encoder_len = None, 0
        self.kv.truncate(0)

    def memory_bytes(self) -> int:
        return self.kv.memory_bytes()


class T5Model(nn.Module):
    use_fast_decode = False

    def __init__(self, config: T5Config, weights: WeightSource):
        super().__init__()
        self.config = config
        self._forward_lock = threading.Lock()
        self.shared = frozen(weights.take_tensor("shared.weight"))  # [V, d_model]
        eps = config.rms_norm_eps

        def block(side: str, i: int, parts: list[str]) -> nn.ModuleDict:
            prefix = f"{side}.block.{i}.layer"
            modules: dict[str, nn.Module] = {}
            for j, part in enumerate(parts):
                modules[f"{part}_norm"] = RMSNorm(weights.take_tensor(f"{prefix}.{j}.layer_norm.weight"), eps)
                name = {"self": "SelfAttention", "cross": "EncDecAttention", "ff": "DenseReluDense"}[part]
                cls = T5FeedForward if part == "ff" else T5Attention
                modules[part] = cls(config, weights, f"{prefix}.{j}.{name}")
            return nn.ModuleDict(modules)

        self.encoder = nn.ModuleList([block("encoder", i, ["self", "ff"]) for i in range(config.num_layers)])
        self.decoder = nn.ModuleList([block("decoder", i, ["self", "cross", "ff"]) for i in range(config.num_decoder_layers)])
        self.encoder_norm = RMSNorm(weights.take_tensor("encoder.final_layer_norm.weight"), eps)
        self.decoder_norm = RMSNorm(weights.take_tensor("decoder.final_layer_norm.weight"), eps)
        bias = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        self.encoder_bias = frozen(weights.take_tensor(f"encoder.{bias}"))  # [buckets, H]
        self.decoder_bias = frozen(weights.take_tensor(f"decoder.{bias}"))
        head = weights.take_tensor("lm_head.weight") if weights.has("lm_head.weight") else self.shared.data
        self.lm_head = linear(head)
        self.head_scale = config.d_model**-0.5 if config.scale_decoder_outputs else None
        self.encoder_runs = 0
        self.encoder_cache = EncoderCache(self._encode_to_cross_kv, f"t5-{id(self)}", ENCODER_BUDGET_BYTES)
        for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            if weights.has(name):
                weights.take(name)  # copies of `shared`

    @property
    def dtype(self) -> torch.dtype:
        return self.shared.dtype

    @property
    def device(self) -> torch.device:
        """The CPU: this family runs there only (models/device.py refuses to move it)."""
        return self.shared.device

    def fast_decoder(self) -> None:
        return None

    def new_state_cache(self, salt: str = "") -> T5Cache:
        """An empty request state; `salt` keeps its encoder entry apart from other salts' (tenants)."""
        return T5Cache(CacheSpec(self.config.num_decoder_layers, self.config.num_heads, self.config.d_kv, self.dtype), 64, salt)

    def _position_bias(self, table: torch.Tensor, query_start: int, num_queries: int, num_keys: int, bidirectional: bool) -> torch.Tensor:
        c = self.config
        relative = torch.arange(num_keys)[None, :] - torch.arange(query_start, query_start + num_queries)[:, None]
        buckets = relative_buckets(relative, bidirectional, c.relative_attention_num_buckets, c.relative_attention_max_distance)
        return F.embedding(buckets, table).permute(2, 0, 1)[None]  # [1, H, S, L]

    def _encode_to_cross_kv(self, input_ids: torch.Tensor) -> LayerKV:
        """Encoder input ids [1, S] -> per decoder layer, cross-attention K, V [1, H, S, D]."""
        self.encoder_runs += 1
        seq = input_ids.shape[1]
        h = F.embedding(input_ids, self.shared)  # [1, S, d_model]
        bias = self._position_bias(self.encoder_bias, 0, seq, seq, bidirectional=True)
        for layer in self.encoder:
            x = layer["self_norm"](h)
            attn = layer["self"]
            h = h + attn.attend(attn.split(attn.q(x)), attn.split(attn.k(x)), attn.split(attn.v(x)), bias)
            h = h + layer["ff"](layer["ff_norm"](h))
        states = self.encoder_norm(h)
        return [(layer["cross"].split(layer["cross"].k(states)), layer["cross"].split(layer["cross"].v(states))) for layer in self.decoder]

    def forward(
        self, input_ids: torch.Tensor, cache: T5Cache, positions: torch.Tensor | None = None, logits_to_keep: int | None = 1,
        adapter: str | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """First call on an empty cache: input_ids [1, S] is the encoder input, the decoder runs its
        start token -> logits [1, 1, V]. Later calls: decoder tokens [1, S] -> logits [1, S', V]."""
        refuse_adapters(self.config.architecture, [adapter])
        if positions is not None or input_ids.shape[0] != 1:
            raise ValueError("T5 runs one request per call, without explicit positions")
        if not isinstance(cache, T5Cache):
            raise ValueError("a T5 model keeps its state in a T5Cache (model.new_state_cache()), not a KV cache")
        with self._forward_lock:
            if cache.encoder is None:
                cache.kv.truncate(0)
                cache.encoder = self.encoder_cache.acquire(input_ids.detach().to(torch.int64).contiguous(), cache.salt)
                cache.encoder_len = input_ids.shape[1]
                input_ids = torch.tensor([[self.config.decoder_start_token_id]])
            h = self._decode(input_ids, cache)
            if logits_to_keep:
                h = h[:, -logits_to_keep:]
            return self._head(h)

    def forward_batch(
        self, token_ids: list[list[int]], caches: list[T5Cache], num_logits: list[int] | None = None,
        adapters: list[str | None] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The engine's call: rows, each continuing its own T5Cache -> the logits of each row's last
        num_logits[i] tokens [sum, V]. One-token decode rows run together in one batched decoder
        pass (`_decode_rows`); a row on an empty cache is a whole encoder input (it gives the start
        token's logits) and runs on its own, as does any other row."""
        refuse_adapters(self.config.architecture, adapters)
        if len(token_ids) != len(caches) or not caches or any(len(ids) == 0 for ids in token_ids):
            raise ValueError("forward_batch needs one cache per row and at least one token in every row")
        if not all(isinstance(c, T5Cache) for c in caches):
            raise ValueError("a T5 model keeps its state in a T5Cache (model.new_state_cache()), not a KV cache")
        num_logits = num_logits or [1] * len(caches)
        rows: list[torch.Tensor | None] = [None] * len(caches)
        decodes = [i for i, (ids, c) in enumerate(zip(token_ids, caches)) if len(ids) == 1 and c.encoder is not None]
        if len(decodes) > 1:
            with self._forward_lock:
                h = self._decode_rows([token_ids[i][0] for i in decodes], [caches[i] for i in decodes])  # [n, d_model]
            for i, logits in zip(decodes, self._head(h)):
                rows[i] = logits[None]
        for i, (ids, cache, n) in enumerate(zip(token_ids, caches, num_logits)):
            if rows[i] is None:
                rows[i] = self.forward(torch.tensor([ids]), cache, logits_to_keep=n)[0]
        return torch.cat(rows)  # type: ignore[arg-type]

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h * self.head_scale if self.head_scale is not None else h)

    def _decode_rows(self, tokens: list[int], caches: list[T5Cache]) -> torch.Tensor:
        """One decoder token for each of several requests in one pass -> final hidden states [n, d_model].
        Projections and feed-forwards run on all rows at once; attention runs row by row over the
        row's own self-attention K/V and its encoder entry's cross-attention K/V (padding them to a
        common length costs more copying than the attention itself). Caches are committed after
        every layer succeeded."""
        biases = [self._position_bias(self.decoder_bias, c.kv.seq_len, 1, c.kv.seq_len + 1, bidirectional=False) for c in caches]
        h = F.embedding(torch.tensor(tokens)[:, None], self.shared)  # [n, 1, d_model]
        for i, layer in enumerate(self.decoder):
            x, attn = layer["self_norm"](h), layer["self"]
            keys, values = attn.split(attn.k(x)), attn.split(attn.v(x))  # [n, H, 1, D]
            held = [cache.kv.update(i, keys[r : r + 1], values[r : r + 1]) for r, cache in enumerate(caches)]
            h = h + attn.attend_rows(attn.split(attn.q(x)), held, biases)
            x, cross = layer["cross_norm"](h), layer["cross"]
            entries = [cache.encoder.layers[i] for cache in caches]  # type: ignore[union-attr]
            h = h + cross.attend_rows(cross.split(cross.q(x)), entries, [None] * len(caches))
            h = h + layer["ff"](layer["ff_norm"](h))
        for cache in caches:
            cache.kv.commit(1)
        return self.decoder_norm(h)[:, 0]

    def _decode(self, input_ids: torch.Tensor, cache: T5Cache) -> torch.Tensor:
        assert cache.encoder is not None
        start, seq = cache.kv.seq_len, input_ids.shape[1]
        bias = self._position_bias(self.decoder_bias, start, seq, start + seq, bidirectional=False)
        causal = torch.arange(start + seq)[None, :] > torch.arange(start, start + seq)[:, None]  # [S, L]
        bias = bias.masked_fill(causal, float("-inf"))
        h = F.embedding(input_ids, self.shared)  # [1, S, d_model]
        for i, layer in enumerate(self.decoder):
            x, attn = layer["self_norm"](h), layer["self"]
            keys, values = cache.kv.update(i, attn.split(attn.k(x)), attn.split(attn.v(x)))
            h = h + attn.attend(attn.split(attn.q(x)), keys, values, bias)
            x, cross = layer["cross_norm"](h), layer["cross"]
            cross_keys, cross_values = cache.encoder.layers[i]
            h = h + cross.attend(cross.split(cross.q(x)), cross_keys, cross_values, None)
            h = h + layer["ff"](layer["ff_norm"](h))
        cache.kv.commit(seq)
        return self.decoder_norm(h)
