"""GGUF files (llama.cpp / ollama): metadata -> ModelConfig, tensors -> dequantized torch weights.

Dequantization uses gguf-py (`gguf.quants.dequantize`), the reference implementation maintained with
llama.cpp. Weights are renamed to Hugging Face names and put back in HF layout (llama.cpp permutes
Llama's Q/K rows for its interleaved RoPE and stores Gemma norms as 1 + w).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from kvgen.config import (HybridConfig, ModelConfig, RopeScaling, alternating_layer_types, every_nth_layer, gemma3_layer_types, granite_scalars,
                          yarn_mscale)  # fmt: skip
from kvgen.errors import ModelLoadError, UnsupportedModelError
from kvgen.loading.checkpoint import Checkpoint, check_finite
from kvgen.loading.deepseek import deepseek_config_from_gguf, rope_rows_order
from kvgen.kernels.formats import EXACT_SOURCES, QK, QuantizedWeight
from kvgen.loading.gguf_file import GGUFFile, TensorInfo
from kvgen.loading.granite_hybrid import granite_hybrid_config_from_gguf, granite_hybrid_mamba_name
from kvgen.loading.falcon_h1 import falcon_h1_config_from_gguf
from kvgen.loading.lfm2 import lfm2_config_from_gguf, lfm2_gguf_name
from kvgen.loading.nemotron_h import name_mlp_layer_norms, nemotron_h_config_from_gguf
from kvgen.loading.ssm_gguf import SSM_ARCHITECTURES, mamba2_config_from_gguf, mamba_config_from_gguf, mamba_hf_name
from kvgen.loading.weight_format import (EMBEDDING_NAMES, WeightMode, is_matmul_weight, quantizable, quantize_gguf_rows, quantizes,
                                         resolve_mode)
from kvgen.loading.tokenizer import Tokenizer
from kvgen.models.embedding import QuantizedRows
from kvgen.models.half_linear import HalfWeight

GGUF_ARCHITECTURES = ("llama", "smollm3", "granite", "granitemoe", "olmo2", "olmoe", "qwen2", "qwen2moe", "qwen3", "qwen3moe",
                      "phi3", "gemma2", "gemma3", "gpt-oss", "deepseek2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h",
                      "nemotron_h_moe", "falcon-h1", *SSM_ARCHITECTURES)
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
    "MXFP4",
)  # fmt: skip

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",  # a mixture's router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # Qwen2-MoE's shared expert and its gate
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma's sandwich norms: llama.cpp's ffn_norm is the *pre*-feed-forward norm there.
_GEMMA_LAYER_NAMES = _LAYER_NAMES | {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 keeps QKV fused, and gate/up fused under llama.cpp's ffn_up (no ffn_gate).
_PHI3_LAYER_NAMES = _LAYER_NAMES | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# DeepSeek-V2's latent attention; attn_k_b / attn_v_b (kv_b split, k_b transposed: [heads, rank,
# nope] and [heads, v, rank]) load as float tensors, not projections.
_DEEPSEEK_LAYER_NAMES = _LAYER_NAMES | {
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj", "attn_k_b": "self_attn.k_b", "attn_v_b": "self_attn.v_b",
}  # fmt: skip
# Granite's multipliers under llama.cpp's keys ({arch}.embedding_scale...), in granite_scalars' order.
_GRANITE_KEYS = ("embedding_scale", "residual_scale", "logit_scale", "attention.scale")
# OLMo 2: norms after each sublayer only (no attn_norm / ffn_norm).
_OLMO2_LAYER_NAMES = _LAYER_NAMES | {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# gpt-oss: a post-attention norm where Llama has ffn_norm, and a sink logit per query head.
_GPT_OSS_LAYER_NAMES = _LAYER_NAMES | {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"}
_GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
_ROPE_FACTOR_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")
FLOAT_TYPES = ("F32", "F16", "BF16")
HALF_TYPES = ("F16", "BF16")
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_PATTERN = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# A mixture's experts: stacked [E, rows, columns] per layer (ffn_gate_exps), or one tensor each in
# older Mixtral files (ffn_gate.3).
_STACKED_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.(weight|bias)$")
_FALCON_H1_FFN_NORM = re.compile(r"^blk\.(\d+)\.ffn_norm$")
_ONE_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")


def config_from_gguf(
    metadata: dict[str, Any], tensor_names: set[str], rope_factors: dict[str, np.ndarray] | None = None
) -> ModelConfig:
    """`rope_factors`: Phi-3's LongRoPE factor tensors (rope_factors_short / _long), when the file has them."""
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; kvgen runs {', '.join(GGUF_ARCHITECTURES)} "
            "(Llama, SmolLM2/3, Granite, Granite-MoE, OLMo 2, OLMoE, Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, DeepSeek-V2/V3, Phi-3, Gemma 2, Gemma 3, gpt-oss, "
            "Mamba, Falcon-Mamba, Mamba-2, Granite 4.0-H, LFM2, LFM2-MoE, Nemotron-H, Falcon-H1)"
        )

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks '{arch}.{key}': the file is incomplete; convert it again")
        return value

    if arch == "mamba":
        return mamba_config_from_gguf(metadata, tensor_names, get)  # type: ignore[return-value]
    if arch == "mamba2":
        return mamba2_config_from_gguf(metadata, tensor_names, get)  # type: ignore[return-value]
    if arch == "granitehybrid":
        return granite_hybrid_config_from_gguf(metadata, tensor_names, get, config_from_gguf)  # type: ignore[return-value]
    if arch in ("lfm2", "lfm2moe"):
        return lfm2_config_from_gguf(metadata, tensor_names, get, config_from_gguf)  # type: ignore[return-value]
    if arch in ("nemotron_h", "nemotron_h_moe"):
        return nemotron_h_config_from_gguf(metadata, tensor_names, get, config_from_gguf)  # type: ignore[return-value]
    if arch == "falcon-h1":
        return falcon_h1_config_from_gguf(metadata, tensor_names, get, config_from_gguf)  # type: ignore[return-value]
    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    num_layers = int(get("block_count"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // num_heads))
    vocab = int(metadata.get(f"{arch}.vocab_size", len(metadata.get("tokenizer.ggml.tokens", []))))
    experts = int(metadata.get(f"{arch}.expert_count", 0))
    # Mixtral's experts are feed_forward_length wide; Qwen3-MoE gives theirs apart
    expert_width = int(metadata.get(f"{arch}.expert_feed_forward_length") or get("feed_forward_length")) if experts else 0
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(metadata.get(f"{arch}.feed_forward_length") or expert_width or get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_scaling=_rope_scaling(metadata, arch) if arch != "deepseek2" else None,  # DeepSeek's YaRN: its own
    )
    if arch in _GEMMA_ARCHITECTURES:
        # llama.cpp: the 27B models (Gemma 2: 46 layers, Gemma 3: 62) scale queries by hidden/heads.
        scalar = hidden / num_heads if num_layers == (62 if arch == "gemma3" else 46) else head_dim
        gemma2 = arch == "gemma2"
        return ModelConfig(
            architecture=arch,
            hidden_act="gelu_tanh",
            sliding_window=int(get("attention.sliding_window")),
            layer_types=alternating_layer_types(num_layers) if gemma2 else gemma3_layer_types(num_layers),
            rope_local_theta=None if gemma2 else 10000.0,
            query_pre_attn_scalar=scalar,
            attn_logit_softcapping=metadata.get(f"{arch}.attn_logit_softcapping") if gemma2 else None,
            final_logit_softcapping=metadata.get(f"{arch}.final_logit_softcapping") if gemma2 else None,
            **common,
        )
    if arch == "gpt-oss":
        return _gpt_oss_from_gguf(metadata, arch, common, expert_width, get)
    if arch == "deepseek2":
        return deepseek_config_from_gguf(metadata, get, common)
    window = metadata.get(f"{arch}.attention.sliding_window")
    rotary = metadata.get(f"{arch}.rope.dimension_count")
    if experts:  # Mixtral is llama.cpp's llama with experts
        common.update(
            num_experts=experts, experts_per_token=int(get("expert_used_count")), expert_intermediate_size=expert_width,
            # llama.cpp renormalises the chosen experts' weights, except Qwen2-MoE's and OLMoE's
            normalize_expert_weights=bool(metadata.get(f"{arch}.expert_weights_norm", arch not in ("qwen2moe", "olmoe"))),
            moe_layers=tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names),
            shared_expert_intermediate_size=int(metadata.get(f"{arch}.expert_shared_feed_forward_length", 0)),
        )  # fmt: skip
    name = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "llama": "mixtral" if experts else "llama", "smollm3": "llama",
            "granite": "llama", "granitemoe": "mixtral"}.get(arch, arch)  # fmt: skip
    if rope_factors and arch == "phi3":
        common["rope_scaling"] = _longrope_from_gguf(metadata, arch, rope_factors, common["max_position_embeddings"])
    return ModelConfig(
        architecture=name,
        attention_bias="blk.0.attn_q.bias" in tensor_names or "blk.0.attn_qkv.bias" in tensor_names,
        sliding_window=int(window) if window else None,
        layer_types=("sliding",) * num_layers if window and arch == "phi3" else (),
        rotary_dim=int(rotary) if rotary and int(rotary) != head_dim else None,
        # SmolLM3: llama.cpp turns no channel in every 4th layer (a fixed step; the file names none)
        nope_layers=every_nth_layer(num_layers, 4) if arch == "smollm3" else (),
        **(granite_scalars(*(metadata.get(f"{arch}.{key}", 1.0) for key in _GRANITE_KEYS))
           if arch in ("granite", "granitemoe") else {}),  # fmt: skip
        **common,
    )


