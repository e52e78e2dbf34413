"""Model configuration: one frozen, validated description of an architecture.

Both loaders (GGUF metadata and HF config.json) produce a `ModelConfig`; the models read nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

LayerType = Literal["full", "sliding"]
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe",
                           "gpt_oss", "deepseek_v2", "olmo2", "olmoe")
STATE_SPACE_ARCHITECTURES = ("mamba", "mamba2", "granitemoehybrid", "lfm2", "nemotron_h", "falcon_h1")  # MambaConfig, Mamba2Config, HybridConfig, below
ENCODER_DECODER_ARCHITECTURES = ("t5",)  # T5Config, below


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are stretched for long context (HF `rope_scaling` / `rope_parameters`)."""

    kind: Literal["linear", "llama3", "longrope", "yarn"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # LongRoPE (Phi-3): per-frequency divisors, short up to original_max_position, long beyond;
    # cos/sin scaled by attention_factor.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    # YaRN (Qwen2/3 long context): frequencies blended between interpolated (/ factor) and kept over
    # a ramp of dimensions set by beta_fast / beta_slow rotations in original_max_position; cos/sin
    # scaled by attention_factor. truncate: the ramp's ends rounded to whole dimensions.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `factor` times (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    # swiglu_oai (gpt-oss): (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
    hidden_act: Literal["silu", "gelu_tanh", "swiglu_oai", "relu2"] = "silu"  # relu2: Nemotron-H's ungated down(relu(up x)²)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rope_scaling: RopeScaling | None = None
    # Sliding-window attention: `layer_types[i]` says whether layer i sees the whole context or only
    # the last `sliding_window` positions (the query's own position included).
    sliding_window: int | None = None
    layer_types: tuple[LayerType, ...] = field(default=())
    # Gemma 3 specifics: local layers use their own RoPE base; scores scale by 1/sqrt(this scalar).
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 2: attention scores pass through cap * tanh(score / cap) before the softmax.
    attn_logit_softcapping: float | None = None
    # gpt-oss: each query head's learned sink logit joins its softmax (weight to no value).
    attention_sinks: bool = False
    # Partial rotary (Phi-4-mini): RoPE turns only the first `rotary_dim` channels of each head.
    rotary_dim: int | None = None
    # SmolLM3's NoPE layers: these layers' attention turns no channel (no position information).
    nope_layers: tuple[int, ...] = ()
    # Granite's scalars: token embeddings times embedding_multiplier, each sublayer's output times
    # residual_multiplier before its residual add, logits divided by logits_scaling (its attention
    # multiplier is the score scale: query_pre_attn_scalar = multiplier ** -2).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Mixture of experts (Mixtral, Qwen3-MoE, gpt-oss): in `moe_layers` the MLP is `num_experts` SwiGLU experts
    # of width `expert_intermediate_size`; each token goes to the `experts_per_token` its router
    # scores highest, their softmax weights renormalised to sum to 1 when `normalize_expert_weights`.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    normalize_expert_weights: bool = True
    moe_layers: tuple[int, ...] = ()
    # Qwen2-MoE, DeepSeek-V2: beside the routed experts, a shared SwiGLU expert of this width runs on
    # every token (0: none), its output scaled by sigmoid(shared_expert_gate . x) where gated
    # (Qwen2-MoE). DeepSeek scales the routed experts' weights by routed_scaling_factor.
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True
    routed_scaling_factor: float = 1.0
    # DeepSeek-V3's routing (and V2's over expert groups): experts scored by "sigmoid" instead of
    # "softmax"; where the checkpoint has a per-expert bias (e_score_correction_bias) it joins the
    # scores that choose the experts, not their weights; with expert_groups > 1 only the
    # expert_groups_used groups whose best score (softmax) or best two scores' sum (sigmoid) lead
    # may be chosen from.
    expert_scoring: Literal["softmax", "sigmoid"] = "softmax"
    expert_groups: int = 1
    expert_groups_used: int = 1
    # DeepSeek-V2's multi-head latent attention (kv_lora_rank > 0, models/mla.py): keys and values
    # come from one latent of kv_lora_rank values per token plus a shared RoPE key of
    # qk_rope_head_dim; the cache holds that latent and RoPE key as one KV head (head_dim =
    # qk_rope_head_dim + kv_lora_rank, the first qk_rope_head_dim channels turned: rotary_dim).
    # Queries: q_proj, or q_a_proj -> norm -> q_b_proj where q_lora_rank > 0.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.architecture!r}; expected one of {SUPPORTED_ARCHITECTURES}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding layers need a sliding_window size")
        if self.moe_layers and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) must be between 1 and num_experts ({self.num_experts})")
        if self.moe_layers and self.expert_intermediate_size <= 0:
            raise ValueError("mixture-of-experts layers need an expert_intermediate_size")
        if self.expert_scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"expert_scoring {self.expert_scoring!r} is neither 'softmax' nor 'sigmoid'")
        if self.expert_groups > 1 and (self.num_experts % self.expert_groups or not 1 <= self.expert_groups_used <= self.expert_groups):
            raise ValueError(f"{self.num_experts} experts cannot form {self.expert_groups} groups of which "
                             f"{self.expert_groups_used} are used")  # fmt: skip

    @property
    def attention_scale(self) -> float:
        scalar = self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim
        return float(scalar) ** -0.5

    def rope_theta_for(self, layer: int) -> float:
        if self.layer_types[layer] == "sliding" and self.rope_local_theta is not None:
            return self.rope_local_theta
        return self.rope_theta

    def window_for(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding" else None


@dataclass(frozen=True)
class MambaConfig:
    """A Mamba (selective state-space) LM: no attention, no positions (models/mamba.py)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    state_size: int
    conv_kernel: int
    time_step_rank: int
    num_layers: int
    rms_norm_eps: float
    tie_word_embeddings: bool = True
    use_conv_bias: bool = True
    use_bias: bool = False
    # Falcon-Mamba: dt, B and C pass a weightless RMS norm with this epsilon before use; None: plain Mamba.
    dt_b_c_rms_eps: float | None = None
    # No positions: any length fits; the generator caps prompt + output at this.
    max_position_embeddings: int = 1 << 20
    architecture: str = "mamba"


@dataclass(frozen=True)
class Mamba2Config:
    """A Mamba-2 LM (models/mamba2.py): heads of head_dim channels, each with a scalar decay, reading
    B and C from one of n_groups groups; a gated RMSNorm over each group of channels before out_proj."""

    vocab_size: int
    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    num_layers: int
    rms_norm_eps: float
    chunk_size: int = 256  # prefill's SSD chunk: bounds its [chunk, chunk] matrices per head
    tie_word_embeddings: bool = False
    use_conv_bias: bool = True
    use_bias: bool = False
    max_position_embeddings: int = 1 << 20  # no positions: the generator caps prompt + output at this
    architecture: str = "mamba2"
    gated_norm: bool = True  # the RMSNorm over y SiLU(z) before out_proj; Falcon-H1's mixers may go without it

    def __post_init__(self) -> None:
        if self.num_heads % self.n_groups:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of n_groups ({self.n_groups})")
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the convolution runs over: x, B and C together."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size


@dataclass(frozen=True)
class ShortConvConfig:
    """LFM2's gated short convolution (models/short_conv.py): in_proj -> B, C, x [hidden] each; B x
    through a causal depthwise conv of conv_kernel taps (no activation); C times that; out_proj.
    Its state is the conv's last conv_kernel inputs, nothing recurrent."""

    hidden_size: int
    conv_kernel: int
    num_layers: int
    use_bias: bool = False


@dataclass(frozen=True)
class HybridConfig:
    """A stack of state layers and attention layers (models/granite_hybrid.py): `layer_types[i]` is
    "mamba" (a Mamba-2 mixer: IBM's Granite 4.0-H, Bamba, NVIDIA's Nemotron-H), "conv" (a gated short
    convolution: Liquid's LFM2), "attention", "parallel" (attention and a Mamba-2 mixer side by side
    on one normed input, both added to the residual: TII's Falcon-H1), or "mlp" (an MLP or mixture
    alone: Nemotron-H). Where
    `mlp_every_layer` (Granite, Bamba, LFM2) every mamba, conv and attention layer then runs the MLP (or
    mixture) of `decoder`; otherwise (Nemotron-H) each layer is its one sublayer behind one norm.
    `decoder` also holds the attention layers' shape, the norms' epsilon, the vocabulary and Granite's
    scalars; `mixer` the state layers' shape (Mamba2Config or ShortConvConfig, one kind a model).
    `rope`: whether attention turns its queries and keys (Granite 4.0-H's and Nemotron-H's do not: NoPE)."""

    decoder: ModelConfig
    mixer: Mamba2Config | ShortConvConfig
    layer_types: tuple[str, ...]
    rope: bool = False
    architecture: str = "granitemoehybrid"
    mlp_every_layer: bool = True
    # µP multipliers the loader folded into the projections (Falcon-H1 from config.json), by name;
    # LoRA adapters trained beside the unfolded projections get the same folding (lora/adapter.py)
    folded_multipliers: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        state_kind = "conv" if isinstance(self.mixer, ShortConvConfig) else "mamba"
        kinds = {state_kind, "attention"} | (set() if self.mlp_every_layer else {"mlp"}) | ({"parallel"} if state_kind == "mamba" else set())
        if len(self.layer_types) != self.decoder.num_layers or set(self.layer_types) - kinds:
            raise ValueError(f"layer_types must name one of {sorted(kinds)} for each of {self.decoder.num_layers} layers, "
                             f"got {self.layer_types}")  # fmt: skip

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind in ("attention", "parallel"))

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The layers that carry a state (Mamba-2 or short conv), in the order the cache holds them."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind in ("mamba", "conv", "parallel"))

    def has_mlp(self, layer: int) -> bool:
        """Whether layer `layer` runs an MLP (or mixture): every layer where mlp_every_layer, else the "mlp" layers."""
        return self.mlp_every_layer or self.layer_types[layer] == "mlp"

    # What the generator, engine and server read of any model's config: the decoder's.
    vocab_size = property(lambda self: self.decoder.vocab_size)
    hidden_size = property(lambda self: self.decoder.hidden_size)
    num_layers = property(lambda self: self.decoder.num_layers)
    max_position_embeddings = property(lambda self: self.decoder.max_position_embeddings)
    tie_word_embeddings = property(lambda self: self.decoder.tie_word_embeddings)
    rms_norm_eps = property(lambda self: self.decoder.rms_norm_eps)


