"""Granite 4.0-H (HF `granitemoehybrid`), Bamba, LFM2, Nemotron-H and Falcon-H1: state layers and
attention layers in one stack (Granite 4.0-H described here; the others differ as HybridBlock says).

Each layer: h += residual_multiplier * mixer(input_norm(h)), the mixer a Mamba-2 one
(models/mamba2.py's) or grouped-query attention (models/layers.py's, scores scaled by
attention_multiplier, turned by RoPE only where the config asks: Granite 4.0-H's attention has no
positions); then h += residual_multiplier * mlp(post_norm(h)), the MLP a SwiGLU or a mixture with
that SwiGLU as its shared expert (models/moe.py). Embeddings times embedding_multiplier, logits
divided by logits_scaling, as Granite 3.

The per-sequence memory is a HybridStateCache (kv/hybrid.py): the Mamba layers' states with their
checkpoints, and a contiguous K/V cache over the attention layers only. Where the C step runs, the
one-token rows of a batch (the engine's decodes) go through each layer together
(models/hybrid_decode.py); other rows run one after another (each row's keys are its own), their
attention layers' blocks in C as the decodes run them (`HybridStep.prompt_block`), so a prompt's
attention does not round by how the engine splits it. States at
checkpoint multiples are captured during a prompt as Mamba's are, and the keys and values for those
positions are in the K/V cache already.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.config import HybridConfig, ShortConvConfig
from kvgen.kv.contiguous import ContiguousCache
from kvgen.kv.hybrid import HybridStateCache
from kvgen.kv.interface import CacheSpec
from kvgen.kv.ssm import SSMSpec, SSMStateCache
from kvgen.models.hybrid_decode import HybridStep, hybrid_runs_in_c
from kvgen.models.lora import adapter_slots
from kvgen.models.layers import Attention, AttentionMask, GatedMLP, ReluSquaredMLP, RMSNorm, feed_forward
from kvgen.models.mamba2 import Mamba2Mixer
from kvgen.models.moe import SparseMoE
from kvgen.models.recurrent import RecurrentLM, capture_points
from kvgen.models.rotary import RotaryEmbedding, inverse_frequencies
from kvgen.models.short_conv import ShortConvMixer
from kvgen.models.weights import WeightSource, frozen, linear


class HybridBlock(nn.Module):
    """One layer: h += residual_multiplier * mixer(input_norm(h)) for a state or attention layer,
    then, where the layer has one, h += residual_multiplier * mlp(post_attn_norm(h)). Nemotron-H's
    layers are one sublayer each: a mamba or attention layer has no MLP (mlp None), an "mlp" layer is
    its MLP or mixture alone behind its one norm (input_norm, mixer and attn None). Falcon-H1's
    "parallel" layers have both attn and mixer, reading the same normed input: h += attention, then
    h += mixer (in that order on every path), then the MLP. `kv_slot` and `state_slot` index the
    layer's keys and state in the cache (-1: none)."""

    def __init__(self, config: HybridConfig, layer: int, weights: WeightSource):
        super().__init__()
        prefix, decoder = f"model.layers.{layer}", config.decoder
        kind = config.layer_types[layer]
        self.input_norm = None if kind == "mlp" else RMSNorm(weights.take_tensor(f"{prefix}.input_layernorm.weight"), decoder.rms_norm_eps)
        self.mixer: Mamba2Mixer | ShortConvMixer | None = None
        self.attn: Attention | None = None
        self.kv_slot = config.attention_layers.index(layer) if layer in config.attention_layers else -1
        self.state_slot = config.state_layers.index(layer) if layer in config.state_layers else -1
        if self.kv_slot >= 0:
            per_head_norms = weights.has(f"{prefix}.self_attn.q_norm.weight")  # LFM2 normalises each head's q and k
            self.attn = Attention(decoder, self.kv_slot, weights, f"{prefix}.self_attn", 0.0 if per_head_norms else None)
        if self.state_slot >= 0:
            mixer = config.mixer
            self.mixer = (ShortConvMixer(mixer, weights, f"{prefix}.conv") if isinstance(mixer, ShortConvConfig)
                          else Mamba2Mixer(mixer, weights, f"{prefix}.mamba"))  # fmt: skip
        self.post_attn_norm: RMSNorm | None = None
        self.mlp: SparseMoE | GatedMLP | ReluSquaredMLP | None = None
        if config.has_mlp(layer):
            self.post_attn_norm = RMSNorm(weights.take_tensor(f"{prefix}.post_attention_layernorm.weight"), decoder.rms_norm_eps)
            mixture = decoder.num_experts and layer in decoder.moe_layers  # LFM2-MoE's first layers are dense
            self.mlp = SparseMoE(decoder, weights, f"{prefix}.mlp") if mixture else feed_forward(decoder, weights, f"{prefix}.mlp")
        self.residual_multiplier = decoder.residual_multiplier