def _longrope_from_gguf(metadata: dict[str, Any], arch: str, factors: dict[str, np.ndarray], max_positions: int) -> RopeScaling:
    """llama.cpp's Phi-3 conversion: factors as tensors, the pretraining context and attention factor as metadata."""
    if set(factors) != set(_ROPE_FACTOR_TENSORS):
        raise ModelLoadError(f"the GGUF has {sorted(factors)} but LongRoPE needs both {_ROPE_FACTOR_TENSORS}; convert it again")
    original = int(metadata.get(f"{arch}.rope.scaling.original_context_length", max_positions))
    factor = max_positions / original
    default = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        kind="longrope", factor=factor, original_max_position=original,
        attention_factor=float(metadata.get(f"{arch}.rope.scaling.attn_factor", default)),
        short_factor=tuple(float(f) for f in factors["rope_factors_short.weight"]),
        long_factor=tuple(float(f) for f in factors["rope_factors_long.weight"]),
    )  # fmt: skip


def _rope_scaling(metadata: dict[str, Any], arch: str) -> RopeScaling | None:
    kind = metadata.get(f"{arch}.rope.scaling.type")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or not factor or float(factor) == 1.0:
        return None
    if kind == "yarn":
        return _yarn_from_gguf(metadata, arch, float(factor))
    if kind != "linear":
        raise UnsupportedModelError(f"RoPE scaling {kind!r} is not supported yet (kvgen has linear, llama3 and yarn)")
    return RopeScaling(kind="linear", factor=float(factor))


