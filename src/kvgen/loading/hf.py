"""Hugging Face model folders: config.json + one or many *.safetensors + tokenizer files."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from kvgen.config import (
    MambaConfig, ModelConfig, RopeScaling, T5Config, alternating_layer_types, every_nth_layer, gemma3_layer_types,
    granite_scalars, yarn_mscale,
)  # fmt: skip
from kvgen.errors import ModelLoadError, UnsupportedModelError
from kvgen.loading.checkpoint import Checkpoint, check_finite
from kvgen.loading.deepseek import deepseek_config, prepare_deepseek_weights
from kvgen.loading.granite_hybrid import granite_hybrid_config, name_granite_hybrid_weights
from kvgen.loading.falcon_h1 import falcon_h1_config, name_falcon_h1_weights
from kvgen.loading.lfm2 import lfm2_config, name_lfm2_weights
from kvgen.loading.nemotron_h import name_nemotron_h_weights, nemotron_h_config
from kvgen.loading.gpt_oss_experts import MXFP4_PARTS, has_mxfp4_experts, name_gpt_oss_experts
from kvgen.loading.mamba2 import mamba2_config, name_mamba2_weights
from kvgen.kernels.formats import QuantizedWeight
from kvgen.loading.tokenizer import Tokenizer
from kvgen.loading.weight_format import EMBEDDING_NAMES, WeightMode, is_matmul_weight, quantizable, quantize_float, quantizes, resolve_mode
from kvgen.models.half_linear import HALF_DTYPES, HalfWeight

HF_MODEL_TYPES = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
    "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3", "mamba": "mamba", "mamba2": "mamba2", "t5": "t5",
    "falcon_mamba": "mamba",  # Mamba blocks whose dt, B and C are RMS-normed (MambaConfig.dt_b_c_rms_eps)
    "mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe", "gpt_oss": "gpt_oss", "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v2",  # the same blocks; V3's routing is in the config
    "smollm3": "llama",  # Llama blocks, some without RoPE (ModelConfig.nope_layers)
    "granite": "llama",  # Llama blocks with Granite's scalars (ModelConfig.embedding_multiplier...)
    "granitemoe": "mixtral",  # Granite's scalars, every layer a mixture as Mixtral's
    "olmo2": "olmo2",
    "olmoe": "olmoe",
    "granitemoehybrid": "granitemoehybrid",  # Granite 4.0-H: Mamba-2 and attention layers (HybridConfig)
    "bamba": "granitemoehybrid",  # Bamba: the same stack without Granite's scalars, RoPE over half of each head
    "lfm2": "lfm2",  # LFM2: gated short convolutions and attention layers (HybridConfig)
    "lfm2_moe": "lfm2",  # LFM2-MoE: the same stack, a mixture in its later layers
    "nemotron_h": "nemotron_h",  # Nemotron-H: Mamba-2, attention and MLP (or mixture) layers, one sublayer each
    "falcon_h1": "falcon_h1",  # Falcon-H1: attention and Mamba-2 side by side in every layer
}  # fmt: skip
_GRANITE_KEYS = ("embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_multiplier")
# Multimodal Gemma 3 checkpoints keep the text model under a prefix.
_NAME_PREFIXES = ("language_model.model.", "model.language_model.", "language_model.")


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no config.json: a Hugging Face model folder needs config.json, *.safetensors and tokenizer.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{path} is not valid JSON ({error}); fix or re-download it") from error
    if "text_config" in raw:  # Gemma 3 multimodal configs nest the language model's settings
        return {**raw["text_config"], "model_type": raw.get("model_type")}
    return raw


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; kvgen runs {', '.join(sorted(HF_MODEL_TYPES))}"
        )
    arch = HF_MODEL_TYPES[model_type]
    method = (raw.get("quantization_config") or {}).get("quant_method")
    if method is not None and not (method == "mxfp4" and arch == "gpt_oss"):  # gpt-oss's MXFP4 experts decode at load
        raise UnsupportedModelError(f"this checkpoint's weights are quantized with {method!r} (config.json's quantization_config), "
                                    "which kvgen does not decode; load its bf16/fp16 release or a GGUF of it")  # fmt: skip
    if raw.get("mlp_bias"):  # no MLP kvgen builds reads biases (gpt-oss's experts carry theirs without this key)
        raise UnsupportedModelError(f"mlp_bias: true (biases on the MLP's projections) is not supported for {model_type}; "
                                    "kvgen runs these checkpoints without them")  # fmt: skip
    if arch == "mamba":
        return _mamba_config(raw)  # type: ignore[return-value]
    if arch == "mamba2":
        return mamba2_config(raw)  # type: ignore[return-value]
    if arch == "t5":
        return _t5_config(raw)  # type: ignore[return-value]
    if arch == "granitemoehybrid":
        return granite_hybrid_config(raw, config_from_hf)  # type: ignore[return-value]
    if arch == "lfm2":
        return lfm2_config(raw, config_from_hf)  # type: ignore[return-value]
    if arch == "nemotron_h":
        return nemotron_h_config(raw, config_from_hf)  # type: ignore[return-value]
    if arch == "falcon_h1":
        return falcon_h1_config(raw, config_from_hf)  # type: ignore[return-value]
    try:
        hidden, num_heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        num_layers = int(raw["num_hidden_layers"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        rope = _rope_parameters(raw)
        common: dict[str, Any] = dict(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch == "gemma3")),
        )
    except KeyError as error:
        raise ModelLoadError(f"config.json lacks {error}; it is not a complete {model_type} config") from error
    global_rope = rope.get("full_attention", rope)
    if arch in ("gemma2", "gemma3"):
        return _gemma_config(raw, arch, rope, common)
    if arch == "gpt_oss":
        return _gpt_oss_config(raw, rope, common)
    if arch == "deepseek_v2":
        return deepseek_config(raw, common, global_rope, _rope_scaling(global_rope, raw))
    window = raw.get("sliding_window") if raw.get("use_sliding_window", arch in ("mistral", "mixtral", "phi3")) else None
    rotary = float(global_rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if arch in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        common.update(_experts(raw, arch, num_layers, common["intermediate_size"]))
    if raw.get("clip_qkv") is not None:  # OLMo's option: clamp q, k and v after the projections
        raise UnsupportedModelError(f"clip_qkv={raw['clip_qkv']} (clamping q, k and v) is not supported; kvgen runs "
                                    f"{model_type} checkpoints without it")  # fmt: skip
    nope = smollm3_nope_layers(raw, num_layers) if model_type == "smollm3" else ()
    return ModelConfig(
        architecture=arch,
        rope_theta=float(global_rope.get("rope_theta", 10000.0)),
        rope_scaling=_rope_scaling(global_rope, raw),
        attention_bias=bool(raw.get("attention_bias", raw.get("qkv_bias", arch in ("qwen2", "qwen2_moe")))),
        sliding_window=int(window) if window else None,
        # SmolLM3 slides only its NoPE layers' attention, where it slides at all
        layer_types=tuple("sliding" if not nope or i in nope else "full" for i in range(num_layers)) if window else (),
        nope_layers=nope,
        **(granite_scalars(*(raw.get(key, 1.0) for key in _GRANITE_KEYS)) if model_type in ("granite", "granitemoe") else {}),
        rotary_dim=int(head_dim * rotary) if rotary != 1.0 else None,
        **common,
    )


def _experts(raw: dict[str, Any], arch: str, num_layers: int, intermediate: int) -> dict[str, Any]:
    """Mixtral (every layer sparse, experts as wide as intermediate_size) and Qwen2/3-MoE (layers
    (i + 1) % decoder_sparse_step == 0 outside mlp_only_layers, experts moe_intermediate_size wide;
    Qwen2-MoE's shared expert shared_expert_intermediate_size wide)."""
    try:
        if arch in ("mixtral", "olmoe"):  # OLMoE: experts as wide as intermediate_size, not renormalised by default
            experts = int(raw["num_local_experts"] if "num_local_experts" in raw else raw["num_experts"])
            return dict(num_experts=experts, experts_per_token=int(raw["num_experts_per_tok"]),
                        expert_intermediate_size=intermediate, moe_layers=tuple(range(num_layers)),
                        normalize_expert_weights=arch == "mixtral" or bool(raw.get("norm_topk_prob", False)))  # fmt: skip
        step, dense = int(raw.get("decoder_sparse_step", 1)), set(raw.get("mlp_only_layers") or ())
        experts = int(raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"])  # transformers 5 writes the latter
        layers = tuple(i for i in range(num_layers) if experts > 0 and i not in dense and (i + 1) % step == 0)
        return dict(num_experts=experts, experts_per_token=int(raw["num_experts_per_tok"]),
                    expert_intermediate_size=int(raw["moe_intermediate_size"]),
                    normalize_expert_weights=bool(raw.get("norm_topk_prob", False)), moe_layers=layers,
                    shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size", 0)) if arch == "qwen2_moe" else 0)  # fmt: skip
    except KeyError as error:
        raise ModelLoadError(f"config.json lacks {error}; it is not a complete {arch} config") from error


def _gpt_oss_config(raw: dict[str, Any], rope: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """gpt-oss: sliding (even) and full layers, biased projections, a sink logit per query head, every
    layer a mixture of clamped-SwiGLU experts (intermediate_size wide) behind a biased router."""
    num_layers = common["num_layers"]
    layer_types = raw.get("layer_types")
    types = (tuple("sliding" if t == "sliding_attention" else "full" for t in layer_types) if layer_types
             else alternating_layer_types(num_layers))  # fmt: skip
    try:
        experts = dict(num_experts=int(raw["num_local_experts"]), experts_per_token=int(raw["num_experts_per_tok"]))
    except KeyError as error:
        raise ModelLoadError(f"config.json lacks {error}; it is not a complete gpt_oss config") from error
    return ModelConfig(
        architecture="gpt_oss", rope_theta=float(rope.get("rope_theta", 150000.0)), rope_scaling=_rope_scaling(rope, raw),
        attention_bias=bool(raw.get("attention_bias", True)), attention_sinks=True,
        sliding_window=int(raw.get("sliding_window") or 128), layer_types=types,
        hidden_act="swiglu_oai", swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)), expert_intermediate_size=common["intermediate_size"],
        normalize_expert_weights=True, moe_layers=tuple(range(num_layers)), **experts, **common,
    )  # fmt: skip


def _mamba_config(raw: dict[str, Any]) -> MambaConfig:
    try:
        hidden = int(raw["hidden_size"])
        rank = raw.get("time_step_rank", "auto")
        return MambaConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw.get("intermediate_size") or int(raw.get("expand", 2)) * hidden),
            state_size=int(raw["state_size"]),
            conv_kernel=int(raw.get("conv_kernel", 4)),
            time_step_rank=-(-hidden // 16) if rank == "auto" else int(rank),
            num_layers=int(raw["num_hidden_layers"]),
            rms_norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            use_conv_bias=bool(raw.get("use_conv_bias", True)),
            use_bias=bool(raw.get("use_bias", False)),
            dt_b_c_rms_eps=float(raw.get("mixer_rms_eps", 1e-6)) if raw.get("model_type") == "falcon_mamba" else None,
        )
    except KeyError as error:
        raise ModelLoadError(f"config.json lacks {error}; it is not a complete mamba config") from error


def _t5_config(raw: dict[str, Any]) -> T5Config:
    projection = raw.get("feed_forward_proj", "relu")
    if projection not in ("relu", "gated-gelu"):
        raise UnsupportedModelError(f"T5 feed_forward_proj {projection!r} is not supported; kvgen runs relu and gated-gelu")
    try:
        return T5Config(
            vocab_size=int(raw["vocab_size"]), d_model=int(raw["d_model"]), d_kv=int(raw["d_kv"]), d_ff=int(raw["d_ff"]),
            num_layers=int(raw["num_layers"]), num_decoder_layers=int(raw.get("num_decoder_layers") or raw["num_layers"]),
            num_heads=int(raw["num_heads"]),
            relative_attention_num_buckets=int(raw.get("relative_attention_num_buckets", 32)),
            relative_attention_max_distance=int(raw.get("relative_attention_max_distance", 128)),
            rms_norm_eps=float(raw.get("layer_norm_epsilon", 1e-6)), gated_gelu=projection == "gated-gelu",
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            # transformers 5 writes the flag; older configs scale exactly when the head is tied.
            scale_decoder_outputs=bool(raw.get("scale_decoder_outputs", raw.get("tie_word_embeddings", True))),
            decoder_start_token_id=int(raw.get("decoder_start_token_id") or 0),
        )  # fmt: skip
    except KeyError as error:
        raise ModelLoadError(f"config.json lacks {error}; it is not a complete t5 config") from error


def _gemma_config(raw: dict[str, Any], arch: str, rope: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """Gemma 2 and 3: GeGLU, sandwich norms, scaled queries, soft-capped logits, sliding layers."""
    global_rope = rope.get("full_attention", rope)
    layer_types = raw.get("layer_types")
    num_layers = common["num_layers"]
    if layer_types:
        types = tuple("sliding" if t == "sliding_attention" else "full" for t in layer_types)
    elif arch == "gemma2":
        types = alternating_layer_types(num_layers)
    else:
        types = gemma3_layer_types(num_layers, int(raw.get("sliding_window_pattern", 6)))
    local_theta = rope.get("sliding_attention", {}).get("rope_theta", raw.get("rope_local_base_freq"))
    return ModelConfig(
        architecture=arch,
        hidden_act="gelu_tanh",
        rope_theta=float(global_rope.get("rope_theta", 1_000_000.0 if arch == "gemma3" else 10000.0)),
        rope_scaling=_rope_scaling(global_rope, raw),
        rope_local_theta=float(local_theta) if arch == "gemma3" else None,
        sliding_window=int(raw.get("sliding_window") or (512 if arch == "gemma3" else 4096)),
        layer_types=types,
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", common["head_dim"])),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        attn_logit_softcapping=raw.get("attn_logit_softcapping") if arch == "gemma2" else None,
        **common,
    )


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes `rope_parameters`; older configs have rope_theta + rope_scaling."""
    if raw.get("rope_parameters"):
        return dict(raw["rope_parameters"])
    params = dict(raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    return params


def smollm3_nope_layers(raw: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: where `no_rope_layers` holds 0 (1: RoPE), or else every
    `no_rope_layer_interval`-th layer (4 by default, llama.cpp's fixed step for GGUF files)."""
    flags = raw.get("no_rope_layers")
    if flags is None:
        return every_nth_layer(num_layers, int(raw.get("no_rope_layer_interval") or 4))
    if len(flags) != num_layers:
        raise ModelLoadError(f"config.json's no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return tuple(i for i, uses_rope in enumerate(flags) if not uses_rope)


def _rope_scaling(params: dict[str, Any], raw: dict[str, Any]) -> RopeScaling | None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind in ("longrope", "su"):
        return _longrope(params, raw)
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        )
    if kind == "yarn":
        return _yarn(params, raw)
    raise UnsupportedModelError(f"RoPE scaling {kind!r} is not supported yet (kvgen has linear, llama3, longrope and yarn)")


def _yarn(params: dict[str, Any], raw: dict[str, Any]) -> RopeScaling:
    """YaRN with transformers' defaults: factor = max / original positions when absent, attention
    factor 0.1 ln(factor) + 1 (or the ratio of DeepSeek's two mscales), beta_fast 32, beta_slow 1."""
    original = params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
    if not original:
        raise ModelLoadError("YaRN rope scaling needs original_max_position_embeddings (the pretraining context) in config.json")
    factor = float(params.get("factor") or int(raw["max_position_embeddings"]) / int(original))
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                     else yarn_mscale(factor))  # fmt: skip
    return RopeScaling(
        kind="yarn", factor=factor, original_max_position=int(original), attention_factor=float(attention),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
    )  # fmt: skip


def _longrope(params: dict[str, Any], raw: dict[str, Any]) -> RopeScaling:
    """Phi-3's LongRoPE, with transformers' defaults: factor = max / original positions, attention
    factor sqrt(1 + ln(factor) / ln(original))."""
    original = int(params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings") or 4096)
    factor = float(params.get("factor") or int(raw.get("max_position_embeddings", original)) / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        kind="longrope", factor=factor, original_max_position=original, attention_factor=float(attention),
        short_factor=tuple(float(f) for f in params["short_factor"]), long_factor=tuple(float(f) for f in params["long_factor"]),
    )  # fmt: skip


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ModelLoadError(f"{folder} is missing shards {missing} listed in {index.name}; download them")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights; kvgen loads safetensors (not .bin) checkpoints")
    return files


# Families whose weights the loader transforms (folds multipliers into, reorders, splits as
# floats) before the model takes them: their F16 / BF16 weights load as fp32 (no 16bit mode).
_TRANSFORMED_AT_LOAD = ("granitemoehybrid", "lfm2", "nemotron_h", "falcon_h1", "deepseek_v2", "gpt_oss", "mamba2", "t5")


def load_hf_folder(
    folder: Path, dtype: torch.dtype = torch.float32, progress: bool = True, weights: WeightMode = "fp32"
) -> Checkpoint:
    raw = read_hf_config(folder)
    config = config_from_hf(raw)
    tokenizer = Tokenizer.from_hf_folder(folder)
    # F16 / BF16 tensors stay so until the mode is known: the 16bit mode keeps its matmul weights, and
    # every mode but fp32 the token embedding (looked up row by row, at half an fp32 table's memory).
    keep_half = weights != "fp32" and dtype == torch.float32 and config.architecture not in _TRANSFORMED_AT_LOAD
    tensors: dict[str, torch.Tensor | QuantizedWeight | HalfWeight] = {}
    for file in safetensors_files(folder):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in tqdm(list(handle.keys()), desc=f"loading {file.name}", disable=not progress, leave=False):
                    if outside_the_forward(_strip_prefix(key), config.num_layers):
                        continue
                    tensor = handle.get_tensor(key)
                    # MXFP4 experts' bytes stay bytes until decoded
                    if not key.endswith(MXFP4_PARTS) and not (keep_half and tensor.dtype in HALF_DTYPES):
                        tensor = tensor.to(dtype)
                    check_finite(key, tensor, file)
                    tensors[_strip_prefix(key)] = tensor
        except ModelLoadError:
            raise
        except Exception as error:
            raise ModelLoadError(f"{file} could not be read as safetensors ({error}); it is truncated or corrupted") from error
    if config.architecture == "granitemoehybrid":
        name_granite_hybrid_weights(tensors, config)  # type: ignore[arg-type]
    if config.architecture == "lfm2":
        name_lfm2_weights(tensors)
    if config.architecture == "nemotron_h":
        name_nemotron_h_weights(tensors, config)  # type: ignore[arg-type]
    if config.architecture == "falcon_h1":
        name_falcon_h1_weights(tensors, config)  # type: ignore[arg-type]
    if config.architecture in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoehybrid", "lfm2"):
        _name_experts(tensors)
    if config.architecture == "deepseek_v2":
        prepare_deepseek_weights(tensors, config, _name_experts)
    # OpenAI's gpt-oss folders ship MXFP4 experts: quantized weights by default, as a quantized GGUF is.
    half_weights = any(_half_matmul(name, tensor) for name, tensor in tensors.items())
    mode = resolve_mode(weights, file_is_quantized=has_mxfp4_experts(tensors), half_weights=half_weights)
    _settle_half_tensors(tensors, mode, config.tie_word_embeddings, dtype)
    if config.architecture == "gpt_oss":
        name_gpt_oss_experts(tensors, dtype, mode)
    if config.architecture == "mamba2":
        name_mamba2_weights(tensors)
    if mode != "fp32" and config.architecture == "t5":
        raise UnsupportedModelError(f"weights={weights!r}: {config.architecture} models run with fp32 weights only; load with weights='fp32'")
    if quantizes(mode):
        quantize_matmul_weights(tensors, config.tie_word_embeddings, mode)
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer, path=folder, format="hf", weights=mode)


def _half_matmul(name: str, tensor: torch.Tensor | QuantizedWeight) -> bool:
    """A matmul weight held as float16 / bfloat16 that the 16bit mode keeps so."""
    return (isinstance(tensor, torch.Tensor) and tensor.dtype in HALF_DTYPES and is_matmul_weight(name)
            and quantizable(tuple(tensor.shape)))  # fmt: skip


def _settle_half_tensors(tensors: dict[str, torch.Tensor | QuantizedWeight | HalfWeight], mode: str, tied: bool,
                         dtype: torch.dtype) -> None:  # fmt: skip
    """The F16 / BF16 tensors kept at read, in place: the 16bit mode keeps the matmul weights 16-bit (a
    tied head shares the embedding's tensor), every mode but fp32 the token embedding; every other
    tensor takes the compute dtype."""
    if mode == "16bit" and tied and "lm_head.weight" not in tensors:
        table = next((tensors[name] for name in EMBEDDING_NAMES if name in tensors), None)
        if isinstance(table, torch.Tensor) and _half_matmul("lm_head.weight", table):
            tensors["lm_head.weight"] = table  # the same tensor: token_embedding reads the head's rows
    for name, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor) and tensor.dtype in HALF_DTYPES:
            keeps = (mode == "16bit" and _half_matmul(name, tensor)) or (mode != "fp32" and name in EMBEDDING_NAMES)
            tensors[name] = HalfWeight(tensor) if keeps else tensor.to(dtype)


