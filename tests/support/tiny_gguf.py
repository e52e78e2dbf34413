"""Writes small random-weight GGUF files with gguf-py's writer, for format and error tests."""

from __future__ import annotations

import math
import re
from pathlib import Path

import gguf
import numpy as np

from kvgen.kernels.formats import IQ4_LEVELS
from kvgen.loading.weight_format import is_matmul_weight

BYTE_ALPHABET_SIZE = 256
Q = gguf.GGMLQuantizationType


def _byte_level_tokens() -> list[str]:
    # GPT-2's printable spelling of the 256 bytes (what a byte-level BPE vocab is written in).
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for _, c in sorted(zip(printable, codes))]




def _iq4_nibbles(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Blocks [.., 32] / scales [..] -> the nearest IQ4 levels' indices packed as llama.cpp packs
    them: byte j holds element j (low nibble) and j + 16 (high) -> [.., 16] uint8."""
    safe = np.where(scales != 0, scales, 1.0)[..., None]
    index = np.abs(values[..., None] / safe[..., None] - IQ4_LEVELS.astype(np.float32)).argmin(axis=-1).astype(np.uint8)
    return index[..., :16] | (index[..., 16:] << 4)


def quantize_iq4(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """A plain IQ4_NL / IQ4_XS encoder (gguf-py has only their decoders): each 32-weight block's
    extreme maps to the level -127; IQ4_XS rounds those scales to 6 bits of a super-block's f16 d.
    Rows [N, K] -> GGUF bytes [N, K / 32 * 18] or [N, K / 256 * 136]."""
    n = values.shape[0]
    blocks = values.reshape(n, -1, 32).astype(np.float32)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    scales = extreme / -127.0  # [N, nb]
    if qtype == gguf.GGMLQuantizationType.IQ4_NL:
        d = scales.astype(np.float16)
        return np.concatenate([d[..., None].view(np.uint8), _iq4_nibbles(blocks, d.astype(np.float32))], axis=-1).reshape(n, -1)
    sub = scales.reshape(n, -1, 8)  # [N, S, 8]
    d = (np.abs(sub).max(axis=-1) / 31.0).astype(np.float16)  # [N, S]
    ls = np.clip(np.rint(sub / np.where(d != 0, d, 1.0).astype(np.float32)[..., None]), -32, 31).astype(np.int32) + 32
    block_scales = d.astype(np.float32)[..., None] * (ls - 32).astype(np.float32)
    nibbles = _iq4_nibbles(blocks.reshape(n, -1, 8, 32), block_scales)  # [N, S, 8, 16]
    scales_h = np.zeros(ls.shape[:2], dtype=np.uint16)
    scales_l = np.zeros(ls.shape[:2] + (4,), dtype=np.uint8)
    for ib in range(8):
        scales_l[..., ib // 2] |= ((ls[..., ib] & 0xF) << (4 * (ib % 2))).astype(np.uint8)
        scales_h |= (((ls[..., ib] >> 4) & 3) << (2 * ib)).astype(np.uint16)
    parts = [d[..., None].view(np.uint8), scales_h[..., None].view(np.uint8), scales_l, nibbles.reshape(n, -1, 128)]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def quantize_q3k(values: np.ndarray) -> np.ndarray:
    """A plain Q3_K encoder (gguf-py has only its decoder): each 16 weights' extreme maps to q = +-4
    (clipped to 3), those scales round to 6 bits (sc - 32 in [0, 31]) of a super-block's f16 d.
    Rows [N, K] -> GGUF bytes [N, K / 256 * 110]: high bits, bit pairs, packed scales, d."""
    n = values.shape[0]
    sub = values.reshape(n, -1, 16, 16).astype(np.float32)  # [N, S, 16 scales, 16 weights]
    scales = np.abs(sub).max(axis=-1) / 4.0
    d = (scales.max(axis=-1) / 31.0).astype(np.float16)  # [N, S]
    sc = np.clip(np.rint(scales / np.where(d != 0, d, 1.0).astype(np.float32)[..., None]), 0, 31).astype(np.uint8)
    step = d.astype(np.float32)[..., None] * sc.astype(np.float32)
    q = np.clip(np.rint(sub / np.where(step != 0, step, 1.0)[..., None]), -4, 3).astype(np.int8).reshape(n, -1, 256)
    top = (q >= 0).astype(np.uint8)  # the high bit set: no -4
    pairs = (q + 4 * (1 - top.astype(np.int8))).astype(np.uint8)  # q's low two bits
    hmask = (top.reshape(n, -1, 8, 32) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=2, dtype=np.uint8)
    qs = (pairs.reshape(n, -1, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=3, dtype=np.uint8)
    six = sc + 32
    packed = np.zeros(six.shape[:2] + (12,), dtype=np.uint8)
    packed[..., 0:8] = (six[..., 0:8] & 0x0F) | ((six[..., 8:16] & 0x0F) << 4)
    packed[..., 8:12] = ((six >> 4).reshape(n, -1, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=2, dtype=np.uint8)
    parts = [hmask, qs.reshape(n, -1, 64), packed, d[..., None].view(np.uint8)]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def _finish(writer: gguf.GGUFWriter, path: Path) -> Path:
    """Write the header, metadata and tensors, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_float_or_quantized(writer: gguf.GGUFWriter, name: str, values: np.ndarray, kind: gguf.GGMLQuantizationType) -> None:
    """`values` as `kind` where its rows are whole blocks of it, else as F32."""
    if kind != Q.F32 and values.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0] == 0:
        writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(values), kind), raw_dtype=kind)
    else:
        writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))


def write_tiny_gguf(
    path: Path,
    architecture: str = "llama",
    weight_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    hidden: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    tokenizer_model: str = "gpt2",
) -> Path:
    """A 2-layer Llama-shaped model with a byte-level vocabulary (256 bytes + <|endoftext|>)."""
    rng = np.random.default_rng(seed)
    tokens = _byte_level_tokens() + ["<|endoftext|>"]
    heads, kv_heads, ffn = 4, 2, 128
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(num_layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * BYTE_ALPHABET_SIZE + [3])
    writer.add_token_merges([])
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)

    def add(name: str, shape: tuple[int, ...], quantize: bool = True) -> None:
        values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if name.endswith("norm.weight"):
            values = 1.0 + values
        if quantize and weight_type in (Q.IQ4_NL, Q.IQ4_XS, Q.Q3_K):
            # llama-quantize's fallback: rows that are not whole 256-weight super-blocks take IQ4_NL
            qtype = weight_type if shape[-1] % 256 == 0 else Q.IQ4_NL
            packed = quantize_q3k(values) if qtype == Q.Q3_K else quantize_iq4(values, qtype)
            writer.add_tensor(name, packed, raw_dtype=qtype)
        elif quantize and weight_type != gguf.GGMLQuantizationType.F32:
            block = gguf.GGML_QUANT_SIZES[weight_type][0]
            qtype = weight_type if shape[-1] % block == 0 else Q.Q8_0  # the ternary types' 256-weight blocks
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, values)

    head_dim = hidden // heads
    add("token_embd.weight", (len(tokens), hidden))
    add("output_norm.weight", (hidden,), quantize=False)
    for i in range(num_layers):
        add(f"blk.{i}.attn_norm.weight", (hidden,), quantize=False)
        add(f"blk.{i}.attn_q.weight", (heads * head_dim, hidden))
        add(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden))
        add(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden))
        add(f"blk.{i}.attn_output.weight", (hidden, heads * head_dim))
        add(f"blk.{i}.ffn_norm.weight", (hidden,), quantize=False)
        add(f"blk.{i}.ffn_gate.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_up.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_down.weight", (hidden, ffn))
    return _finish(writer, path)


_GGUF_LAYER_PARTS = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "post_attention_layernorm": "ffn_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp", "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b", "block_sparse_moe.router": "ffn_gate_inp",
}  # fmt: skip
# gpt-oss: its post-attention norm keeps that name, and the router is mlp.router.
_GPT_OSS_PARTS = {"post_attention_layernorm": "post_attention_norm", "mlp.router": "ffn_gate_inp"}
_GGUF_GLOBALS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}  # fmt: skip


def gguf_tensor_name(hf_name: str, architecture: str) -> str:
    """llama.cpp's name for an HF parameter, as its convert_hf_to_gguf.py writes it."""
    if hf_name in _GGUF_GLOBALS:
        return _GGUF_GLOBALS[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    if rest == "mlp.gate.e_score_correction_bias":  # DeepSeek-V3's
        return f"blk.{layer}.exp_probs_b.bias"
    part, suffix = rest.rsplit(".", 1)
    gemma = architecture.startswith("gemma")
    if architecture == "gpt-oss" and rest == "self_attn.sinks":
        return f"blk.{layer}.attn_sinks.weight"
    if architecture == "gpt-oss" and part in _GPT_OSS_PARTS:
        return f"blk.{layer}.{_GPT_OSS_PARTS[part]}.{suffix}"
    sandwich = gemma or architecture == "olmo2"  # their post-attention norm is one, not Llama's pre-MLP ffn_norm
    name = "post_attention_norm" if sandwich and part == "post_attention_layernorm" else _GGUF_LAYER_PARTS[part]
    return f"blk.{layer}.{name}.{suffix}"


def _deepseek_metadata(writer: gguf.GGUFWriter, config, split_kv_b: bool) -> None:
    """convert_hf_to_gguf.py's deepseek2 keys (split_kv_b: MLA as one KV head over the latent)."""
    rank, rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_vocab_size(config.vocab_size)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(rank)
    if split_kv_b:
        writer.add_head_count_kv(1)
        writer.add_key_length(rank + rope_dim)
        writer.add_value_length(rank)
        writer.add_key_length_mla(config.qk_nope_head_dim + rope_dim)
        writer.add_value_length_mla(config.v_head_dim)
    else:
        writer.add_head_count_kv(config.num_attention_heads)
        writer.add_key_length(config.qk_nope_head_dim + rope_dim)
        writer.add_value_length(config.v_head_dim)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    if config.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    if config.model_type == "deepseek_v3":
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)
    writer.add_rope_dimension_count(rope_dim)