def _yarn_from_gguf(metadata: dict[str, Any], arch: str, factor: float) -> RopeScaling:
    """llama.cpp's YaRN keys, read as transformers reads the config they were converted from:
    yarn_attn_factor (the config's attention_factor) when the file has it, else 0.1 ln(factor) + 1."""
    key = f"{arch}.rope.scaling."
    original = metadata.get(key + "original_context_length")
    if not original:
        raise ModelLoadError(f"the GGUF uses YaRN but lacks '{key}original_context_length'; convert it again")
    if float(metadata.get(key + "yarn_log_multiplier", 0.0)) != 0.0 or float(metadata.get(key + "yarn_ext_factor", 1.0)) != 1.0:
        raise UnsupportedModelError("this GGUF's YaRN sets yarn_log_multiplier or yarn_ext_factor, which kvgen does not "
                                    "implement (it runs YaRN as Qwen2/Qwen3 configure it)")  # fmt: skip
    return RopeScaling(
        kind="yarn", factor=factor, original_max_position=int(original),
        attention_factor=float(metadata.get(key + "yarn_attn_factor", yarn_mscale(factor))),
        beta_fast=float(metadata.get(key + "yarn_beta_fast", 32.0)), beta_slow=float(metadata.get(key + "yarn_beta_slow", 1.0)),
    )  # fmt: skip


