"""GGUF tensor formats: every supported type decodes like an independent implementation.

kvgen dequantizes with gguf-py (llama.cpp's reference Python); transformers ships a separate torch
implementation of the same formats, which serves as the check for the types it has.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvgen.loading.gguf import SUPPORTED_TENSOR_TYPES, load_gguf
from kvgen.loading.gguf_file import GGUFFile
from tests.support.tiny_gguf import write_tiny_gguf

Q = gguf.GGMLQuantizationType
BLOCK_TYPES_IN_TRANSFORMERS = ["Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
ROUND_TRIP_TYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


def random_blocks(qtype: gguf.GGMLQuantizationType, num_blocks: int, seed: int = 0) -> np.ndarray:
    """Random block bytes whose fp16 scale fields hold small finite values (random bits can be NaN)."""
    rng = np.random.default_rng(seed)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    scale = np.array([0.01], dtype=np.float16).view(np.uint8)
    # Where each format keeps its fp16 scales: d (and m/dmin) at the start, or at the end for Q6_K/Q3_K.
    offsets = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q2_K": [type_size - 4, type_size - 2],
               "Q3_K": [type_size - 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [type_size - 2]}[qtype.name]  # fmt: skip
    for offset in offsets:
        blocks[:, offset : offset + 2] = scale
    return blocks


@pytest.mark.parametrize("type_name", BLOCK_TYPES_IN_TRANSFORMERS)
def test_gguf_dequantize_matches_transformers_implementation(type_name: str) -> None:
    from transformers.integrations.gguf.dequant import dequantize as reference_dequantize

    qtype = Q[type_name]
    blocks = random_blocks(qtype, num_blocks=64)
    ours = gguf.quants.dequantize(blocks, qtype).reshape(-1)
    theirs = reference_dequantize(torch.from_numpy(blocks.reshape(-1).copy()), int(qtype)).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("type_name", ROUND_TRIP_TYPES)
def test_quantized_tiny_model_loads_within_quantization_error(type_name: str, tmp_path: Path) -> None:
    exact = load_gguf(write_tiny_gguf(tmp_path / "f32.gguf"), progress=False).tensors
    loaded = load_gguf(write_tiny_gguf(tmp_path / "q.gguf", weight_type=Q[type_name]), progress=False).tensors
    # Worst-case step of each format for weights of scale ~0.05 (4-bit: 1/16 of the block range).
    tolerance = {"F16": 1e-4, "BF16": 1e-3, "Q8_0": 2e-3, "Q5_0": 2e-2, "Q5_1": 2e-2, "Q4_0": 4e-2, "Q4_1": 4e-2}
    for name, weight in exact.items():
        assert loaded[name].dtype == torch.float32
        error = (loaded[name] - weight).abs().max().item()
        assert error <= tolerance[type_name], (name, error)
        if type_name != "F16" and weight.dim() == 2:
            assert error > 0  # really quantized, not stored as float


def test_supported_types_are_all_known_to_gguf() -> None:
    for name in SUPPORTED_TENSOR_TYPES:
        assert Q[name] in gguf.GGML_QUANT_SIZES


def test_container_reader_agrees_with_gguf_py(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", weight_type=Q.Q4_1)
    ours, reference = GGUFFile(path), gguf.GGUFReader(path)
    metadata = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == metadata
    for tensor in reference.tensors:
        info = ours.tensors[tensor.name]
        assert info.shape == tuple(int(d) for d in reversed(tensor.shape))
        assert ours.raw(info).tobytes() == tensor.data.tobytes()