def _copy_tokenizer(writer: gguf.GGUFWriter, metadata: dict) -> None:
    for key, value in metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_array(key, [v.decode("utf-8") if isinstance(v, bytes) else v for v in value])


def write_gguf_from_hf(path: Path, hf_model, tokenizer_gguf: Path, matmul_type: gguf.GGMLQuantizationType = Q.F32,
                       stacked_experts: bool = True, embedding_type: gguf.GGMLQuantizationType = Q.F32,
                       expert_type: gguf.GGMLQuantizationType | None = None, fused_gate_up: bool = False,
                       split_kv_b: bool = True) -> Path:  # fmt: skip
    """A GGUF of a transformers model (Qwen3, Qwen2-MoE, Qwen3-MoE, Mixtral, Phi-3, Gemma 2, gpt-oss) with the metadata
    and tensor layout llama.cpp's converter writes, the tokenizer copied from `tokenizer_gguf`; the
    projections (experts included) in `matmul_type` (gguf-py can write Q8_0, Q4_0...), the rest F32.
    Without `stacked_experts`, each expert's weight is a tensor of its own, as older Mixtral files
    have them (blk.N.ffn_gate.E.weight). embedding_type: the token embedding's (a tied model's head:
    llama-quantize leaves it 8-bit or more); expert_type: the stacked experts' (matmul_type when None).
    fused_gate_up (gpt-oss): the experts' gate and up as one ffn_gate_up_exps (gate rows first), as
    llama.cpp's converter writes them when asked to fuse. DeepSeek-V2: kv_b_proj split into attn_k_b
    (transposed) and attn_v_b with one KV head of kv_lora_rank + rope values, as the converter has
    written them since MLA's absorption; split_kv_b=False: one attn_kv_b, the earlier layout."""
    from kvgen.loading.gguf_file import GGUFFile

    config = hf_model.config
    arch = {"qwen3": "qwen3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama", "phi3": "phi3",
            "gemma2": "gemma2", "gpt_oss": "gpt-oss", "deepseek_v2": "deepseek2",
            "deepseek_v3": "deepseek2", "smollm3": "smollm3", "granite": "granite",
            "granitemoe": "granitemoe", "olmo2": "olmo2", "olmoe": "olmoe"}[config.model_type]  # fmt: skip
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    if config.model_type in ("qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss", "granitemoe", "olmoe"):
        writer.add_expert_count(getattr(config, "num_local_experts", None) or config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if arch in ("qwen2moe", "qwen3moe"):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if arch == "gpt-oss":
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_sliding_window(config.sliding_window)
        if config.swiglu_limit != 7.0:  # llama.cpp's default; a test model's own limit, per layer
            writer.add_swiglu_clamp_exp([config.swiglu_limit] * config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    if arch == "deepseek2":
        _deepseek_metadata(writer, config, split_kv_b)
    else:
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    if arch in ("granite", "granitemoe"):  # convert_hf_to_gguf.py's GraniteModel keys
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if arch == "deepseek2" and rope.get("mscale_all_dim"):
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    if arch == "gemma2":
        writer.add_sliding_window(config.sliding_window)
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if rope.get("rope_type") == "yarn":  # as convert_hf_to_gguf.py writes it
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "phi3":
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = config.max_position_embeddings / original  # convert_hf_to_gguf.py's attention factor (llama.cpp reads it)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    _copy_tokenizer(writer, GGUFFile(tokenizer_gguf).metadata)
    def add(gguf_name: str, values: np.ndarray, matmul: bool) -> None:
        if gguf_name.endswith("_exps.weight") and not stacked_experts:
            for e, expert in enumerate(values):
                add(gguf_name.replace("_exps.weight", f".{e}.weight"), expert, matmul)
            return
        expert = gguf_name.endswith("_exps.weight") and expert_type is not None
        kind = embedding_type if gguf_name == "token_embd.weight" else expert_type if expert else matmul_type if matmul else Q.F32
        if values.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:  # rows of no whole block stay float, as the converter keeps them
            kind = Q.F32
        if kind != Q.F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(values), kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(values))

    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the head is the embedding: llama.cpp's converter writes no output.weight (Gemma refuses one)
        values = tensor.detach().float().numpy().copy()
        if arch == "gemma2" and name.endswith("norm.weight"):
            values = values + 1.0  # llama.cpp stores Gemma norms as 1 + w
        if arch in ("llama", "smollm3", "granite", "granitemoe") and name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's interleaved RoPE rows
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            values = values.reshape(heads, 2, -1, values.shape[-1]).swapaxes(1, 2).reshape(values.shape)
        if arch == "gpt-oss" and ".mlp.experts." in name:  # [E, H, 2 I] (gate, up columns interleaved), [E, I, H], x @ W
            stem = f"blk.{name.split('.')[2]}"
            if name.endswith("gate_up_proj"):
                gate, up = values[:, :, ::2].transpose(0, 2, 1), values[:, :, 1::2].transpose(0, 2, 1)
                if fused_gate_up:
                    add(f"{stem}.ffn_gate_up_exps.weight", np.concatenate([gate, up], axis=1), True)
                else:
                    add(f"{stem}.ffn_gate_exps.weight", gate, True)
                    add(f"{stem}.ffn_up_exps.weight", up, True)
            elif name.endswith("gate_up_proj_bias"):
                if fused_gate_up:
                    add(f"{stem}.ffn_gate_up_exps.bias", np.concatenate([values[:, ::2], values[:, 1::2]], axis=1), False)
                else:
                    add(f"{stem}.ffn_gate_exps.bias", values[:, ::2], False)
                    add(f"{stem}.ffn_up_exps.bias", values[:, 1::2], False)
            elif name.endswith("down_proj"):
                add(f"{stem}.ffn_down_exps.weight", values.transpose(0, 2, 1), True)
            else:
                add(f"{stem}.ffn_down_exps.bias", values, False)
        elif name.endswith(("mlp.experts.gate_up_proj", "block_sparse_moe.experts.gate_up_proj")):  # transformers' stacked experts [E, 2 I, H]: gate rows first
            layer = name.split(".")[2]
            gate, up = np.split(values, 2, axis=1)
            add(f"blk.{layer}.ffn_gate_exps.weight", gate, True)
            add(f"blk.{layer}.ffn_up_exps.weight", up, True)
        elif name.endswith(("mlp.experts.down_proj", "block_sparse_moe.experts.down_proj")):
            add(f"blk.{name.split('.')[2]}.ffn_down_exps.weight", values, True)
        elif name.endswith("kv_b_proj.weight") and split_kv_b:  # [H, nope + v, rank] -> k_b [H, rank, nope], v_b [H, v, rank]
            layer, nope = name.split(".")[2], config.qk_nope_head_dim
            kv_b = values.reshape(config.num_attention_heads, nope + config.v_head_dim, -1)
            add(f"blk.{layer}.attn_k_b.weight", kv_b[:, :nope].transpose(0, 2, 1), True)
            add(f"blk.{layer}.attn_v_b.weight", kv_b[:, nope:], True)
        else:
            add(gguf_tensor_name(name, arch), values, is_matmul_weight(name))
    return _finish(writer, path)


_MAMBA_PARTS = {"norm": "attn_norm", "mixer.in_proj": "ssm_in", "mixer.conv1d": "ssm_conv1d", "mixer.x_proj": "ssm_x",
                "mixer.dt_proj": "ssm_dt", "mixer.out_proj": "ssm_out"}  # fmt: skip


def write_mamba_gguf(path: Path, hf_model, tokenizer_gguf: Path, matmul_type: gguf.GGMLQuantizationType = Q.F32,
                     embedding_type: gguf.GGMLQuantizationType = Q.F32) -> Path:  # fmt: skip
    """A GGUF of transformers' MambaForCausalLM, FalconMambaForCausalLM or Mamba2ForCausalLM as
    llama.cpp's converter writes it (`mamba`: A as -exp(A_log), the conv weight [C, K], dt_b_c_rms
    for Falcon-Mamba; `mamba2`: also A and D as [H, 1], the norm as [groups, I / groups], dt_bias as
    ssm_dt.bias), the tokenizer copied from `tokenizer_gguf`; projections whose rows are whole blocks
    in `matmul_type`, the token embedding in `embedding_type`."""
    from kvgen.loading.gguf_file import GGUFFile

    config = hf_model.config
    mamba2 = config.model_type == "mamba2"
    writer = gguf.GGUFWriter(str(path), "mamba2" if mamba2 else "mamba")
    writer.add_context_length(2**20)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_ssm_conv_kernel(config.conv_kernel)
    writer.add_ssm_state_size(config.state_size)
    writer.add_layer_norm_rms_eps(config.layer_norm_epsilon)
    if mamba2:
        writer.add_ssm_inner_size(config.num_heads * config.head_dim)
        writer.add_ssm_time_step_rank(config.num_heads)
        writer.add_ssm_group_count(config.n_groups)
    else:
        writer.add_ssm_inner_size(config.intermediate_size)
        writer.add_ssm_time_step_rank(config.time_step_rank)
        writer.add_ssm_dt_b_c_rms(config.model_type == "falcon_mamba")
    _copy_tokenizer(writer, GGUFFile(tokenizer_gguf).metadata)
    for name, tensor in hf_model.state_dict().items():
        values = tensor.detach().float().numpy().copy()
        if name == "lm_head.weight":
            if config.tie_word_embeddings:
                continue
            target = "output.weight"
        elif name.startswith("backbone.layers."):
            _, _, layer, rest = name.split(".", 3)
            if rest.endswith(".A_log"):
                target, values = f"blk.{layer}.ssm_a", -np.exp(values)
                values = values.reshape(-1, 1) if mamba2 else values
            elif rest.endswith(".D"):
                target, values = f"blk.{layer}.ssm_d", values.reshape(-1, 1) if mamba2 else values
            elif rest == "mixer.dt_bias":
                target = f"blk.{layer}.ssm_dt.bias"
            elif rest == "mixer.norm.weight" and mamba2:
                target, values = f"blk.{layer}.ssm_norm.weight", values.reshape(config.n_groups, -1)
            else:
                part, suffix = rest.rsplit(".", 1)
                target = f"blk.{layer}.{_MAMBA_PARTS[part]}.{suffix}"
                values = values.reshape(values.shape[0], -1) if part == "mixer.conv1d" and suffix == "weight" else values
        else:
            target = {"backbone.embeddings.weight": "token_embd.weight", "backbone.norm_f.weight": "output_norm.weight"}[name]
        kind = embedding_type if target == "token_embd.weight" else matmul_type if is_matmul_weight(name) else Q.F32
        _add_float_or_quantized(writer, target, values, kind)
    return _finish(writer, path)


_HYBRID_MAMBA = {"in_proj.weight": "ssm_in.weight", "conv1d.weight": "ssm_conv1d.weight", "conv1d.bias": "ssm_conv1d.bias",
                 "dt_bias": "ssm_dt.bias", "A_log": "ssm_a", "D": "ssm_d", "norm.weight": "ssm_norm.weight",
                 "out_proj.weight": "ssm_out.weight"}  # fmt: skip


def _add_mamba2_keys(writer: gguf.GGUFWriter, kernel: int, state: int, groups: int, inner: int, heads: int) -> None:
    """A hybrid file's Mamba-2 keys as llama.cpp's converter writes them (heads as time_step_rank)."""
    writer.add_ssm_conv_kernel(kernel)
    writer.add_ssm_state_size(state)
    writer.add_ssm_group_count(groups)
    writer.add_ssm_inner_size(inner)
    writer.add_ssm_time_step_rank(heads)


def _llama_cpp_mamba2(part: str, values: np.ndarray, groups: int) -> np.ndarray:
    """A Mamba-2 mixer's tensor (HF name `part`) as llama.cpp's converter writes it: A as -exp(A_log),
    A and D as [heads, 1], the norm per group [groups, inner / groups], the conv as [channels, taps]."""
    if part == "A_log":
        values = -np.exp(values)
    if part in ("A_log", "D"):
        return values.reshape(-1, 1)
    if part == "norm.weight":
        return values.reshape(groups, -1)
    if part == "conv1d.weight":
        return values.reshape(values.shape[0], -1)
    return values


def write_granite_hybrid_gguf(path: Path, hf_model, tokenizer_gguf: Path, matmul_type: gguf.GGMLQuantizationType = Q.F32,
                              embedding_type: gguf.GGMLQuantizationType = Q.F32) -> Path:  # fmt: skip
    """A GGUF of transformers' GraniteMoeHybridForCausalLM as llama.cpp's converter writes it
    (`granitehybrid`): granitemoe's keys and tensors for attention and MLPs (q/k rows permuted, the
    shared MLP as ffn_*_shexp beside experts or as ffn_* alone), mamba2's for the Mamba layers, KV
    heads per layer (0 for a Mamba layer), rope.scaling.finetuned false (NoPE attention); projections
    in `matmul_type`, the token embedding in `embedding_type`."""
    from kvgen.loading.gguf_file import GGUFFile

    c = hf_model.config
    experts = c.num_local_experts
    attention = [i for i, kind in enumerate(c.layer_types) if kind in ("attention", "full_attention")]
    writer = gguf.GGUFWriter(str(path), "granitehybrid")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(2**20)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv([c.num_key_value_heads if i in attention else 0 for i in range(c.num_hidden_layers)])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_attention_scale(c.attention_multiplier)
    writer.add_embedding_scale(c.embedding_multiplier)
    writer.add_residual_scale(c.residual_multiplier)
    writer.add_logit_scale(c.logits_scaling)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_shared_feed_forward_length(c.shared_intermediate_size)
    _add_mamba2_keys(writer, c.mamba_d_conv, c.mamba_d_state, c.mamba_n_groups, c.mamba_n_heads * c.mamba_d_head, c.mamba_n_heads)
    writer.add_rope_scaling_finetuned(c.position_embedding_type == "rope")
    _copy_tokenizer(writer, GGUFFile(tokenizer_gguf).metadata)

    def add(name: str, values: np.ndarray, matmul: bool) -> None:
        _add_float_or_quantized(writer, name, values, embedding_type if name == "token_embd.weight" else matmul_type if matmul else Q.F32)

    shared = "_shexp" if experts else ""
    for name, tensor in hf_model.state_dict().items():
        values = tensor.detach().float().numpy().copy()
        if not name.startswith("model.layers."):
            if name != "lm_head.weight" or not c.tie_word_embeddings:
                add(_GGUF_GLOBALS[name], values, name == "lm_head.weight")
            continue
        _, _, layer, rest = name.split(".", 3)
        stem = f"blk.{layer}"
        if rest.startswith("mamba."):
            part = rest[len("mamba.") :]
            add(f"{stem}.{_HYBRID_MAMBA[part]}", _llama_cpp_mamba2(part, values, c.mamba_n_groups), part.endswith("proj.weight"))
        elif rest == "shared_mlp.input_linear.weight":
            gate, up = np.split(values, 2, axis=0)
            add(f"{stem}.ffn_gate{shared}.weight", gate, True)
            add(f"{stem}.ffn_up{shared}.weight", up, True)
        elif rest == "shared_mlp.output_linear.weight":
            add(f"{stem}.ffn_down{shared}.weight", values, True)
        elif rest == "block_sparse_moe.router.weight":
            add(f"{stem}.ffn_gate_inp.weight", values, False)
        elif rest == "block_sparse_moe.experts.gate_up_proj":  # [E, 2 I, H], gate rows first
            gate, up = np.split(values, 2, axis=1)
            add(f"{stem}.ffn_gate_exps.weight", gate, True)
            add(f"{stem}.ffn_up_exps.weight", up, True)
        elif rest == "block_sparse_moe.experts.down_proj":
            add(f"{stem}.ffn_down_exps.weight", values, True)
        else:
            if rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):  # llama.cpp's interleaved RoPE rows
                heads = c.num_attention_heads if "q_proj" in rest else c.num_key_value_heads
                values = values.reshape(heads, 2, -1, values.shape[-1]).swapaxes(1, 2).reshape(values.shape)
            add(gguf_tensor_name(name, "granite"), values, is_matmul_weight(name))
    return _finish(writer, path)