def _gpt_oss_from_gguf(metadata: dict[str, Any], arch: str, common: dict[str, Any], expert_width: int, get: Any) -> ModelConfig:
    """llama.cpp's gpt-oss: even layers slide, every layer a mixture behind a biased router; the
    clamp of its SwiGLU is 7 unless the file says otherwise (swiglu_clamp_exp, one per layer)."""
    num_layers = common["num_layers"]
    limits = {float(v) for v in metadata.get(f"{arch}.swiglu_clamp_exp", [7.0])}
    if len(limits) != 1:
        raise UnsupportedModelError(f"this GGUF clamps its layers' SwiGLU differently ({sorted(limits)}); kvgen runs one limit")
    rope = common.pop("rope_scaling")  # gpt-oss's YaRN ramp is not truncated (its config's truncate: false)
    return ModelConfig(
        architecture="gpt_oss", attention_bias=True, attention_sinks=True, hidden_act="swiglu_oai",
        swiglu_limit=limits.pop(), sliding_window=int(get("attention.sliding_window")),
        layer_types=alternating_layer_types(num_layers), num_experts=int(get("expert_count")),
        experts_per_token=int(get("expert_used_count")), expert_intermediate_size=expert_width,
        normalize_expert_weights=True, moe_layers=tuple(range(num_layers)),
        rope_scaling=dataclasses.replace(rope, truncate=False) if rope is not None else None, **common,
    )  # fmt: skip


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The Hugging Face parameter name for a GGUF tensor name (None: not a model weight kvgen uses)."""
    if arch in SSM_ARCHITECTURES:
        return mamba_hf_name(gguf_name, arch)
    if arch in ("granitemoehybrid", "nemotron_h", "falcon_h1") and (mamba := granite_hybrid_mamba_name(gguf_name)) is not None:
        return mamba
    if arch == "lfm2" and (conv := lfm2_gguf_name(gguf_name)) is not None:
        return conv
    if arch == "falcon_h1" and (norm := _FALCON_H1_FFN_NORM.match(gguf_name)):  # the converter's name, with no .weight
        return f"model.layers.{norm.group(1)}.post_attention_layernorm.weight"
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    if expert := _ONE_EXPERT.match(gguf_name):
        layer, part, e = expert.groups()
        return f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight"
    match = _LAYER_PATTERN.match(gguf_name)
    if not match:
        return None
    layer, part, suffix = match.groups()
    if arch == "gpt_oss" and part == "attn_sinks":
        return f"model.layers.{layer}.self_attn.sinks"  # a parameter of its own, no .weight
    names = (_GEMMA_LAYER_NAMES if arch in _GEMMA_ARCHITECTURES else _PHI3_LAYER_NAMES if arch == "phi3"
             else _GPT_OSS_LAYER_NAMES if arch == "gpt_oss" else _DEEPSEEK_LAYER_NAMES if arch == "deepseek_v2"
             else _OLMO2_LAYER_NAMES if arch == "olmo2" else _LAYER_NAMES)  # fmt: skip
    if arch == "deepseek_v2" and part in ("attn_k_b", "attn_v_b"):
        return f"model.layers.{layer}.{names[part]}"  # a float tensor of its own, no .weight
    if arch in ("deepseek_v2", "nemotron_h") and part == "exp_probs_b":  # DeepSeek-V3's (Nemotron 3 Nano's) expert choice bias
        return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    return f"model.layers.{layer}.{names[part]}.{suffix}" if part in names else None


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF's rotate-half halves)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def load_gguf(
    path: Path, dtype: torch.dtype = torch.float32, progress: bool = True, weights: WeightMode = "fp32"
) -> Checkpoint:
    file = GGUFFile(path)
    factors = {n: _dequantized_raw(file, file.tensors[n]) for n in _ROPE_FACTOR_TENSORS if n in file.tensors}
    config = config_from_gguf(file.metadata, set(file.tensors), factors)
    # Built first, so that a file without a usable vocabulary fails before its tensors are read. (A
    # thread building it beside the tensors saved ~0.1 s of Gemma 3's load and raised its peak by
    # ~57 MB: the merges are pure Python and held the GIL the tensors' loop needed.)
    tokenizer = Tokenizer.from_gguf_metadata(file.metadata, config.architecture)
    tensors, mode = _load_tensors(file, config, dtype, progress, weights)
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer, path=path, format="gguf", weights=mode)


def _load_tensors(
    file: GGUFFile, config: ModelConfig, dtype: torch.dtype, progress: bool, weights: WeightMode
) -> tuple[dict[str, torch.Tensor | QuantizedWeight | HalfWeight], WeightMode]:
    """The file's tensors under HF names, quantized for the kernels as `weights` asks, and that mode."""
    unsupported = {n: t.type_name for n, t in file.tensors.items() if t.type_name not in SUPPORTED_TENSOR_TYPES}
    if unsupported:
        name, qtype = next(iter(unsupported.items()))
        raise UnsupportedModelError(
            f"tensor {name!r} (and {len(unsupported) - 1} more) uses quantization {qtype}, which kvgen cannot "
            f"load; supported: {', '.join(SUPPORTED_TENSOR_TYPES)} (re-quantize with llama-quantize, e.g. to Q4_K_M)"
        )
    is_quantized = any(t.type_name not in FLOAT_TYPES for t in file.tensors.values())
    half_weights = dtype == torch.float32 and any(_keeps_half(info, config) for info in file.tensors.values())
    mode = resolve_mode(weights, is_quantized, half_weights)
    quantized = quantizes(mode)

    tensors: dict[str, torch.Tensor | QuantizedWeight | HalfWeight] = {}
    infos = list(file.tensors.values())
    for info in tqdm(infos, desc=f"loading {file.path.name}", unit="tensor", disable=not progress, leave=False):
        if stacked := _STACKED_EXPERTS.match(info.name):  # [E, rows, columns]: one weight (or bias) per expert
            layer, part, kind = stacked.groups()
            for e in range(info.shape[0]):
                target = f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.{kind}"
                if quantized and kind == "weight" and quantizable(info.shape[1:]):
                    tensors[target] = _quantized_tensor(file, info, config, mode, e)
                elif mode == "16bit" and kind == "weight" and _keeps_half(info, config):
                    tensors[target] = _half_tensor(file, info, config, e)
                else:
                    tensors[target] = _float_tensor(file, info, config, dtype, e)
                check_finite(f"{info.name}[{e}]", tensors[target], file.path)
            continue
        name = "rope_freqs" if info.name == "rope_freqs.weight" else hf_name(info.name, config.architecture)
        if name is None:
            continue
        # A tied model's output projection is the embedding matrix: quantized (or kept 16-bit) for the
        # head; lookups read the file's rows (models/embedding.py), or a float table where the weights
        # load as fp32.
        head_from_embedding = mode != "fp32" and name in EMBEDDING_NAMES and "output.weight" not in file.tensors
        for target in [name] + (["lm_head.weight"] if head_from_embedding else []):
            if mode != "fp32" and target in EMBEDDING_NAMES and info.type_name != "F32":
                # Looked up row by row as the file has them (F16 and BF16 rows too: half an fp32
                # table); a tied head made from the same rows is checked for corruption below, so
                # only an untied table is scanned here.
                tensors[target] = _embedding_rows(file, info, config, dtype)
                if not head_from_embedding and not tensors[target].all_finite():
                    raise ModelLoadError(f"tensor {info.name!r} in {file.path} has NaN or infinite block scales: the file "
                                         "is corrupted; download or convert it again")  # fmt: skip
                continue
            if quantized and is_matmul_weight(target) and quantizable(info.shape):
                tensors[target] = _quantized_tensor(file, info, config, mode)
            elif quantized and target.endswith(("self_attn.k_b", "self_attn.v_b")) and info.shape[-1] % QK == 0:
                tensors[target] = _quantized_rows(file, info, mode)  # DeepSeek's [H, rows, columns] as H * rows rows
            elif mode == "16bit" and _keeps_half(info, config, target):
                tensors[target] = _half_tensor(file, info, config)
            else:
                tensors[target] = _float_tensor(file, info, config, dtype)
            check_finite(info.name, tensors[target], file.path)
    if config.architecture == "nemotron_h":
        name_mlp_layer_norms(tensors, config)  # type: ignore[arg-type]
    return tensors, mode