def quantize_matmul_weights(tensors: dict[str, torch.Tensor | QuantizedWeight], tied: bool, mode: str) -> None:
    """Float checkpoint -> quantized matmul weights in place (rounding per block; lossy)."""
    if tied and "lm_head.weight" not in tensors:
        table = next(tensors[name] for name in EMBEDDING_NAMES if name in tensors)
        tensors["lm_head.weight"] = table.float() if isinstance(table, HalfWeight) else table
    for name, tensor in list(tensors.items()):
        if isinstance(tensor, torch.Tensor) and is_matmul_weight(name) and quantizable(tuple(tensor.shape)):
            tensors[name] = quantize_float(tensor, mode)  # type: ignore[arg-type]


# GraniteMoE's checkpoints, and transformers' names for them -> the router's and the stacked experts' names
# that _name_experts reads.
_GRANITE_MOE = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(input_linear\.weight|output_linear\.weight|router\.layer\.weight"
                          r"|experts\.gate_up_proj|experts\.down_proj|router\.weight)$")
_GRANITE_MOE_PARTS = {"input_linear.weight": "experts.gate_up_proj", "output_linear.weight": "experts.down_proj",
                      "router.layer.weight": "gate.weight", "experts.gate_up_proj": "experts.gate_up_proj",
                      "experts.down_proj": "experts.down_proj", "router.weight": "gate.weight"}  # fmt: skip
