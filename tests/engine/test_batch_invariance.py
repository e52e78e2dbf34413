"""Greedy output on the default weights does not depend on the decode batch: 24 requests of mixed
lengths, each arriving while the others decode, produce exactly the tokens they produce alone.

Why it holds: decodes always run the C step over every layer (kernels/decode.c), alone or batched,
and its one-row GEMV sums in the order of the tiled GEMM, so a row's logits are the same bits in a
batch of one or of 24; the engine runs one-token rows in their own forward, apart from prompt
chunks and speculative verifies (engine/runner.py). What stays variant: prompts prefilled in one
forward together (a padded batch, another GEMM shape) round differently from a prompt alone
(docs/engine.md, "Batch invariance"), and so does a prompt cut in chunks, so here each step
admits one new prompt and the step budget holds every prompt whole."""

from __future__ import annotations

import pytest
import torch

from kvgen import LLM, SamplingParams
from kvgen.engine import EngineConfig, LLMEngine, RequestStatus
from tests.support.models import PROMPTS, model_path
from tests.support.shakespeare import play_text

PARAMS = SamplingParams(max_new_tokens=27, ignore_eos=True)  # the first request is still decoding when the 24th arrives


def mixed_prompts(llm: LLM, count: int) -> list:
    """Chat-sized prompts, short snippets and a few hundred tokens of Hamlet."""
    ids = llm.tokenizer.encode(play_text("hamlet"))
    lengths = [5, 12, 40, 150, 120, 17, 70, 9]
    prompts: list = list(PROMPTS[:3])
    for i in range(count - len(prompts)):
        start = 97 * i
        prompts.append(ids[start : start + lengths[i % len(lengths)]])
    return prompts


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_24_concurrent_requests_equal_each_request_alone(name: str) -> None:
    llm = LLM.load(model_path(name), progress=False)  # the default weights (4-bit / 8-bit blocks)
    prompts = mixed_prompts(llm, 24)
    with torch.inference_mode():
        alone = [llm.generate(p, PARAMS).token_ids for p in prompts]
    engine = LLMEngine(llm, EngineConfig(kv_budget_mb=256, max_tokens_per_step=512, max_num_seqs=24))
    requests, waiting, most_running = [], list(enumerate(prompts)), 0
    while waiting or any(r.status is not RequestStatus.FINISHED for r in requests):
        if waiting:  # one arrival per step: its prefill overlaps the others' decodes
            i, prompt = waiting.pop(0)
            requests.append(engine.add_request(f"r{i}", prompt, PARAMS))
        engine.step()
        engine.check_invariants()
        most_running = max(most_running, len(engine.scheduler.running))
    assert most_running == 24  # all of them decoded together at the end
    different = [i for i, (r, a) in enumerate(zip(requests, alone)) if r.output_ids != a]
    assert not different, f"requests {different} differ from their run alone"