@dataclass(frozen=True)
class T5Config:
    """A T5 encoder-decoder (models/t5.py): relative position buckets, no absolute positions."""

    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int  # encoder blocks
    num_decoder_layers: int
    num_heads: int
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    rms_norm_eps: float = 1e-6
    gated_gelu: bool = False  # T5 v1.1 / Flan-T5: wo(gelu(wi_0 x) * wi_1 x); T5 v1.0: wo(relu(wi x))
    tie_word_embeddings: bool = True
    # The decoder output is multiplied by d_model**-0.5 before the head (T5 v1.0's tied head).
    scale_decoder_outputs: bool = True
    decoder_start_token_id: int = 0
    max_position_embeddings: int = 1 << 20  # relative positions: no limit but memory
    architecture: str = "t5"


def alternating_layer_types(num_layers: int) -> tuple[LayerType, ...]:
    """Gemma 2: even layers slide, odd layers see everything."""
    return tuple("sliding" if i % 2 == 0 else "full" for i in range(num_layers))


def every_nth_layer(num_layers: int, step: int) -> tuple[int, ...]:
    """Layers step - 1, 2 step - 1, ...: SmolLM3's NoPE layers (every 4th; llama.cpp fixes the step)."""
    return tuple(i for i in range(num_layers) if (i + 1) % step == 0)


