"""peft adapters for the LoRA tests, made once per session on the shared reference models."""

from __future__ import annotations

import pytest

from tests.conftest import load_llm
from tests.support.lora import ALL_LINEARS, PeftAdapter, make_peft_adapter

PROMPT = "Once upon a time, there was a little girl who"
# name -> (rank, targets, alpha, rsLoRA): several ranks and target sets
SPECS = {
    "smollm2": {
        "all-r8-rs": (8, ALL_LINEARS, 16, True),
        "qv-r4": (4, ["q_proj", "v_proj"], 8, False),
        "mlp-o-r16": (16, ["o_proj", "gate_proj", "up_proj", "down_proj"], 32, False),
        "k-r2": (2, ["k_proj"], 4, False),
    },
    "gemma3-270m": {
        "all-r8-rs": (8, ALL_LINEARS, 16, True),
        "qvdown-r16": (16, ["q_proj", "v_proj", "down_proj"], 16, False),
    },
}
_made: dict[str, dict[str, PeftAdapter]] = {}


def peft_adapters(model_name: str, directory) -> dict[str, PeftAdapter]:
    if model_name not in _made:
        _made[model_name] = {
            name: make_peft_adapter(model_name, directory / f"{model_name}-{name}", PROMPT, rank, targets, alpha, rslora, seed=i)
            for i, (name, (rank, targets, alpha, rslora)) in enumerate(SPECS[model_name].items())
        }  # fmt: skip
    return _made[model_name]


@pytest.fixture(scope="session")
def lora_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def smollm2_adapters(lora_dir):
    """The shared fp32 SmolLM2 with SPECS' adapters loaded (unloaded afterwards); peft's outputs."""
    llm, adapters = load_llm("smollm2"), peft_adapters("smollm2", lora_dir)
    for name, adapter in adapters.items():
        llm.load_adapter(name, adapter.path)
    yield llm, adapters
    for name in adapters:
        llm.unload_adapter(name)


@pytest.fixture(scope="module")
def smollm2_q4_adapters(smollm2_q4, lora_dir):
    """The shared 4-bit SmolLM2 (the C decode steps' weights) with SPECS' adapters loaded."""
    adapters = peft_adapters("smollm2", lora_dir)
    for name, adapter in adapters.items():
        smollm2_q4.load_adapter(name, adapter.path)
    yield smollm2_q4, adapters
    for name in adapters:
        smollm2_q4.unload_adapter(name)
