"""A Hugging Face folder (config.json + safetensors + tokenizer.json) written from the GGUF weights by
transformers' own save_pretrained: kvgen must load it and match the reference exactly like the GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvgen import LLM
from tests.conftest import MODEL_NAMES, load_reference
from tests.parity.test_gguf_parity import LOGIT_TOLERANCE, NEW_TOKENS, kvgen_greedy, reference_greedy
from tests.support.models import PROMPTS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=MODEL_NAMES)
def hf_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name = request.param
    model, tokenizer = load_reference(name)
    folder = tmp_path_factory.mktemp(f"hf-{name}")
    write_hf_folder(model, tokenizer, folder)
    return name, folder


def write_hf_folder(model, tokenizer, folder: Path) -> None:
    """What save_pretrained writes; transformers refuses save_pretrained on a GGUF-loaded model."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shared with the embedding; safetensors stores it once
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str))
    tokenizer.save_pretrained(folder)


def test_hf_folder_matches_reference(hf_folder: tuple[str, Path]) -> None:
    from transformers import AutoTokenizer

    name, folder = hf_folder
    model, _ = load_reference(name)
    reference_tokenizer = AutoTokenizer.from_pretrained(folder)
    llm = LLM.load(folder, progress=False)
    assert any(folder.glob("*.safetensors")) and (folder / "tokenizer.json").is_file()
    for prompt in PROMPTS[:2]:
        ids = reference_tokenizer(prompt).input_ids
        assert llm.tokenizer.encode(prompt) == ids
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            expected_logits = model(input_ids).logits[0, -1]
            actual_logits = llm.model(input_ids, llm.generator.new_cache(len(ids)))[0, -1]
        assert (actual_logits - expected_logits).abs().max().item() < LOGIT_TOLERANCE
        assert kvgen_greedy(llm, model, ids, NEW_TOKENS) == reference_greedy(model, input_ids, NEW_TOKENS)