def granite_scalars(embedding: float, residual: float, logits: float, attention: float) -> dict[str, float]:
    """Granite's four multipliers as ModelConfig fields: its attention multiplier is the score scale
    itself, so query_pre_attn_scalar = multiplier ** -2 (attention_scale = scalar ** -0.5)."""
    return {"embedding_multiplier": float(embedding), "residual_multiplier": float(residual), "logits_scaling": float(logits),
            "query_pre_attn_scalar": float(attention) ** -2}  # fmt: skip


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[LayerType, ...]:
    """Gemma 3 interleaves 5 sliding-window layers with 1 global layer (llama.cpp hard-codes the same)."""
    return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers))


CacheKind = Literal["contiguous", "paged", "quantized", "window", "sinks", "chunked", "compressed", "tiered"]
CACHE_KINDS: tuple[str, ...] = ("contiguous", "paged", "quantized", "window", "sinks", "chunked", "compressed", "tiered")
# The options each cache kind takes (CacheConfig fields besides `kind`); any other option set away
# from its default is refused, so no option is accepted and then ignored.
KIND_OPTIONS: dict[str, tuple[str, ...]] = {
    "contiguous": (),
    "paged": ("block_size", "budget_mb"),
    "quantized": ("k_dtype", "v_dtype", "residual"),
    "window": ("window", "extra"),
    "sinks": ("window", "sinks"),
    "chunked": ("chunk", "window", "extra"),
    "compressed": ("pool_chunk", "exact_window", "sinks"),
    "tiered": ("block_size", "hot_tokens", "warm_tokens", "warm_dtype"),
}
# The command-line flag of each option, for error messages.
OPTION_FLAGS = {
    "block_size": "--kv-block-size", "budget_mb": "--kv-budget-mb", "k_dtype": "--kv-dtype-k", "v_dtype": "--kv-dtype-v",
    "residual": "--kv-residual", "window": "--kv-window", "extra": "--kv-extra", "sinks": "--kv-sinks",
    "chunk": "--kv-chunk", "pool_chunk": "--kv-pool-chunk", "exact_window": "--kv-exact-window",
    "hot_tokens": "--kv-hot-tokens", "warm_tokens": "--kv-warm-tokens", "warm_dtype": "--kv-warm-dtype",
}  # fmt: skip
DEFAULT_RESIDUAL = 32  # a single-sequence quantized cache keeps this many recent positions in fp32


