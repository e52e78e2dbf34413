"""Small random-weight models that transformers itself builds and saves as HF folders, for the
families no real weights exist for offline (Qwen3, Qwen2/3-MoE, Mixtral, DeepSeek, SmolLM3, Granite,
OLMo 2, OLMoE, Phi-3 / Phi-4-mini, Gemma 2, gpt-oss, Mamba, Mamba-2, T5)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from tests.support.models import model_path

_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64}
# name -> (config class, settings): each exercises what makes its family differ from Llama.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", {"head_dim": 32}),  # head_dim != hidden / heads, q/k norms
    # YaRN stretching a 64-position pretraining context 4x (Qwen3's long-context setting).
    "qwen3-yarn": ("Qwen3Config", {"head_dim": 32, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                   "factor": 4.0, "original_max_position_embeddings": 64}}),
    "gemma2": ("Gemma2Config", {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 8,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    # LongRoPE switching to the long factors past position 64 (beyond prompt + 48 tokens; the decode test crosses it).
    # Eight experts, two per token, the second layer dense (mlp_only_layers), renormalised top-2 weights.
    "qwen3-moe": ("Qwen3MoeConfig", {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # Qwen2-MoE: QKV biases, eight experts (two per token, weights not renormalised) and a shared
    # expert behind a sigmoid gate, the second layer dense.
    "qwen2-moe": ("Qwen2MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "shared_expert_intermediate_size": 96, "norm_topk_prob": False, "mlp_only_layers": [1]}),
    # gpt-oss: biased projections, sink logits, 4 clamped-SwiGLU experts (2 per token) behind a biased
    # router, sliding (window 8) and full layers, YaRN without truncation.
    "gpt-oss": ("GptOssConfig", {"head_dim": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                "swiglu_limit": 0.3,  # (7 in the released models) clamps many activations here
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}}),
    # DeepSeek-V2-Lite's shape, small: latent attention (a 64-wide latent, RoPE over 32 channels, no
    # query latent), the first layer dense, then 8 routed experts (2 per token, weights x 2.5) and a
    # shared one. The YaRN variant stretches 64 positions 4x with DeepSeek's mscales and a query latent.
    "deepseek-v2": ("DeepseekV2Config", {"num_key_value_heads": 4, "kv_lora_rank": 64, "q_lora_rank": None, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32,
                    "v_head_dim": 32, "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
                    "n_shared_experts": 1, "moe_intermediate_size": 32, "routed_scaling_factor": 2.5, "topk_method": "greedy"}),
    "deepseek-v2-yarn": ("DeepseekV2Config", {"num_key_value_heads": 4, "kv_lora_rank": 64, "q_lora_rank": 24, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32,
                         "v_head_dim": 32, "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
                         "n_shared_experts": 2, "moe_intermediate_size": 32, "topk_method": "greedy",
                         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                                             "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0,
                                             "original_max_position_embeddings": 64}}),
    # DeepSeek-V3's routing at Moonlight's shape (no query latent): sigmoid scores, a choice bias
    # (e_score_correction_bias, drawn at random), 16 experts in 4 groups of which the best 2 are
    # eligible, 3 per token, renormalised weights x 2.5.
    "deepseek-v3": ("DeepseekV3Config", {"num_key_value_heads": 4, "kv_lora_rank": 64, "q_lora_rank": None, "qk_nope_head_dim": 32,
                    "qk_rope_head_dim": 32, "v_head_dim": 32, "first_k_dense_replace": 1, "n_routed_experts": 16,
                    "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "norm_topk_prob": True, "n_shared_experts": 1,
                    "moe_intermediate_size": 32, "routed_scaling_factor": 2.5}),
    # SmolLM3: Llama blocks, the fourth without RoPE (NoPE), as in SmolLM3-3B (every 4th layer).
    "smollm3": ("SmolLM3Config", {"num_hidden_layers": 4, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}),
    # Granite 3: Llama blocks with scaled embeddings, residuals, scores and logits (values unlike 1
    # so that each shows; Granite 3.1 2B has 12, 0.22, 1/64 and 8).
    "granite": ("GraniteConfig", {"embedding_multiplier": 6.0, "residual_multiplier": 0.3, "attention_multiplier": 0.1,
                "logits_scaling": 4.0}),
    # Granite 3's mixtures (1B-A400M, 3B-A800M): the same scalars, 4 experts, 2 per token, renormalised.
    "granitemoe": ("GraniteMoeConfig", {"embedding_multiplier": 6.0, "residual_multiplier": 0.3, "attention_multiplier": 0.1,
                   "logits_scaling": 4.0, "num_local_experts": 4, "num_experts_per_tok": 2}),
    # OLMo 2: norms after each sublayer, QK-norm over all heads at once.
    "olmo2": ("Olmo2Config", {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}),
    # OLMoE: Llama blocks with a QK-norm over all heads (as many KV heads as query heads, as OLMoE-1B-7B
    # and llama.cpp have them), 8 experts, 2 per token, not renormalised.
    "olmoe": ("OlmoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "num_key_value_heads": 4, "pad_token_id": None, "bos_token_id": None,
              "eos_token_id": None}),
    "phi3": ("Phi3Config", {"max_position_embeddings": 256, "original_max_position_embeddings": 64,
             "rope_parameters": {**_LONGROPE, "short_factor": [1.0 + i / 8 for i in range(8)],
                                 "long_factor": [2.0 + i for i in range(8)]}}),
    # Phi-4-mini: RoPE over 3/4 of each head.
    "phi4-mini": ("Phi3Config", {"max_position_embeddings": 256, "original_max_position_embeddings": 64,
                  "rope_parameters": {**_LONGROPE, "partial_rotary_factor": 0.75,
                                      "short_factor": [1.0 + i / 8 for i in range(6)],
                                      "long_factor": [2.0 + i for i in range(6)]}}),
}  # fmt: skip


def tokenizer_folder(folder: Path) -> Path:
    """SmolLM2's tokenizer files (from its GGUF), saved by transformers into `folder`."""
    from transformers import AutoTokenizer

    path = model_path("smollm2")
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(folder)
    return folder


