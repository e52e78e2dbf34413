"""Architectures with no real model available offline (Qwen2, Mistral, Llama 3 RoPE scaling):
kvgen against transformers on small random-weight models that transformers itself saved.

This is the only evidence for these paths; SmolLM2 and Gemma 3 are tested on real weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvgen import LLM, SamplingParams
from tests.support.tiny_hf import tokenizer_folder

pytestmark = pytest.mark.slow

ARCHITECTURES = {
    "qwen2-bias": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "llama3-rope": ("LlamaConfig", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "llama-linear-rope": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_random_weight_model_matches_transformers(name: str, tokenizer_files: Path, tmp_path: Path) -> None:
    import shutil

    import transformers

    config_class, extra = ARCHITECTURES[name]
    config = getattr(transformers, config_class)(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random init is tiny; widen it so rounding differences would show
        for parameter in model.parameters():
            parameter.normal_(0, 0.2)
    model.save_pretrained(tmp_path)
    for file in tokenizer_files.iterdir():
        shutil.copy(file, tmp_path / file.name)
    llm = LLM.load(tmp_path, progress=False, weights="fp32")
    assert llm.config.architecture == {"Qwen2Config": "qwen2", "MistralConfig": "mistral"}.get(config_class, "llama")
    ids = llm.tokenizer.encode("The three primary colors are red, yellow and blue, and when they are mixed")
    with torch.inference_mode():
        expected = model(torch.tensor([ids])).logits[0, -1]
        actual = llm.model(torch.tensor([ids]), llm.generator.new_cache(len(ids)))[0, -1]
        reference = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert (actual - expected).abs().max().item() < 1e-3
    result = llm.generate(ids, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert result.token_ids == reference[0, len(ids):].tolist()
