"""Writes a random-weight GGUF of a family no real checkpoint of installs offline, for timing its C
path against llama.cpp and against kvgen's torch path: transformers builds the model (seeded) at a
scaled-down shape of the family's common size, and the file gets llama.cpp's names and metadata with
SmolLM2's tokenizer (tests/support/tiny_gguf.py). Its tokens mean nothing; its step reads and
computes what such a model's does.

    python benchmarks/random_gguf.py --family qwen3-moe     # prints the path
    python benchmarks/decode.py --model <that path> --weights q4 --peers llama.cpp --new-tokens 64 --name decode-random

Shapes (vocabulary 49,152; projections `--type`, Q4_0 by default; a tied embedding (the head) Q8_0;
the rest F32):
- qwen3-moe: a scaled-down Qwen3-30B-A3B: 12 layers, hidden 768, 12 query / 4 KV heads of 64, 32
  experts of width 384, 4 per token (normalised).
- qwen2-moe: a scaled-down Qwen1.5-MoE-A2.7B: 12 layers, hidden 768, 12 query / 12 KV heads of 64
  with QKV biases, 32 experts of width 384, 4 per token (not normalised), and a shared expert of
  width 1536 behind its sigmoid gate.
- deepseek-v2: a scaled-down DeepSeek-V2-Lite: 27 layers (llama.cpp tells V2-Lite, which has no
  query latent, by that count), hidden 768, 16 heads with latent
  attention at V2-Lite's own widths (a 512-wide latent, RoPE keys of 64, nope 128, values 128), the
  first layer dense (width 2048), then 32 experts of width 384, 6 per token, and 2 shared.
- deepseek-v3: a scaled-down Moonlight-16B-A3B (DeepSeek-V3's blocks and routing without a query
  latent): V2-Lite's attention widths as above, 27 layers, hidden 768, the first layer dense, then
  64 experts of width 384, 6 per token chosen by sigmoid score plus a random choice bias, weights
  renormalised x 2.446, and 2 shared.
- olmoe: a scaled-down OLMoE-1B-7B: 12 layers, hidden 768, 12 query / 12 KV heads of 64 with a
  QK-norm over all heads, 64 experts of width 384, 8 per token (not renormalised).
- gemma2: a scaled-down Gemma 2 2B: 12 layers, hidden 1152, 4 query / 2 KV heads of 256, GeGLU of
  width 4608, sliding (4,096) and global layers alternating, scores soft-capped at 50, logits at 30.
- gpt-oss: a scaled-down gpt-oss-20b: 12 layers, hidden 768, 12 query / 4 KV heads of 64 with sink
  logits, sliding (128) and full layers, 32 clamped-SwiGLU experts of width 768, 4 per token, as
  OpenAI ships them in MXFP4 (`--type` sets the other projections).
- mamba: Mamba-130M's own shape (llama.cpp's `mamba`): 24 layers, hidden 768, inner 1,536, state 16,
  conv 4, dt rank 48, a tied head; A_log, D and dt's bias keep transformers' initial values (the
  decays and step sizes a trained model has), the rest as above.
- mamba2: Mamba-2-130M's own shape (llama.cpp's `mamba2`): 24 layers, hidden 768, 24 heads of 64
  channels, state 128, one group, conv 4, a tied head; A_log, D and dt_bias as for mamba.
- granite-hybrid: a scaled-down Granite-4.0-H-Tiny (llama.cpp's `granitehybrid`): 20 layers, hidden
  768, Mamba-2 layers (24 heads of 64, state 128, one group) but for attention at layers 5 and 15
  (12 query / 4 KV heads of 64, no RoPE), in every layer 32 experts of width 256, 6 per token, beside
  a shared SwiGLU of width 512; Granite's scalars.
- lfm2: LFM2-350M's shape (llama.cpp's `lfm2`): 16 layers, hidden 1024, gated short convolutions
  of 3 taps but for attention at layers 2, 5, 8, 10, 12 and 14 (16 query / 8 KV heads of 64, per-head
  q/k norms, RoPE), a SwiGLU of width 4608 in every layer, a tied head.
- lfm2-moe: a scaled-down LFM2-8B-A1B (llama.cpp's `lfm2moe`): 12 layers, hidden 768, short
  convolutions but for attention at layers 2, 5, 8 and 10 (12 query / 4 KV heads of 64), a SwiGLU
  of width 2048 in the first two layers and after them 32 experts of width 512, 4 per token, chosen
  by sigmoid scores plus a bias; a tied head.
- nemotron-h: a scaled-down Nemotron-H-4B (llama.cpp's `nemotron_h`): 24 layers, hidden 768, one
  sublayer each in Nemotron-H's pattern M-M-M-M*-M-M-M-M*-M-M-M- (Mamba-2: 24 heads of 64, state 128,
  8 groups; two NoPE attention layers, 12 query / 4 KV heads of 64; ReLU² MLPs of width 3072).
- nemotron-h-moe: a scaled-down Nemotron 3 Nano 30B-A3B (`nemotron_h_moe`): 20 layers, hidden 768,
  pattern MEMEM*EMEMEM*EMEMEME (Mamba-2 as above; attention 12 query / 2 KV heads of 64; mixtures of
  64 ReLU² experts of width 384, 6 per token by sigmoid score plus a random choice bias, weights
  renormalised x 2.5, beside a shared ReLU² expert of width 768).
- falcon-h1: Falcon-H1-0.5B's shape (llama.cpp's `falcon-h1`): 36 layers, hidden 1024, each attention
  (8 query / 2 KV heads of 64, RoPE) beside Mamba-2 (24 heads of 64, state 128, one group, no gated
  norm), then a SwiGLU of width 2048; multipliers at 1 (a converted file holds them in its weights).
- phi4-mini: a scaled-down Phi-4-mini: 12 layers, hidden 1024, 8 query / 4 KV heads of 128, RoPE
  over 96 of each head's 128 channels (LongRoPE factors past 4,096 positions), SwiGLU of width 2816.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from peers.paths import peers_root  # noqa: E402

_COMMON = {"vocab_size": 49152, "num_hidden_layers": 12}
# family -> (transformers config class, its settings)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-moe": ("Qwen3MoeConfig", {
        "hidden_size": 768, "intermediate_size": 2048, "num_attention_heads": 12, "num_key_value_heads": 4,
        "head_dim": 64, "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 384,
        "norm_topk_prob": True, "tie_word_embeddings": False, "max_position_embeddings": 4096}),
    "qwen2-moe": ("Qwen2MoeConfig", {
        "hidden_size": 768, "intermediate_size": 2048, "num_attention_heads": 12, "num_key_value_heads": 12,
        "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 384, "shared_expert_intermediate_size": 1536,
        "norm_topk_prob": False, "tie_word_embeddings": False, "max_position_embeddings": 4096}),
    "deepseek-v2": ("DeepseekV2Config", {
        "num_hidden_layers": 27, "hidden_size": 768, "intermediate_size": 2048, "num_attention_heads": 16,
        "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "first_k_dense_replace": 1, "n_routed_experts": 32, "num_experts_per_tok": 6, "n_shared_experts": 2,
        "moe_intermediate_size": 384, "topk_method": "greedy", "tie_word_embeddings": False, "max_position_embeddings": 4096}),
    "deepseek-v3": ("DeepseekV3Config", {
        "num_hidden_layers": 27, "hidden_size": 768, "intermediate_size": 2048, "num_attention_heads": 16,
        "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "first_k_dense_replace": 1, "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2,
        "moe_intermediate_size": 384, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.446,
        "tie_word_embeddings": False, "max_position_embeddings": 4096}),
    "olmoe": ("OlmoeConfig", {
        "hidden_size": 768, "intermediate_size": 384, "num_attention_heads": 12, "num_key_value_heads": 12,
        "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False, "tie_word_embeddings": False,
        "max_position_embeddings": 4096, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}),
    "gemma2": ("Gemma2Config", {
        "hidden_size": 1152, "intermediate_size": 4608, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "max_position_embeddings": 8192}),
    "gpt-oss": ("GptOssConfig", {
        "hidden_size": 768, "intermediate_size": 768, "num_attention_heads": 12, "num_key_value_heads": 4,
        "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
        "tie_word_embeddings": False, "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}}),
    "phi4-mini": ("Phi3Config", {
        "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                            "original_max_position_embeddings": 4096,
                            "short_factor": [1.0] * 48, "long_factor": [1.0 + i / 8 for i in range(48)]}}),
    "mamba": ("MambaConfig", {
        "num_hidden_layers": 24, "hidden_size": 768, "state_size": 16, "expand": 2, "conv_kernel": 4,
        "tie_word_embeddings": True, "use_mambapy": False}),
    "mamba2": ("Mamba2Config", {
        "num_hidden_layers": 24, "hidden_size": 768, "num_heads": 24, "head_dim": 64, "state_size": 128, "n_groups": 1,
        "expand": 2, "conv_kernel": 4, "tie_word_embeddings": True}),
    "granite-hybrid": ("GraniteMoeHybridConfig", {
        "num_hidden_layers": 20, "hidden_size": 768, "intermediate_size": 256, "shared_intermediate_size": 512,
        "num_attention_heads": 12, "num_key_value_heads": 4, "num_local_experts": 32, "num_experts_per_tok": 6,
        "layer_types": ["attention" if i in (5, 15) else "mamba" for i in range(20)], "mamba_n_heads": 24, "mamba_d_head": 64,
        "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4, "position_embedding_type": "nope",
        "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 6.0, "attention_multiplier": 0.0078125,
        "tie_word_embeddings": True, "max_position_embeddings": 131072}),
    "lfm2": ("Lfm2Config", {
        "num_hidden_layers": 16, "hidden_size": 1024, "intermediate_size": 6656, "num_attention_heads": 16,
        "num_key_value_heads": 8, "layer_types": ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
        "conv_L_cache": 3, "conv_bias": False, "block_multiple_of": 256, "tie_word_embeddings": True,
        "max_position_embeddings": 128000}),
    "lfm2-moe": ("Lfm2MoeConfig", {
        "num_hidden_layers": 12, "hidden_size": 768, "intermediate_size": 2048, "moe_intermediate_size": 512,
        "num_dense_layers": 2, "num_experts": 32, "num_experts_per_tok": 4, "num_attention_heads": 12, "num_key_value_heads": 4,
        "layer_types": ["full_attention" if i in (2, 5, 8, 10) else "conv" for i in range(12)], "conv_L_cache": 3,
        "tie_word_embeddings": True, "max_position_embeddings": 128000}),
    "nemotron-h": ("NemotronHConfig", {
        "hidden_size": 768, "intermediate_size": 3072, "hybrid_override_pattern": "M-M-M-M*-M-M-M-M*-M-M-M-",
        "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64, "mamba_num_heads": 24, "mamba_head_dim": 64,
        "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4, "tie_word_embeddings": False, "max_position_embeddings": 8192}),
    "nemotron-h-moe": ("NemotronHConfig", {
        "hidden_size": 768, "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEME", "num_attention_heads": 12,
        "num_key_value_heads": 2, "head_dim": 64, "mamba_num_heads": 24, "mamba_head_dim": 64, "n_groups": 8,
        "ssm_state_size": 128, "conv_kernel": 4, "n_routed_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 384,
        "moe_shared_expert_intermediate_size": 768, "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1,
        "tie_word_embeddings": False, "max_position_embeddings": 8192}),
    "falcon-h1": ("FalconH1Config", {
        "num_hidden_layers": 36, "hidden_size": 1024, "intermediate_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 64, "mamba_d_ssm": 1536, "mamba_n_heads": 24, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 128,
        "mamba_d_conv": 4, "mamba_chunk_size": 128, "mamba_rms_norm": False, "tie_word_embeddings": False,
        "max_position_embeddings": 16384, "rope_parameters": {"rope_type": "default", "rope_theta": 1e11}}),
}  # fmt: skip
_KEEP_INIT = ("norm.weight", "A_log", "D", "dt_proj.bias", "dt_bias")  # Mamba's decays and steps: random ones would blow up its state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", required=True, choices=sorted(SHAPES))
    parser.add_argument("--type", default="Q4_0", choices=("Q4_0", "Q4_1", "Q5_0", "Q8_0"), help="the projections' type (gguf-py writes these)")
    args = parser.parse_args()
    import gguf
    import transformers

    from tests.support.models import model_path
    from tests.support.tiny_gguf import write_gguf_from_hf, write_granite_hybrid_gguf, write_lfm2_gguf, write_mamba_gguf, write_nemotron_h_gguf
    from tests.support.tiny_gguf import write_falcon_h1_gguf

    class_name, settings = SHAPES[args.family]
    common = {k: v for k, v in _COMMON.items() if class_name != "NemotronHConfig" or k != "num_hidden_layers"}  # its pattern counts them
    config = getattr(transformers, class_name)(**{**common, **settings})
    torch.manual_seed(0)
    model = getattr(transformers, class_name.replace("Config", "ForCausalLM"))(config).eval()
    with torch.no_grad():  # transformers' init is tiny (std 0.02); wider weights keep a router's choices spread
        for name, parameter in model.named_parameters():
            if not name.endswith(_KEEP_INIT):
                parameter.normal_(0, 0.05)
        for name, buffer in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # DeepSeek-V3's and LFM2-MoE's choice bias (zero at init)
                buffer.normal_(0, 0.05)
    out = peers_root() / f"random-{args.family}" / f"random-{args.family}-{args.type.lower()}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    # A tied head is the embedding: Q8_0, as in SmolLM2's file (an F32 one would be most of a step's bytes).
    embedding = gguf.GGMLQuantizationType.Q8_0 if config.tie_word_embeddings else gguf.GGMLQuantizationType.F32
    experts = gguf.GGMLQuantizationType.MXFP4 if args.family == "gpt-oss" else None
    if args.family == "granite-hybrid":
        print(write_granite_hybrid_gguf(out, model, model_path("smollm2"), gguf.GGMLQuantizationType[args.type], embedding_type=embedding))
        return
    if args.family in ("lfm2", "lfm2-moe"):
        print(write_lfm2_gguf(out, model, model_path("smollm2"), gguf.GGMLQuantizationType[args.type], embedding_type=embedding))
        return
    if args.family in ("nemotron-h", "nemotron-h-moe"):
        print(write_nemotron_h_gguf(out, model, model_path("smollm2"), gguf.GGMLQuantizationType[args.type], embedding_type=embedding))
        return
    if args.family == "falcon-h1":
        print(write_falcon_h1_gguf(out, model, model_path("smollm2"), gguf.GGMLQuantizationType[args.type], embedding_type=embedding))
        return
    if args.family in ("mamba", "mamba2"):
        print(write_mamba_gguf(out, model, model_path("smollm2"), gguf.GGMLQuantizationType[args.type], embedding_type=embedding))
        return
    write_gguf_from_hf(out, model, model_path("smollm2"), gguf.GGMLQuantizationType[args.type], embedding_type=embedding,
                       expert_type=experts)
    print(out)


if __name__ == "__main__":
    main()