def save_tiny_decoder(name: str, folder: Path, tokenizer_files: Path, std: float = 0.2, vocab_size: int = 49152) -> Any:
    """Build, widen and save family `name`'s random model with the tokenizer files -> the HF model
    (`vocab_size`: more than SmolLM2's 49,152 for a tokenizer with added tokens)."""
    import transformers

    config_class, extra = FAMILIES[name]
    config = getattr(transformers, config_class)(**{
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "tie_word_embeddings": False, "max_position_embeddings": 256, "num_key_value_heads": 2, **extra,
    })  # fmt: skip
    torch.manual_seed(0)
    return _widen_and_save(transformers.AutoModelForCausalLM.from_config(config), folder, tokenizer_files, std)


def _widen_and_save(model: Any, folder: Path, tokenizer_files: Path, std: float, keep: tuple[str, ...] = ()) -> Any:
    """Redraw the weights N(0, std) (random init is tiny; wider weights make rounding differences
    show), except parameters whose names end with `keep`; save with the tokenizer files."""
    model.eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not name.endswith(keep):
                parameter.normal_(0, std)
        for name, buffer in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # DeepSeek-V3's and LFM2-MoE's start at zero
                buffer.normal_(0, 0.1)
    model.save_pretrained(folder)
    for file in tokenizer_files.iterdir():
        shutil.copy(file, folder / file.name)
    return model


def save_tiny_mamba(folder: Path, tokenizer_files: Path, std: float = 0.2, falcon: bool = False) -> Any:
    """transformers' MambaForCausalLM (FalconMambaForCausalLM when `falcon`: RMS-normed dt, B and C),
    random and widened like the decoders, saved with the tokenizer. The Falcon model's mixer epsilon
    is its layers' (llama.cpp norms dt, B and C with that one), so its GGUF is the same model."""
    import transformers

    kind = "FalconMamba" if falcon else "Mamba"
    extra = {"mixer_rms_eps": 1e-5} if falcon else {}
    config = getattr(transformers, f"{kind}Config")(vocab_size=49152, hidden_size=64, state_size=16, num_hidden_layers=2, conv_kernel=4,
                                                     expand=2, use_mambapy=False, layer_norm_epsilon=1e-5, **extra)  # fmt: skip
    torch.manual_seed(0)
    # A_log, dt_proj.bias and D keep their initial values: the decay and step sizes a real model has.
    model = getattr(transformers, f"{kind}ForCausalLM")(config)
    return _widen_and_save(model, folder, tokenizer_files, std, ("A_log", "dt_proj.bias", "D"))