def _keeps_half(info: TensorInfo, config: ModelConfig, target: str | None = None) -> bool:
    """Whether a tensor is a matmul weight the 16bit mode keeps as the file's F16 / BF16 values
    (`target`: its HF name, a tied embedding's "lm_head.weight" included)."""
    if info.type_name not in HALF_TYPES:
        return False
    if _STACKED_EXPERTS.match(info.name):
        return quantizable(tuple(info.shape[1:]))
    if target is None:
        target = hf_name(info.name, config.architecture)
    return target is not None and is_matmul_weight(target) and quantizable(tuple(info.shape))


def _half_tensor(file: GGUFFile, info: TensorInfo, config: ModelConfig, expert: int | None = None) -> HalfWeight:
    """An F16 / BF16 matmul weight as float16 / bfloat16 values in HF layout, as the file has them."""
    raw = _to_hf_layout(_raw(file, info, expert), info.name, config)
    halves = torch.from_numpy(np.array(raw, copy=True).view(np.uint16 if info.type_name == "BF16" else np.float16))
    return HalfWeight(halves.view(torch.bfloat16) if info.type_name == "BF16" else halves)


def _raw(file: GGUFFile, info: TensorInfo, expert: int | None = None) -> np.ndarray:
    """The tensor's byte rows, or one expert's of a stacked [E, rows, columns] tensor."""
    return file.raw(info) if expert is None else file.raw(info)[expert]