class GraniteHybridModel(RecurrentLM):
    """forward(input_ids, cache) like DecoderLM's, over a HybridStateCache (models/recurrent.py's contract)."""

    def __init__(self, config: HybridConfig, weights: WeightSource):
        super().__init__(config)
        decoder = config.decoder
        self.embed_tokens = frozen(weights.take_tensor("model.embed_tokens.weight"))  # [V, H]
        self.layers = nn.ModuleList([HybridBlock(config, i, weights) for i in range(decoder.num_layers)])
        self.norm = RMSNorm(weights.take_tensor("model.norm.weight"), decoder.rms_norm_eps)
        tied = decoder.tie_word_embeddings and not weights.has("lm_head.weight")
        self.lm_head = linear(self.embed_tokens.data if tied else weights.take("lm_head.weight"))
        # Granite 4.0-H's attention has no positions: a rotation by zero angles (the identity)
        rotary_dim = decoder.rotary_dim or decoder.head_dim  # Bamba turns half of each head
        frequencies = inverse_frequencies(rotary_dim, decoder.rope_theta, decoder.rope_scaling)
        self.rope = RotaryEmbedding(frequencies if config.rope else torch.zeros(rotary_dim // 2))

    def state_spec(self, batch: int = 1) -> SSMSpec:
        m = self.config.mixer
        if isinstance(m, ShortConvConfig):  # a conv window, nothing recurrent
            return SSMSpec(m.num_layers, (batch, m.hidden_size, m.conv_kernel), (batch, 0))
        return SSMSpec(m.num_layers, (batch, m.conv_dim, m.conv_kernel), (batch, m.num_heads, m.head_dim, m.state_size))

    def new_state_cache(self, checkpoint_every: int = 64, max_checkpoints: int | None = None) -> HybridStateCache:
        state = super().new_state_cache(checkpoint_every, max_checkpoints)
        d = self.config.decoder
        spec = CacheSpec(len(self.config.attention_layers), d.num_kv_heads, d.head_dim, self.dtype)
        kv = ContiguousCache(spec, capacity=256, max_capacity=d.max_position_embeddings)
        return HybridStateCache(state.spec, kv, state.checkpoint_every, state.max_checkpoints)

    def _forward_batch(self, token_ids: list[list[int]], caches: list[SSMStateCache], num_logits: list[int],
                       slots: list[int]) -> torch.Tensor:  # fmt: skip
        if not all(isinstance(c, HybridStateCache) for c in caches):
            raise ValueError(f"a {self.config.architecture} model keeps its state in a HybridStateCache (model.new_state_cache())")
        return super()._forward_batch(token_ids, caches, num_logits, slots)

    def _adapter_slots(self, adapters: list[str | None]) -> list[int]:
        """LoRA reaches a hybrid's attention, mixers and dense MLPs (kvgen/lora/registry.py attaches it)."""
        return adapter_slots(self.lora, adapters)

    def _embed_rows(self, tokens: list[int]) -> torch.Tensor:
        return (self.embed_tokens[torch.tensor(tokens)].float() * self.config.decoder.embedding_multiplier).contiguous()

    def _logits_of(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h)) / self.config.decoder.logits_scaling

    def _run_c_step(self, h: torch.Tensor, caches: list[SSMStateCache], counts: list[int], slots: list[int]) -> None:
        """Every layer in C (models/hybrid_decode.py): a lone token by the batch-1 step, several
        rows through each layer together (each weight read once for them all; a cache's rows as a
        chain); row r under LoRA adapter slot slots[r] (-1: none); each cache committed."""
        if counts == [1]:
            self._step.step(h[0], caches[0], slots[0])  # type: ignore[arg-type]
        else:
            self._step.step_rows(h, caches, slots, counts)  # type: ignore[arg-type]

    def _scan_batch(self, token_ids: list[list[int]], caches: list[SSMStateCache], num_logits: list[int], slots: list[int]) -> torch.Tensor:
        rows = zip(token_ids, caches, num_logits, slots)
        return torch.cat([self._forward_row(ids, cache, n, slot) for ids, cache, n, slot in rows])  # type: ignore[arg-type]

    def _runs_in_c(self) -> bool:
        return hybrid_runs_in_c(self)

    def _build_step(self) -> HybridStep:
        return HybridStep(self)

    def _forward_row(self, ids: list[int], cache: HybridStateCache, num_logits: int, slot: int = -1) -> torch.Tensor:
        """One sequence's tokens after cache.seq_len, under LoRA adapter slot `slot` (-1: none) ->
        the logits of its last num_logits [num_logits, V]."""
        step = self._c_step()
        # the torch layers' deltas: reduced row by row in C where the C step runs, so that chunks do not round them
        with_lora = self.lora is not None and self.lora.activate_slots([slot], [len(ids)], step.lora_delta if step else None)
        try:
            return self._forward_row_layers(ids, cache, num_logits, slot, step)
        finally:
            if with_lora:
                self.lora.deactivate()  # type: ignore[union-attr]

    def _forward_row_layers(self, ids: list[int], cache: HybridStateCache, num_logits: int, slot: int, step: HybridStep | None) -> torch.Tensor:
        start, seq = cache.seq_len, len(ids)
        d = self.config.decoder
        capture = [capture_points(cache, seq)]
        h = F.embedding(torch.tensor([ids]), self.embed_tokens) * d.embedding_multiplier  # [1, S, H]
        captured: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per Mamba layer: states at the capture points
        if step is None:  # torch's attention: its angles and mask (the C blocks turn by the step's table)
            rope = self.rope(torch.arange(start, start + seq)[None], h.dtype)
            mask = AttentionMask.build(start, seq, 0, start + seq, None)
        for index, block in enumerate(self.layers):
            reads_norm = block.mixer is not None or (block.attn is not None and step is None)
            x = block.input_norm(h) if reads_norm else None  # a parallel layer's mixer reads the input its attention did
            mlp_done = False
            if block.attn is not None:
                if step is not None:  # attention in C, each row as a decode computes it (and the MLP, where the C block carries it)
                    h = h.contiguous()  # updated in place; a parallel layer's mixer reads x, normed before
                    mlp_done = step.prompt_block(index, h[0], cache, start, slot)
                else:
                    h = h + block.attn(x, rope, cache.kv, mask) * block.residual_multiplier
            if block.mixer is not None:
                out, states = block.mixer(x, cache.conv_state(block.state_slot), cache.recurrent_state(block.state_slot), capture)
                captured.append(states[0])
                h = h + out * block.residual_multiplier
            if block.mlp is not None and not mlp_done:
                if step is not None:  # in C, each row as a decode computes it (a mixture's routing too)
                    h = h.contiguous()
                    step.prompt_mlp(index, h[0], slot)
                else:
                    h = h + block.mlp(block.post_attn_norm(h)) * block.residual_multiplier
        snapshots = {point + 1: [layer[k] for layer in captured] for k, point in enumerate(capture[0])}
        for slot, (conv, recurrent) in enumerate(snapshots.pop(seq)):
            cache.write(slot, conv, recurrent)
        cache.commit(seq, snapshots)
        return self.lm_head(self.norm(h[0, seq - num_logits :])) / d.logits_scaling  # [num_logits, V]
