"""Grammar-aware speculation: drafts and verification masked by a stateful constraint give exactly
the tokens of plain masked greedy decoding, and the constraint ends advanced past exactly those."""

from __future__ import annotations

import pytest
import torch

from kvgen import LLM, SamplingParams, SpeculativeConfig
from kvgen.sampling.sampler import Sampler
from kvgen.speculative.decoder import SpeculativeDecoder
from tests.speculative.constraints import NoRepeatFromSet
from tests.support.tiny_gguf import write_tiny_gguf


@torch.inference_mode()
def plain_masked_greedy(llm: LLM, prompt: list[int], constraint: NoRepeatFromSet, count: int) -> list[int]:
    cache = llm.generator.new_cache(len(prompt) + count)
    llm.model(torch.tensor([prompt[:-1]]), cache)
    out, token = [], prompt[-1]
    for _ in range(count):
        logits = llm.model(torch.tensor([[token]]), cache)[0, -1]
        token = int(torch.argmax(logits.masked_fill(~constraint.allowed_mask(logits.shape[-1]), float("-inf"))))
        assert constraint.advance(token)
        out.append(token)
    return out


@torch.inference_mode()
def speculative_masked_greedy(llm: LLM, prompt: list[int], constraint: NoRepeatFromSet, count: int,
                              config: SpeculativeConfig) -> tuple[list[int], SpeculativeDecoder]:  # fmt: skip
    cache = llm.generator.new_cache(len(prompt) + count + 16)
    llm.model(torch.tensor([prompt[:-1]]), cache)
    sampler = Sampler(SamplingParams(), constraint=constraint)
    decoder = SpeculativeDecoder(llm.model, cache, config.build_proposer(llm.generator), sampler, config,
                                 llm.generator.max_context)  # fmt: skip
    decoder.start(prompt)
    out: list[int] = []
    while len(out) < count:
        out += decoder.step(count - len(out))
    decoder.proposer.release()
    return out, decoder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return LLM.load(write_tiny_gguf(tmp_path_factory.mktemp("constraint") / "tiny.gguf"), progress=False, weights="fp32")


@pytest.mark.parametrize("method", ["lookup", "self"])
def test_constrained_speculation_equals_constrained_greedy_on_a_tiny_model(tiny, method):
    prompt = tiny.tokenizer.encode("abcabdabcabdabcabd")
    allowed = set(prompt) | set(tiny.tokenizer.encode("e", add_special_tokens=False))
    config = SpeculativeConfig(method, draft_layers=1) if method == "self" else SpeculativeConfig(method)
    reference = plain_masked_greedy(tiny, prompt, NoRepeatFromSet(allowed), 24)
    constraint = NoRepeatFromSet(allowed)
    tokens, decoder = speculative_masked_greedy(tiny, prompt, constraint, 24, config)
    assert tokens == reference
    assert constraint.consumed == tokens  # drafts were rolled back; only emitted tokens remain
    assert decoder.stats.proposed_tokens > 0


@pytest.mark.slow
def test_constrained_speculation_equals_constrained_greedy_on_smollm2(smollm2):
    prompt = smollm2.tokenizer.encode("Colors: red, green, blue, red, green, blue, red, green,")
    allowed = set(prompt)
    config = SpeculativeConfig("lookup")
    reference = plain_masked_greedy(smollm2, prompt, NoRepeatFromSet(allowed), 16)
    constraint = NoRepeatFromSet(allowed)
    tokens, decoder = speculative_masked_greedy(smollm2, prompt, constraint, 16, config)
    assert tokens == reference and constraint.consumed == tokens
    assert decoder.stats.accepted_tokens > 0