@dataclass(frozen=True)
class CacheConfig:
    """Which KV cache requests get. contiguous: one buffer per request, sized to prompt + output.
    paged: blocks of `block_size` tokens from one pool of `budget_mb` shared by all requests.
    quantized: K and V rounded through `k_dtype` / `v_dtype` (kv/codecs.py), the last `residual`
    tokens kept in full precision (None: 32 for one sequence; the engine's pool keeps each
    sequence's unfilled block in fp32 and takes no residual). window: layers keep only their window (the model's sliding
    windows, narrowed to `window` on every layer when it is set), plus `extra` older positions so a
    rewind of up to `extra` tokens stays exact. sinks: StreamingLLM, the first `sinks` positions plus
    the last `window` (kv/sinks.py). chunked: each query sees only its chunk of `chunk` positions.
    compressed: positions older than the last `exact_window` mean-pooled in chunks of `pool_chunk`,
    the first `sinks` kept exact (kv/compressed.py). tiered: blocks of `block_size` in hot RAM
    (`hot_tokens`), warm RAM packed as `warm_dtype` (`warm_tokens`), the rest on disk (kv/tiered.py)."""

    kind: CacheKind = "contiguous"
    block_size: int = 16
    budget_mb: float = 512.0
    k_dtype: str = "fp32"
    v_dtype: str = "fp32"
    residual: int | None = None
    window: int | None = None
    extra: int = 0
    sinks: int = 4
    chunk: int | None = None
    pool_chunk: int = 8
    exact_window: int = 64
    hot_tokens: int = 256
    warm_tokens: int = 1024
    warm_dtype: str = "fp16"

    def __post_init__(self) -> None:
        if self.kind not in CACHE_KINDS:
            raise ValueError(f"unknown KV cache kind {self.kind!r}; choose one of {', '.join(CACHE_KINDS)}")
        from kvgen.kv.codecs import KV_DTYPES

        for name in (self.k_dtype, self.v_dtype):
            if name not in KV_DTYPES:
                raise ValueError(f"unknown KV dtype {name!r}; choose one of {', '.join(KV_DTYPES)}")
        if self.residual is not None and self.residual < 0:
            raise ValueError(f"residual must be >= 0, got {self.residual}")
        if self.block_size <= 0 or self.budget_mb <= 0:
            raise ValueError(f"block_size and budget_mb must be positive, got {self.block_size} and {self.budget_mb}")
        self._check_window_options()
        self._check_compressed_and_tiered_options()
        self._check_options_apply()

    def _check_options_apply(self) -> None:
        taken = KIND_OPTIONS[self.kind]
        for option, flag in OPTION_FLAGS.items():
            if option not in taken and getattr(self, option) != CacheConfig.__dataclass_fields__[option].default:
                kinds = [kind for kind, options in KIND_OPTIONS.items() if option in options]
                raise ValueError(
                    f"KV option {option} ({flag}) applies to the {' / '.join(kinds)} cache kinds, not to "
                    f"{self.kind!r}: drop it or choose one of those kinds (--kv-cache)"
                )

    def set_options(self) -> dict[str, object]:
        """The options this config sets away from their defaults (kind aside)."""
        return {name: getattr(self, name) for name in OPTION_FLAGS
                if getattr(self, name) != CacheConfig.__dataclass_fields__[name].default}  # fmt: skip

    def _check_compressed_and_tiered_options(self) -> None:
        if self.pool_chunk < 2 or self.exact_window < 0 or self.hot_tokens < 0 or self.warm_tokens < 0:
            raise ValueError(
                f"need pool_chunk >= 2 and exact_window, hot_tokens, warm_tokens >= 0; got {self.pool_chunk}, "
                f"{self.exact_window}, {self.hot_tokens}, {self.warm_tokens}"
            )
        from kvgen.kv.tier_store import WARM_DTYPES

        if self.warm_dtype not in WARM_DTYPES:
            raise ValueError(f"unknown warm tier dtype {self.warm_dtype!r}; choose one of {', '.join(WARM_DTYPES)}")

    def _check_window_options(self) -> None:
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be a positive number of tokens, got {value}")
        if self.extra < 0 or self.sinks < 0:
            raise ValueError(f"extra and sinks must be >= 0, got {self.extra} and {self.sinks}")
        if self.kind == "sinks" and self.window is None:
            raise ValueError("a sinks cache needs a window (--kv-window N): the recent positions kept besides the sinks")
        if self.kind == "chunked" and self.chunk is None:
            raise ValueError("a chunked cache needs a chunk size (--kv-chunk N)")
