"""LoRA on mixtures of experts: adapters on attention apply as peft applies them, on the torch path
and in the C steps; one that changes a mixture's MLP is refused before anything changes. A random
tiny Qwen3-MoE that transformers builds (layer 0 a mixture, layer 1 dense), the adapters made by peft."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvgen.llm import LLM
from kvgen.lora.adapter import AdapterError
from kvgen.sampling.params import SamplingParams
from tests.support.lora import save_halved_peft_adapter
from tests.support.tiny_hf import save_tiny_decoder, tokenizer_folder

pytestmark = pytest.mark.slow
PROMPT = [1, 450, 3000, 42, 77, 12, 999, 4, 31, 2001]
# name -> peft LoraConfig settings: attention everywhere; the dense layer's MLP (with attention)
ADAPTERS = {"attention": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
            "qv": {"target_modules": ["q_proj", "v_proj"], "r": 8}}  # fmt: skip


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[Path, torch.Tensor]]]:
    """The tiny model's folder, and per adapter its folder and peft's logits over PROMPT."""
    root = tmp_path_factory.mktemp("moe-lora")
    model = save_tiny_decoder("qwen3-moe", root / "model", tokenizer_folder(root / "tokenizer"))
    adapters = {}
    for i, (name, settings) in enumerate(ADAPTERS.items()):
        model, logits = save_halved_peft_adapter(model, root / name, PROMPT, i, **{"r": 4, "lora_alpha": 8, **settings})
        adapters[name] = (root / name, logits)
    return root / "model", adapters


def logits(llm: LLM, adapter: str | None) -> torch.Tensor:
    cache = llm.generator.new_cache(len(PROMPT) + 1)
    with torch.inference_mode():
        return llm.model(torch.tensor([PROMPT]), cache, logits_to_keep=None, adapter=adapter)[0]


def test_adapters_on_a_mixtures_attention_and_dense_mlps_match_peft(moe) -> None:
    folder, adapters = moe
    llm = LLM.load(folder, progress=False, weights="fp32")
    base = logits(llm, None)
    for name, (path, expected) in adapters.items():
        llm.load_adapter(name, path)
        assert (expected - base).abs().max().item() > 0.05, f"{name} changes nothing: a vacuous check"
        assert (logits(llm, name) - expected).abs().max().item() < 2e-3, name


def test_the_c_steps_apply_them_as_the_torch_path(moe) -> None:
    """int8 weights: the C steps (batch-1 and the rows step of a prompt) give the torch path's
    greedy tokens under each adapter, and without one the base model's."""
    from kvgen.kernels import load

    if load() is None:
        pytest.skip("the C decode path needs a C compiler")
    folder, adapters = moe
    llm = LLM.load(folder, progress=False, weights="int8")
    assert llm.model.fast_decoder() is not None
    for name, (path, _) in adapters.items():
        llm.load_adapter(name, path)
    for adapter in [None, *adapters]:
        params = SamplingParams(max_new_tokens=24, ignore_eos=True, adapter=adapter)
        fast = llm.generate(PROMPT, params).token_ids
        llm.model.use_fast_decode = False
        try:
            assert llm.generate(PROMPT, params).token_ids == fast, adapter
        finally:
            llm.model.use_fast_decode = True


def test_an_adapter_on_a_mixtures_mlp_is_refused_and_changes_nothing(moe, tmp_path: Path) -> None:
    """An adapter made for a dense model (gate_proj of layer 0, here a mixture) on this base:
    refused, naming the layer; the adapter loaded before it and its outputs stay as they were."""
    folder, adapters = moe
    source = adapters["qv"][0]
    wrong = tmp_path / "wrong-base"
    shutil.copytree(source, wrong)
    tensors = load_file(str(source / "adapter_model.safetensors"))
    stem = "base_model.model.model.layers.0.mlp.gate_proj"
    tensors |= {f"{stem}.lora_A.weight": torch.randn(8, 64), f"{stem}.lora_B.weight": torch.randn(128, 8)}
    save_file(tensors, str(wrong / "adapter_model.safetensors"))
    config = json.loads((source / "adapter_config.json").read_text())
    (wrong / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "v_proj", "gate_proj"]}))
    llm = LLM.load(folder, progress=False, weights="fp32")
    llm.load_adapter("attention", adapters["attention"][0])
    before = logits(llm, "attention")
    with pytest.raises(AdapterError, match="changes the MLP of layer 0, a mixture of experts"):
        llm.load_adapter("wrong-base", wrong)
    assert llm.adapters.names() == ["attention"]
    assert torch.equal(logits(llm, "attention"), before)
