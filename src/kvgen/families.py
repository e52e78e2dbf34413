"""What each model family supports, for `kvgen models` and the docs (pure data: no torch import)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilySupport:
    name: str
    formats: str  # where its weights load from
    caches: str  # which KV caches (or state caches) serve it
    c_decode: str  # whether batch-1 / engine decode steps run in kernels/decode.c
    engine: str  # the continuous-batching engine (and server)
    evidence: str  # what its parity tests run on


_ALL_KV = "all KV caches"
_SLIDING_KV = "all KV caches; compressed refused (sliding layers), sinks only inside the model's window"

FAMILY_SUPPORT: tuple[FamilySupport, ...] = (
    FamilySupport("llama / mistral / qwen2", "GGUF, HF", _ALL_KV, "yes (int8 / q4 / 16bit weights)", "yes", "SmolLM2 (real), random tiny"),
    FamilySupport("smollm3 (Llama blocks, every 4th without RoPE)", "GGUF, HF", _ALL_KV, "yes (int8 / q4 / 16bit weights)", "yes",
                  "random tiny (transformers)"),
    FamilySupport("granite (Granite 3: Llama blocks with scaled embeddings, residuals, scores and logits)", "GGUF, HF", _ALL_KV,
                  "yes (int8 / q4 / 16bit weights)", "yes", "random tiny (transformers)"),
    FamilySupport("qwen3", "GGUF, HF", _ALL_KV, "yes (int8 / q4 / 16bit weights)", "yes", "random tiny (transformers)"),
    FamilySupport("mixtral / qwen2_moe / qwen3_moe / granitemoe / olmoe", "GGUF, HF", _ALL_KV,
                  "yes (int8 / q4 / 16bit weights; top-k routed experts, Qwen2-MoE's gated shared expert); LoRA on attention "
                  "and dense layers, not on experts",
                  "yes", "random tiny (transformers)"),
    FamilySupport("gpt_oss", "GGUF, HF (MXFP4 experts exact in 8-bit blocks)",
                  _SLIDING_KV, "yes (int8 / q4 / 16bit weights; sink logits, clamped SwiGLU experts); LoRA on attention only",
                  "yes",
                  "random tiny (transformers)"),
    FamilySupport("deepseek_v2 (V2-Lite, V2; V3 / R1, Moonlight: deepseek_v3)", "GGUF, HF", _ALL_KV + " (the cache holds the latent once: one KV head, its values the keys)",
                  "yes (int8 / q4 / 16bit weights; latent attention without a query latent, as V2-Lite's; V2's: torch path); "
                  "no LoRA", "yes",
                  "random tiny (transformers)"),
    FamilySupport("olmo2 (norms after each sublayer, QK-norm over all heads)", "GGUF, HF", _ALL_KV, "yes (int8 / q4 / 16bit weights)",
                  "yes", "random tiny (transformers)"),
    FamilySupport("phi3 (Phi-3, Phi-4-mini)", "GGUF, HF", _ALL_KV + "; no context shift under LongRoPE",
                  "yes (int8 / q4 / 16bit weights; partial RoPE too)", "yes", "random tiny (transformers)"),
    FamilySupport("gemma2", "GGUF, HF", _SLIDING_KV, "yes (int8 / q4 / 16bit weights; soft-capped attention)", "yes",
                  "random tiny (transformers)"),
    FamilySupport("gemma3", "GGUF, HF", _SLIDING_KV, "yes (int8 / q4 / 16bit weights)", "yes", "Gemma 3 270M (real)"),
    FamilySupport("mamba (Mamba, Falcon-Mamba)", "GGUF, HF", "SSMStateCache (fixed-size state, checkpoints); KV cache options refused",
                  "yes (int8 / q4 / 16bit weights; prefill scan in C)", "yes: one state per request, prefix cache of block-boundary states; "
                  "generate_batch, server; speculative decoding, engine included (exact; a verify is one C pass)", "random tiny (transformers)"),
    FamilySupport("mamba2 (Mamba-2, Mamba-Codestral)", "GGUF, HF",
                  "SSMStateCache (fixed-size state, checkpoints); KV cache options refused",
                  "yes (int8 / q4 / 16bit weights; prefill scan in C)", "yes: one state per request, prefix cache of "
                  "block-boundary states; generate_batch, server; speculative decoding, engine included (exact; a verify is one C pass)", "random tiny (transformers)"),
    FamilySupport("granitemoehybrid (Granite 4.0-H: Mamba-2 + attention layers; Bamba, HF only)", "GGUF (granitehybrid), HF",
                  "HybridStateCache (Mamba-2 states with checkpoints + contiguous K/V of the attention layers); "
                  "KV cache options refused", "yes (int8 / q4 / 16bit weights), a token's step one C call",
                  "yes: decode rows together in one C call a step, prompts one after another, one state + K/V per request; "
                  "prefix cache of block-boundary states with their blocks' keys; speculative decoding, engine included (exact; a verify is one C pass); LoRA on attention, dense MLPs and mixers",
                  "random tiny (transformers)"),
    FamilySupport("lfm2 (LFM2: gated short convolutions + attention layers; LFM2-MoE: a mixture after the first layers)", "GGUF (lfm2, lfm2moe), HF",
                  "HybridStateCache (conv windows with checkpoints + contiguous K/V of the attention layers); "
                  "KV cache options refused", "yes (int8 / q4 / 16bit weights), a token's step one C call",
                  "yes: decode rows together in one C call a step, prompts one after another, one state + K/V per request; "
                  "prefix cache of block-boundary states with their blocks' keys; speculative decoding, engine included (exact; a verify is one C pass); LoRA on attention, dense MLPs and mixers",
                  "random tiny (transformers)"),
    FamilySupport("nemotron_h (Nemotron-H, Nemotron Nano v2: Mamba-2, attention and ReLU² MLP layers; Nemotron 3 Nano: "
                  "mixtures of ReLU² experts)", "GGUF (nemotron_h, nemotron_h_moe), HF",
                  "HybridStateCache (Mamba-2 states with checkpoints + contiguous K/V of the attention layers); "
                  "KV cache options refused", "yes (int8 / q4 / 16bit weights), a token's step one C call",
                  "yes: decode rows together in one C call a step, prompts one after another, one state + K/V per request; "
                  "prefix cache of block-boundary states with their blocks' keys; speculative decoding, engine included (exact; a verify is one C pass); LoRA on attention, dense MLPs and mixers",
                  "random tiny (transformers)"),
    FamilySupport("falcon_h1 (Falcon-H1: attention and Mamba-2 side by side in every layer, µP multipliers folded at load)",
                  "GGUF (falcon-h1), HF",
                  "HybridStateCache (Mamba-2 states with checkpoints + contiguous K/V of every layer); KV cache options refused",
                  "yes (int8 / q4 / 16bit weights), a token's step one C call",
                  "yes: decode rows together in one C call a step, prompts one after another, one state + K/V per request; "
                  "prefix cache of block-boundary states with their blocks' keys; speculative decoding, engine included (exact; a verify is one C pass); LoRA on attention, MLPs and mixers (HF folders)",
                  "random tiny (transformers)"),
    FamilySupport("t5 (encoder-decoder)", "HF (fp32 weights)",
                  "EncoderCache (cross-attention K/V once per distinct input) + a contiguous decoder KV cache",
                  "no: torch path", "yes: rows run one after another, one encoder entry per distinct input; "
                  "generate_batch, /v1/completions, n > 1; no speculative decoding", "random tiny (transformers)"),
)  # fmt: skip


def family_table() -> str:
    """One line per family: name, formats, caches, C decode, engine."""
    lines = []
    for f in FAMILY_SUPPORT:
        lines.append(f"{f.name:26s} {f.formats:9s} caches: {f.caches}\n{'':36s} C decode: {f.c_decode}; engine: {f.engine}")
    return "\n".join(lines)