def save_tiny_mamba2(folder: Path, tokenizer_files: Path, std: float = 0.2) -> Any:
    """transformers' Mamba2ForCausalLM (8 heads of 16 channels in 2 groups, chunks of 16 positions so
    that prompts span several), random and widened, saved with the tokenizer files."""
    import transformers

    config = transformers.Mamba2Config(vocab_size=49152, hidden_size=64, num_heads=8, head_dim=16, n_groups=2, state_size=16,
                                       num_hidden_layers=4, conv_kernel=4, expand=2, chunk_size=16)  # fmt: skip
    torch.manual_seed(0)
    # A_log, dt_bias and D keep their initial values: the decays and step sizes a real model has.
    return _widen_and_save(transformers.Mamba2ForCausalLM(config), folder, tokenizer_files, std, ("A_log", "dt_bias", "D"))


def save_tiny_granite_hybrid(folder: Path, tokenizer_files: Path, experts: int = 4, rope: bool = False, std: float = 0.2) -> Any:
    """transformers' GraniteMoeHybridForCausalLM (Granite 4.0-H): Mamba-2 layers (8 heads of 16
    channels in 2 groups, chunks of 16) around an attention layer, a mixture of `experts` beside the
    shared MLP (0: the shared MLP alone, as Granite-4.0-H-Micro), Granite's four scalars away from
    1; NoPE attention unless `rope`. Random and widened, saved with the tokenizer files."""
    import transformers

    config = transformers.GraniteMoeHybridConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=32 if experts else 64, shared_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention", "mamba", "mamba"],
        mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=16, mamba_d_conv=4,
        num_local_experts=experts, num_experts_per_tok=2, position_embedding_type="rope" if rope else "nope",
        embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=2.0, attention_multiplier=0.1,
        max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GraniteMoeHybridForCausalLM(config)
    return _widen_and_save(model, folder, tokenizer_files, std, ("A_log", "dt_bias", "D"))


def save_tiny_bamba(folder: Path, tokenizer_files: Path, std: float = 0.2) -> Any:
    """transformers' BambaForCausalLM: Mamba-2 layers (8 heads of 16 channels in 2 groups, chunks of
    16) around an attention layer turned by RoPE over half of each head, a SwiGLU after every layer.
    Random and widened, saved with the tokenizer files."""
    import transformers

    config = transformers.BambaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=16, mamba_chunk_size=16, mamba_d_conv=4, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BambaForCausalLM(config)
    return _widen_and_save(model, folder, tokenizer_files, std, ("A_log", "dt_bias", "D"))


def save_tiny_lfm2(folder: Path, tokenizer_files: Path, std: float = 0.2, conv_bias: bool = True) -> Any:
    """transformers' Lfm2ForCausalLM (Liquid's LFM2): gated short-conv layers (3 taps; biased unless
    `conv_bias` is False, as Liquid's models and llama.cpp's reader are) around two attention layers
    with per-head q/k norms and RoPE, a SwiGLU after every layer, the head tied to the embedding.
    Random and widened, saved with the tokenizer files."""
    import transformers

    config = transformers.Lfm2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "conv", "full_attention"], conv_L_cache=3,
        conv_bias=conv_bias, block_multiple_of=16, max_position_embeddings=1024, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    return _widen_and_save(transformers.Lfm2ForCausalLM(config), folder, tokenizer_files, std)


def save_tiny_lfm2_moe(folder: Path, tokenizer_files: Path, std: float = 0.2, scale: float = 1.5) -> Any:
    """transformers' Lfm2MoeForCausalLM (LFM2-8B-A1B's kind): LFM2's layers, the first two with a
    dense SwiGLU and the rest a mixture of 4 experts (2 a token) chosen by sigmoid scores plus a
    bias, renormalised and scaled by `scale` (away from Liquid's 1 so that it shows). Random and
    widened, saved with the tokenizer files."""
    import transformers

    config = transformers.Lfm2MoeConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
        num_dense_layers=2, num_experts=4, num_experts_per_tok=2, routed_scaling_factor=scale, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "conv", "full_attention"], conv_L_cache=3,
        max_position_embeddings=512, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    return _widen_and_save(transformers.Lfm2MoeForCausalLM(config), folder, tokenizer_files, std)


