"""kvgen's LoRA vs transformers + peft on the same base weights: logits and greedy tokens (fp32),
KL divergence on 4-bit weights, and a GGUF LoRA file of the same adapter."""

from __future__ import annotations

import pytest
import torch

from kvgen import SamplingParams
from kvgen.lora.gguf_lora import write_gguf_lora
from tests.conftest import load_llm, load_reference
from tests.lora.conftest import PROMPT, peft_adapters

pytestmark = pytest.mark.slow
LOGIT_TOLERANCE = 2e-3  # fp32: the base model's parity bar with the delta's extra rounding
Q4_MEAN_KLD = 0.05  # 4-bit weights: mean KL(peft fp32 || kvgen q4) over the prompt's positions


def kvgen_logits(llm, ids: list[int], adapter: str | None) -> torch.Tensor:
    cache = llm.generator.new_cache(len(ids) + 1)
    try:
        with torch.inference_mode():
            return llm.model(torch.tensor([ids]), cache, logits_to_keep=None, adapter=adapter)[0]
    finally:
        cache.release()


def greedy(llm, ids: list[int], adapter: str | None, new_tokens: int, model_name: str = "smollm2") -> list[int]:
    """kvgen's greedy tokens, stopping on exactly the EOS ids transformers stops on."""
    eos = load_reference(model_name)[0].generation_config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, stop_token_ids=eos_ids, adapter=adapter)
    return llm.generate(ids, params).token_ids


@pytest.mark.parametrize("model_name", ["smollm2", "gemma3-270m"])
def test_logits_and_greedy_tokens_match_peft(model_name: str, lora_dir) -> None:
    llm, adapters = load_llm(model_name), peft_adapters(model_name, lora_dir)
    base_logits = kvgen_logits(llm, adapters[next(iter(adapters))].prompt_ids, None)
    try:
        for name, ref in adapters.items():
            llm.load_adapter(name, ref.path)
        for name, ref in adapters.items():
            logits = kvgen_logits(llm, ref.prompt_ids, name)
            assert (logits - ref.logits).abs().max().item() < LOGIT_TOLERANCE, name
            assert (ref.logits - base_logits).abs().max().item() > 0.1, f"{name} changes nothing: a vacuous check"
            assert greedy(llm, ref.prompt_ids, name, len(ref.greedy), model_name) == ref.greedy, name
    finally:
        for name in adapters:
            llm.unload_adapter(name)


def test_rows_with_different_adapters_in_one_forward_match_each_alone(smollm2_adapters) -> None:
    llm, adapters = smollm2_adapters
    names = [None, *adapters, None]
    prompts = [llm.tokenizer.encode(p) for p in (PROMPT, "The three primary colors are", "def f(x):", "In a distant galaxy", "Hello", "A B C")]
    alone = [kvgen_logits(llm, ids, name)[-1] for ids, name in zip(prompts, names)]
    caches = [llm.generator.caches.new_cache(64) for _ in prompts]
    with torch.inference_mode():
        batched = llm.model.forward_batch(prompts, caches, adapters=names)  # [B, V]
    for cache in caches:
        cache.release()
    for row, (want, name) in enumerate(zip(alone, names)):
        assert (batched[row] - want).abs().max().item() < 1e-4, (row, name)


def test_four_bit_weights_stay_within_the_stated_kld(smollm2_adapters, smollm2_q4) -> None:
    _, adapters = smollm2_adapters
    ref = adapters["all-r8-rs"]
    smollm2_q4.load_adapter("all-r8-rs", ref.path)
    try:
        logits = kvgen_logits(smollm2_q4, ref.prompt_ids, "all-r8-rs")
    finally:
        smollm2_q4.unload_adapter("all-r8-rs")
    kld = torch.nn.functional.kl_div(logits.log_softmax(-1), ref.logits.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    assert kld.mean().item() < Q4_MEAN_KLD, kld


def test_a_gguf_lora_file_of_the_adapter_gives_the_same_tokens(smollm2_adapters, lora_dir) -> None:
    llm, adapters = smollm2_adapters
    ref = adapters["all-r8-rs"]
    path = lora_dir / "all-r8-rs.gguf"
    write_gguf_lora(llm.adapters._entries["all-r8-rs"].adapter, llm.config, path, alpha=16.0)
    llm.load_adapter("from-gguf", path)
    try:
        assert (kvgen_logits(llm, ref.prompt_ids, "from-gguf") - ref.logits).abs().max().item() < LOGIT_TOLERANCE
        assert greedy(llm, ref.prompt_ids, "from-gguf", len(ref.greedy)) == ref.greedy
    finally:
        llm.unload_adapter("from-gguf")