_MIXTRAL_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(gate|experts\.\d+\.w[123])\.weight$")
_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _name_experts(tensors: dict[str, torch.Tensor | QuantizedWeight]) -> None:
    """Expert weights under one naming, in place: mlp.gate.weight (the router) and
    mlp.experts.{e}.{gate,up,down}_proj.weight. Mixtral's checkpoints name them
    block_sparse_moe.gate and experts.{e}.w1 / w3 / w2; transformers 5 can hold each layer's experts
    as two stacked tensors, experts.gate_up_proj [E, 2 I, H] (gate first) and experts.down_proj [E, H, I],
    as GraniteMoE's hold theirs (block_sparse_moe.input_linear / output_linear, router.layer)."""
    for name in list(tensors):
        if granite := _GRANITE_MOE.match(name):
            layer, part = granite.groups()
            tensors[f"{layer}.mlp.{_GRANITE_MOE_PARTS[part]}"] = tensors.pop(name)
            name = f"{layer}.mlp.{_GRANITE_MOE_PARTS[part]}"
        match = _MIXTRAL_EXPERT.match(name)
        if match:
            layer, part = match.groups()
            if part != "gate":
                expert, projection = part.rsplit(".", 1)
                part = f"{expert}.{_MIXTRAL_PROJECTIONS[projection]}"
            tensors[f"{layer}.mlp.{part}.weight"] = tensors.pop(name)
        elif name.endswith(".mlp.experts.gate_up_proj") or name.endswith(".mlp.experts.down_proj"):
            stacked = tensors.pop(name)
            assert isinstance(stacked, torch.Tensor)
            prefix, projection = name.rsplit(".", 1)
            for e, weight in enumerate(stacked):
                if projection == "down_proj":
                    tensors[f"{prefix}.{e}.down_proj.weight"] = weight.contiguous()
                else:
                    gate, up = weight.chunk(2, dim=0)
                    tensors[f"{prefix}.{e}.gate_proj.weight"], tensors[f"{prefix}.{e}.up_proj.weight"] = gate.contiguous(), up.contiguous()


_PREDICTION_HEAD = re.compile(r"^(model\.)?mtp\.")
_LAYER_INDEX = re.compile(r"^(?:model|backbone)\.layers\.(\d+)\.")


def outside_the_forward(name: str, num_layers: int) -> bool:
    """Whether a checkpoint tensor belongs to a multi-token-prediction head rather than the model:
    `mtp.*` (Nemotron-H and others) or a layer past the config's count (DeepSeek-V3's trailing MTP
    layer). Those heads are speculative drafters outside the forward, so they are never read: a
    Nemotron 3 Nano folder's MTP block would otherwise sit in memory as float32 for nothing."""
    if _PREDICTION_HEAD.match(name):
        return True
    layer = _LAYER_INDEX.match(name)
    return layer is not None and int(layer.group(1)) >= num_layers


def _strip_prefix(name: str) -> str:
    for prefix in _NAME_PREFIXES:
        if name.startswith(prefix):
            rest = name[len(prefix) :]
            return rest if rest.startswith("lm_head") else f"model.{rest}"
    return name