def save_tiny_nemotron_h(folder: Path, tokenizer_files: Path, experts: int = 0, std: float = 0.2, scale: float = 1.5) -> Any:
    """transformers' NemotronHForCausalLM (NVIDIA's Nemotron-H): one sublayer a layer, Mamba-2 (8
    heads of 16 channels in 2 groups, chunks of 16), NoPE attention and ReLU² MLPs in the pattern
    M-M*-M-; with `experts`, Nemotron 3 Nano's kind: the MLP layers are mixtures of that many ReLU²
    experts (2 a token, sigmoid scores plus a choice bias, renormalised and scaled by `scale`) with
    a shared expert. Random and widened, saved with the tokenizer files."""
    import transformers

    pattern = "M-M*-M-".replace("-", "E" if experts else "-")
    config = transformers.NemotronHConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=96, hybrid_override_pattern=pattern, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
        chunk_size=16, conv_kernel=4, n_routed_experts=max(experts, 1), num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=64, routed_scaling_factor=scale, n_group=1, topk_group=1,
        max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(config)
    return _widen_and_save(model, folder, tokenizer_files, std, ("A_log", "dt_bias", "D"))


def save_tiny_falcon_h1(folder: Path, tokenizer_files: Path, std: float = 0.2, rms_norm: bool = False) -> Any:
    """transformers' FalconH1ForCausalLM (TII's Falcon-H1): 3 layers, each attention (4 query / 2 KV
    heads of 16, RoPE) and Mamba-2 (8 heads of 16 channels in 2 groups, chunks of 16; its gated norm
    only where `rms_norm`) side by side, then a SwiGLU; every µP multiplier away from 1 so that each
    folding shows. Random and widened, saved with the tokenizer files."""
    import transformers

    config = transformers.FalconH1Config(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16, mamba_rms_norm=rms_norm, mamba_norm_before_gate=False,
        max_position_embeddings=1024, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        embedding_multiplier=1.7, lm_head_multiplier=0.6, attention_in_multiplier=0.8, attention_out_multiplier=1.3,
        key_multiplier=0.7, ssm_in_multiplier=1.2, ssm_out_multiplier=0.9, ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05],
        mlp_multipliers=[0.85, 1.15],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.FalconH1ForCausalLM(config)
    return _widen_and_save(model, folder, tokenizer_files, std, ("A_log", "dt_bias", "D"))


def save_tiny_t5(folder: Path, tokenizer_files: Path, gated: bool = True, std: float = 0.2) -> Any:
    """transformers' T5ForConditionalGeneration (Flan-T5's gated-gelu without the output rescale when
    `gated`, else T5 v1.0's relu with the d_model**-0.5 rescale before the tied head), random and
    widened, saved with the tokenizer files."""
    import transformers

    config = transformers.T5Config(
        vocab_size=49152, d_model=64, d_kv=16, d_ff=128, num_layers=3, num_decoder_layers=3, num_heads=4,
        feed_forward_proj="gated-gelu" if gated else "relu",
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return _widen_and_save(transformers.T5ForConditionalGeneration(config), folder, tokenizer_files, std)


HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
# A chat template of kvgen's tests in OpenAI's harmony format (gpt-oss): system and developer
# messages, the tools as a TypeScript-like namespace, past tool calls and results, the reasoning
# effort, and the generation prompt `<|start|>assistant`. Shorter than gpt-oss's own; the same format.
HARMONY_TEMPLATE = """<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}
# Valid channels: analysis, commentary, final.<|end|>
{%- set rest = messages[1:] if messages[0].role in ('system', 'developer') else messages -%}
{%- if messages[0].role in ('system', 'developer') or tools -%}
<|start|>developer<|message|>
{%- if messages[0].role in ('system', 'developer') %}# Instructions\n\n{{ messages[0].content }}\n\n{% endif -%}
{%- if tools %}# Tools\n\nnamespace functions {\n{% for tool in tools %}type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;\n{% endfor %}}{% endif -%}
<|end|>
{%- endif -%}
{%- for message in rest -%}
{%- if message.role == 'assistant' and message.tool_calls -%}
{%- if message.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>{% endif -%}
<|start|>assistant to=functions.{{ message.tool_calls[0].function.name }}<|channel|>commentary json<|message|>{{ message.tool_calls[0].function.arguments | tojson }}<|call|>
{%- elif message.role == 'assistant' -%}
<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>
{%- elif message.role == 'tool' -%}
<|start|>functions.{{ message.name or 'tool' }} to=assistant<|channel|>commentary<|message|>{{ message.content }}<|end|>
{%- else -%}
<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|start|>assistant{% endif -%}"""


def harmony_tokenizer_folder(folder: Path) -> Path:
    """SmolLM2's tokenizer with harmony's special tokens added (ids 49152 on) and HARMONY_TEMPLATE."""
    from transformers import AutoTokenizer

    path = model_path("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.add_special_tokens({"additional_special_tokens": list(HARMONY_TOKENS)})
    tokenizer.eos_token = "<|return|>"
    tokenizer.chat_template = HARMONY_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder
