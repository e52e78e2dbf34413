"""The ONNX Runtime GenAI builder wrapper's config fix (benchmarks/peers/ortgenai_builder.py): Gemma 3's
per-layer-type RoPE settings, as transformers 5 writes them, go back to the flat form the builder
reads, with the same two bases; other configs pass through untouched."""

import importlib.util
from pathlib import Path

import pytest
from transformers import Gemma3TextConfig, LlamaConfig

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "peers" / "ortgenai_builder.py"
_spec = importlib.util.spec_from_file_location("ortgenai_builder", _PATH)
ortgenai_builder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ortgenai_builder)


def test_gemma3_rope_per_layer_type_becomes_flat() -> None:
    config = Gemma3TextConfig(num_hidden_layers=6)  # transformers 5: one RoPE dict per layer type
    assert set(config.rope_parameters) == {"full_attention", "sliding_attention"}
    full = config.rope_parameters["full_attention"]["rope_theta"]
    sliding = config.rope_parameters["sliding_attention"]["rope_theta"]
    assert full != sliding
    flat = ortgenai_builder.flatten_rope(config)
    assert flat.rope_parameters == {"rope_theta": full, "rope_type": "default"}
    assert flat.rope_theta == full and flat.rope_local_base_freq == sliding
    assert flat.layer_types == Gemma3TextConfig(num_hidden_layers=6).layer_types  # which layers slide: unchanged


def test_flat_rope_passes_through() -> None:
    config = LlamaConfig(num_hidden_layers=2)
    before = dict(config.rope_parameters)
    assert ortgenai_builder.flatten_rope(config).rope_parameters == before


def test_scaled_rope_per_layer_type_is_refused() -> None:
    config = Gemma3TextConfig(num_hidden_layers=6)
    config.rope_parameters["full_attention"] = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    with pytest.raises(ValueError, match="only default RoPE"):
        ortgenai_builder.flatten_rope(config)