# LFM2's HF names -> llama.cpp's (the short conv, its operator and ffn norms, the SwiGLU's w1/w3/w2)
_LFM2_PARTS = {"operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up",
               "feed_forward.w2": "ffn_down", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_output", "self_attn.q_layernorm": "attn_q_norm",
               "self_attn.k_layernorm": "attn_k_norm", "conv.in_proj": "shortconv.in_proj", "conv.out_proj": "shortconv.out_proj",
               "conv.conv": "shortconv.conv"}  # fmt: skip


def write_lfm2_gguf(path: Path, hf_model, tokenizer_gguf: Path, matmul_type: gguf.GGMLQuantizationType = Q.F32,
                    embedding_type: gguf.GGMLQuantizationType = Q.F32) -> Path:  # fmt: skip
    """A GGUF of transformers' Lfm2ForCausalLM (or Lfm2MoeForCausalLM: `lfm2moe`) as llama.cpp's
    converter writes it (`lfm2`): KV heads per layer (0 for a conv layer), shortconv.l_cache, the
    SwiGLU's width after transformers' adjustment, q/k rows as they are (llama.cpp turns LFM2 by NeoX
    halves), the conv's weight as [hidden, taps], the final norm as token_embd_norm, the head tied;
    a mixture's router as ffn_gate_inp, its experts stacked as ffn_{gate,up,down}_exps, its choice
    bias as exp_probs_b.bias; projections in `matmul_type`, the token embedding in `embedding_type`."""
    from kvgen.loading.gguf_file import GGUFFile

    c = hf_model.config
    moe = c.model_type == "lfm2_moe"
    writer = gguf.GGUFWriter(str(path), "lfm2moe" if moe else "lfm2")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(hf_model.model.layers[0].feed_forward.w1.weight.shape[0])
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv([c.num_key_value_heads if kind == "full_attention" else 0 for kind in c.layer_types])
    writer.add_layer_norm_rms_eps(c.norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_vocab_size(c.vocab_size)
    writer.add_shortconv_l_cache(c.conv_L_cache)
    if moe:
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_leading_dense_block_count(c.num_dense_layers)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_weights_scale(c.routed_scaling_factor)
    _copy_tokenizer(writer, GGUFFile(tokenizer_gguf).metadata)
    stacked: dict[str, np.ndarray] = {}  # a layer's experts' weights [E, rows, columns], written after the rest
    for name, tensor in hf_model.state_dict().items():
        values = tensor.detach().float().numpy().copy()
        if name == "lm_head.weight":
            continue  # tied to the embedding
        if expert := re.match(r"^model\.layers\.(\d+)\.feed_forward\.experts\.(gate_up_proj|down_proj)$", name):
            layer, part = expert.groups()  # transformers holds them stacked: gate_up [E, 2 I, H] (gate rows first), down [E, H, I]
            if part == "down_proj":
                stacked[f"blk.{layer}.ffn_down_exps.weight"] = values
            else:
                stacked[f"blk.{layer}.ffn_gate_exps.weight"], stacked[f"blk.{layer}.ffn_up_exps.weight"] = np.split(values, 2, axis=1)
            continue
        if name.endswith(("feed_forward.gate.weight", "feed_forward.expert_bias")):
            layer = name.split(".")[2]
            gguf_name = f"blk.{layer}.ffn_gate_inp.weight" if name.endswith("gate.weight") else f"blk.{layer}.exp_probs_b.bias"
            writer.add_tensor(gguf_name, np.ascontiguousarray(values, dtype=np.float32))
            continue
        if name in ("model.embed_tokens.weight", "model.embedding_norm.weight"):
            gguf_name, matmul = ("token_embd.weight", True) if name == "model.embed_tokens.weight" else ("token_embd_norm.weight", False)
        else:
            _, _, layer, rest = name.split(".", 3)
            part, suffix = rest.rsplit(".", 1)
            gguf_name, matmul = f"blk.{layer}.{_LFM2_PARTS[part]}.{suffix}", part.endswith(("proj", "w1", "w2", "w3"))
            if part == "conv.conv":  # [hidden, 1, taps] -> [hidden, taps]; its bias as it is
                values, matmul = values.reshape(values.shape[0], -1), False
        kind = (embedding_type if gguf_name == "token_embd.weight" else matmul_type) if matmul and gguf_name.endswith(".weight") else Q.F32
        _add_float_or_quantized(writer, gguf_name, values, kind)
    for gguf_name, values in stacked.items():
        _add_float_or_quantized(writer, gguf_name, values, matmul_type)
    return _finish(writer, path)


# Nemotron-H's HF names (transformers' model.*, each layer's sublayer under `mixer`) -> llama.cpp's
_NEMOTRON_H_GLOBALS = {"model.embeddings.weight": "token_embd.weight", "model.norm_f.weight": "output_norm.weight",
                       "lm_head.weight": "output.weight"}  # fmt: skip
_NEMOTRON_H_PARTS = {"norm.weight": "attn_norm.weight", "mixer.q_proj.weight": "attn_q.weight", "mixer.k_proj.weight": "attn_k.weight",
                     "mixer.v_proj.weight": "attn_v.weight", "mixer.o_proj.weight": "attn_output.weight",
                     "mixer.up_proj.weight": "ffn_up.weight", "mixer.down_proj.weight": "ffn_down.weight",
                     "mixer.gate.weight": "ffn_gate_inp.weight", "mixer.gate.e_score_correction_bias": "exp_probs_b.bias",
                     "mixer.experts.up_proj": "ffn_up_exps.weight", "mixer.experts.down_proj": "ffn_down_exps.weight",
                     "mixer.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
                     "mixer.shared_experts.down_proj.weight": "ffn_down_shexp.weight"}  # fmt: skip


def write_nemotron_h_gguf(path: Path, hf_model, tokenizer_gguf: Path, matmul_type: gguf.GGMLQuantizationType = Q.F32,
                          embedding_type: gguf.GGMLQuantizationType = Q.F32, rms_epsilon: bool = True,
                          mtp_layers: int = 0) -> Path:  # fmt: skip
    """A GGUF of transformers' NemotronHForCausalLM as llama.cpp's converter writes it (`nemotron_h`,
    or `nemotron_h_moe` with experts): KV heads per layer (0 outside attention), feed_forward_length
    per layer (the MLP's width, or the experts' in a mixture layer; 0 elsewhere), key and value
    lengths, mamba2's tensors as granitehybrid's (A as -exp(A_log), the norm per group), every
    layer's norm as attn_norm, q/k rows permuted, experts stacked as ffn_{up,down}_exps beside
    ffn_{up,down}_shexp, the choice bias as exp_probs_b.bias; projections in `matmul_type`, the
    token embedding in `embedding_type`. The norms' epsilon goes under attention.layer_norm_epsilon,
    which llama.cpp's first nemotron_h reader takes, and (`rms_epsilon`) layer_norm_rms_epsilon,
    which later ones take. `mtp_layers`: trailing blocks counted as a multi-token-prediction head, as
    the converter appends one (an attention and a mixture sublayer each; their metadata only)."""
    from kvgen.loading.gguf_file import GGUFFile

    c = hf_model.config
    kinds = list(c.layers_block_type)
    moe = "moe" in kinds
    writer = gguf.GGUFWriter(str(path), "nemotron_h_moe" if moe else "nemotron_h")
    if mtp_layers:
        writer.add_nextn_predict_layers(mtp_layers)
    kinds = kinds + ["mtp"] * mtp_layers
    writer.add_block_count(len(kinds))
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    width = c.moe_intermediate_size if moe else c.intermediate_size
    writer.add_feed_forward_length([width if kind in ("mlp", "moe", "mtp") else 0 for kind in kinds])
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv([c.num_key_value_heads if kind in ("full_attention", "mtp") else 0 for kind in kinds])
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_eps(c.layer_norm_epsilon)
    if rms_epsilon:
        writer.add_layer_norm_rms_eps(c.layer_norm_epsilon)
    writer.add_vocab_size(c.vocab_size)
    _add_mamba2_keys(writer, c.conv_kernel, c.ssm_state_size, c.n_groups, c.mamba_num_heads * c.mamba_head_dim, c.mamba_num_heads)
    if moe:
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(c.moe_shared_expert_intermediate_size)
        writer.add_expert_count(c.n_routed_experts)
        writer.add_expert_shared_count(c.n_shared_experts)
        writer.add_expert_weights_norm(c.norm_topk_prob)
        writer.add_expert_weights_scale(c.routed_scaling_factor)
        writer.add_expert_group_count(c.n_group)
    _copy_tokenizer(writer, GGUFFile(tokenizer_gguf).metadata)

    def add(name: str, values: np.ndarray, matmul: bool) -> None:
        _add_float_or_quantized(writer, name, values, embedding_type if name == "token_embd.weight" else matmul_type if matmul else Q.F32)

    for name, tensor in hf_model.state_dict().items():
        values = tensor.detach().float().numpy().copy()
        if name in _NEMOTRON_H_GLOBALS:
            add(_NEMOTRON_H_GLOBALS[name], values, name == "lm_head.weight")
            continue
        _, _, layer, rest = name.split(".", 3)
        stem = f"blk.{layer}"
        if kinds[int(layer)] == "linear_attention" and rest.startswith("mixer."):
            part = rest[len("mixer.") :]
            add(f"{stem}.{_HYBRID_MAMBA[part]}", _llama_cpp_mamba2(part, values, c.n_groups), part.endswith("proj.weight"))
            continue
        if rest in ("mixer.q_proj.weight", "mixer.k_proj.weight"):  # llama.cpp's interleaved RoPE rows (NoPE: the scores do not move)
            heads = c.num_attention_heads if "q_proj" in rest else c.num_key_value_heads
            values = values.reshape(heads, 2, -1, values.shape[-1]).swapaxes(1, 2).reshape(values.shape)
        matmul = rest.endswith(("_proj.weight", "experts.up_proj", "experts.down_proj"))
        add(f"{stem}.{_NEMOTRON_H_PARTS[rest]}", values, matmul)
    return _finish(writer, path)


def write_falcon_h1_gguf(path: Path, hf_model, tokenizer_gguf: Path, matmul_type: gguf.GGMLQuantizationType = Q.F32,
                         embedding_type: gguf.GGMLQuantizationType = Q.F32) -> Path:  # fmt: skip
    """A GGUF of transformers' FalconH1ForCausalLM as llama.cpp's converter writes it (`falcon-h1`):
    every µP multiplier folded into its tensor (the embedding's and the head's too), q and k rows as
    they are (llama.cpp turns Falcon-H1 by NeoX halves), mamba2's tensors as granitehybrid's, the
    feed-forward norm as ffn_norm (no .weight, as the converter names it) and the final one as output_norm; projections in `matmul_type`, the
    token embedding in `embedding_type`."""
    from kvgen.loading.gguf_file import GGUFFile

    c = hf_model.config
    writer = gguf.GGUFWriter(str(path), "falcon-h1")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_vocab_size(c.vocab_size)
    _add_mamba2_keys(writer, c.mamba_d_conv, c.mamba_d_state, c.mamba_n_groups, c.mamba_d_ssm, c.mamba_n_heads)
    _copy_tokenizer(writer, GGUFFile(tokenizer_gguf).metadata)

    def add(name: str, values: np.ndarray, matmul: bool) -> None:
        _add_float_or_quantized(writer, name, values, embedding_type if name == "token_embd.weight" else matmul_type if matmul else Q.F32)

    inner, grouped = c.mamba_d_ssm, c.mamba_n_groups * c.mamba_d_state
    sections = [(c.ssm_multipliers[0], inner), (c.ssm_multipliers[1], inner), (c.ssm_multipliers[2], grouped),
                (c.ssm_multipliers[3], grouped), (c.ssm_multipliers[4], c.mamba_n_heads)]  # fmt: skip
    in_rows = np.concatenate([np.full(width, value, dtype=np.float32) for value, width in sections]) * c.ssm_in_multiplier
    scales = {"self_attn.q_proj.weight": c.attention_in_multiplier, "self_attn.k_proj.weight": c.attention_in_multiplier * c.key_multiplier,
              "self_attn.v_proj.weight": c.attention_in_multiplier, "self_attn.o_proj.weight": c.attention_out_multiplier,
              "feed_forward.gate_proj.weight": c.mlp_multipliers[0], "feed_forward.down_proj.weight": c.mlp_multipliers[1],
              "mamba.out_proj.weight": c.ssm_out_multiplier}  # fmt: skip
    # llama.cpp's converter maps pre_ff_layernorm.weight as a whole, so the tensor is blk.N.ffn_norm, no suffix
    names = {"input_layernorm.weight": "attn_norm.weight", "pre_ff_layernorm.weight": "ffn_norm",
             "feed_forward.gate_proj.weight": "ffn_gate.weight", "feed_forward.up_proj.weight": "ffn_up.weight",
             "feed_forward.down_proj.weight": "ffn_down.weight", "self_attn.q_proj.weight": "attn_q.weight",
             "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.o_proj.weight": "attn_output.weight"}  # fmt: skip
    for name, tensor in hf_model.state_dict().items():
        values = tensor.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", values * c.embedding_multiplier, True)
        elif name == "lm_head.weight":
            add("output.weight", values * c.lm_head_multiplier, True)
        elif name == "model.final_layernorm.weight":
            add("output_norm.weight", values, False)
        elif name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            values = values * scales.get(rest, 1.0)
            if rest.startswith("mamba."):
                part = rest[len("mamba.") :]
                if part == "in_proj.weight":
                    values = values * in_rows[:, None]
                add(f"blk.{layer}.{_HYBRID_MAMBA[part]}", _llama_cpp_mamba2(part, values, c.mamba_n_groups), part.endswith("proj.weight"))
            else:
                add(f"blk.{layer}.{names[rest]}", values, rest.endswith("proj.weight"))
    return _finish(writer, path)
