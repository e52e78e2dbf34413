"""Writes small random-weight GGUF files with gguf-py's writer, for format and error tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

BYTE_ALPHABET_SIZE = 256


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


def write_tiny_gguf(
    path: Path,
    architecture: str = "llama",
    weight_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    hidden: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    declare_as: gguf.GGMLQuantizationType | None = None,
) -> Path:
    """A 2-layer Llama-shaped model with a byte-level vocabulary (256 bytes + <|endoftext|>).

    `declare_as` labels the quantized matrices with another type of the same block size (e.g. Q4_0
    bytes declared IQ4_NL) to produce a file with a type kvgen does not load.
    """
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
    writer.add_tokenizer_model("gpt2")
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
        if quantize and weight_type != gguf.GGMLQuantizationType.F32:
            packed = gguf.quants.quantize(values, weight_type)
            writer.add_tensor(name, packed, raw_dtype=declare_as or weight_type)
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
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