def _dequantized_raw(file: GGUFFile, info: TensorInfo, expert: int | None = None) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(_raw(file, info, expert), gguf.GGMLQuantizationType(info.type_id))


def _dequantized(file: GGUFFile, info: TensorInfo, config: ModelConfig, expert: int | None = None) -> np.ndarray:
    """float32 values in HF layout (gguf-py's dequantization)."""
    return _to_hf_layout(_dequantized_raw(file, info, expert), info.name, config)


def _float_tensor(file: GGUFFile, info: TensorInfo, config: ModelConfig, dtype: torch.dtype, expert: int | None = None) -> torch.Tensor:
    array = _dequantized(file, info, config, expert)
    # F32 tensors come back as views of the read-only file map: copy so the weights own their memory.
    array = np.array(array, dtype=np.float32, order="C", copy=not array.flags.writeable)
    return torch.from_numpy(array).to(dtype)


def _embedding_rows(file: GGUFFile, info: TensorInfo, config: ModelConfig, dtype: torch.dtype) -> QuantizedRows:
    # A view of the file: the model copies the rows it keeps (QuantizedRows.owned) or reads a tied
    # head's instead, so the file's mapping goes once the load is done.
    return QuantizedRows(_to_hf_layout(_raw(file, info), info.name, config), info.type_id, int(info.shape[-1]), dtype)


def _quantized_tensor(file: GGUFFile, info: TensorInfo, config: ModelConfig, mode: str, expert: int | None = None) -> QuantizedWeight:
    raw = _to_hf_layout(_raw(file, info, expert), info.name, config)  # Q/K row order fixed on whole block rows
    dequantized = None if info.type_name in EXACT_SOURCES else _dequantized(file, info, config, expert)
    return quantize_gguf_rows(info.type_name, raw, dequantized, mode)  # type: ignore[arg-type]


def _quantized_rows(file: GGUFFile, info: TensorInfo, mode: str) -> QuantizedWeight:
    """A 3-D tensor [A, B, columns] as A * B quantized rows, its blocks kept where exact."""
    raw = _raw(file, info)
    raw = raw.reshape(-1, raw.shape[-1])
    exact = info.type_name in EXACT_SOURCES
    dequantized = None if exact else _dequantized_raw(file, info).reshape(-1, info.shape[-1])
    return quantize_gguf_rows(info.type_name, raw, dequantized, mode)  # type: ignore[arg-type]


def permuted_qk_heads(config: ModelConfig | HybridConfig) -> tuple[int, int] | None:
    """(query heads, KV heads) where llama.cpp's converter permutes Q's and K's rows for this family
    (its llama architecture, experts or not, and the hybrids converted through it), else None. A
    GGUF LoRA's B rows of Q and K come permuted alike (lora/gguf_lora.py)."""
    if config.architecture not in ("llama", "mixtral", "granitemoehybrid", "nemotron_h"):
        return None
    heads = config.decoder if isinstance(config, HybridConfig) else config  # a hybrid's attention layers
    return heads.num_heads, heads.num_kv_heads


def _to_hf_layout(array: np.ndarray, gguf_name: str, config: ModelConfig) -> np.ndarray:
    if (heads := permuted_qk_heads(config)) is not None:
        if ".attn_q." in gguf_name:
            return unpermute_qk(array, heads[0])
        if ".attn_k." in gguf_name:
            return unpermute_qk(array, heads[1])
    if config.architecture in _GEMMA_ARCHITECTURES and gguf_name.endswith("norm.weight") and array.dtype == np.float32:
        return array - 1.0
    if config.architecture == "deepseek_v2" and (order := rope_rows_order(gguf_name, config)) is not None:
        return array[order]  # on whole block rows too: each row's blocks move together
    return array
