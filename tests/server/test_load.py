"""Load: 64 concurrent streaming clients (openai client, one thread each) with mixed prompt and
output lengths, on a server whose KV pool is too small for all of them at once. Every stream
completes, at temperature 0 each equals the same request run alone, and no block is leaked
afterwards. Whether the burst preempts depends on the order the clients arrive in (finished
requests' blocks are evicted from the prefix cache first), so preemption itself is forced by
arithmetic in a second test: two requests that each fit the pool but not together."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import openai
import pytest

from kvgen import SamplingParams
from kvgen.engine.config import EngineConfig
from tests.server.live import MODEL_NAME, live_server
from tests.support.models import PROMPTS

NUM_CLIENTS = 64
NUM_PROMPTS = 16
MAX_TOKENS = 8


def wait_until(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the clients' requests did not all reach the server"
        time.sleep(0.05)


def mixed_prompts(llm) -> list[list[int]]:
    """16 token-id prompts of 4 to ~120 tokens, cut from one text at different offsets."""
    ids = llm.tokenizer.encode(" ".join(PROMPTS) * 8)
    return [ids[i * 7 : i * 7 + 4 + (i * 37) % 117] for i in range(NUM_PROMPTS)]


@pytest.mark.slow
def test_64_concurrent_streams_all_complete_and_equal_alone(smollm2) -> None:
    prompts = mixed_prompts(smollm2)
    alone = [smollm2.generate(p, SamplingParams(max_new_tokens=MAX_TOKENS)).token_ids for p in prompts]
    jobs = [(i % NUM_PROMPTS, 2 + i % (MAX_TOKENS - 1)) for i in range(NUM_CLIENTS)]  # (prompt, max_tokens)
    # 40 blocks of 16 tokens hold ~640 positions; the 64 requests need ~2,700 at once.
    config = EngineConfig(num_blocks=40, max_tokens_per_step=256, max_num_seqs=64)
    with live_server(smollm2, config) as live:
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0, timeout=600)

        def stream(job: tuple[int, int]) -> tuple[str, str | None, int]:
            prompt, max_tokens = job
            text, finish, usage = "", None, 0
            for chunk in client.completions.create(model=MODEL_NAME, prompt=prompts[prompt], max_tokens=max_tokens,
                                                   temperature=0, stream=True, stream_options={"include_usage": True}):  # fmt: skip
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
            return text, finish, usage

        with ThreadPoolExecutor(NUM_CLIENTS) as pool:
            # All 64 arrive before the engine takes any: on a slow machine requests trickling in
            # one by one could each finish before the pool fills, and nothing would be preempted.
            with live.engine.paused():
                futures = [pool.submit(stream, job) for job in jobs]
                wait_until(lambda: live.engine.num_queued_commands() >= NUM_CLIENTS, timeout=120)
            results = [future.result() for future in futures]
        live.assert_no_leaks()
    eos = set(smollm2.tokenizer.eos_token_ids)
    for (prompt, max_tokens), (text, finish, completion_tokens) in zip(jobs, results):
        expected = alone[prompt][:max_tokens]  # greedy: a shorter run is a prefix of the longer one
        stopped = expected[-1] in eos
        assert text == smollm2.tokenizer.decode([t for t in expected if t not in eos]), (prompt, max_tokens)
        assert finish == ("stop" if stopped else "length") and completion_tokens == len(expected)


@pytest.mark.slow
def test_two_streams_that_cannot_fit_together_preempt_and_lose_nothing(smollm2) -> None:
    """Pool of 6 blocks x 16. Two prompts of exactly 2 full blocks, 40 tokens each: both are admitted
    at once (4 blocks), each needs 5 blocks by its end, so one must be preempted and recompute."""
    prompts = [smollm2.tokenizer.encode(text)[:32] for text in (" ".join(PROMPTS) * 4, " ".join(reversed(PROMPTS)) * 4)]
    assert all(len(p) == 32 for p in prompts)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    alone = [smollm2.generate(p, params).text for p in prompts]
    config = EngineConfig(num_blocks=6, block_size=16, max_tokens_per_step=256)
    with live_server(smollm2, config) as live:
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0, timeout=600)

        def stream(prompt: list[int]) -> str:
            chunks = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})  # fmt: skip
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with ThreadPoolExecutor(2) as pool:
            with live.engine.paused():  # both reach the scheduler in the same step
                futures = [pool.submit(stream, p) for p in prompts]
                wait_until(lambda: live.engine.num_queued_commands() >= 2, timeout=120)
            texts = [future.result() for future in futures]
        live.assert_no_leaks()
        preemptions = live.engine.run_locked(lambda e: e.scheduler.num_preemptions)
    assert preemptions > 0
    assert texts == alone
