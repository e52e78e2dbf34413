"""Session: turns reuse the cache, fork branches it copy-on-write, rewind drops tokens or turns, and
sessions in different threads do not disturb each other. All on the real SmolLM2."""

from __future__ import annotations

import threading

import pytest

from kvgen import CacheConfig, SamplingParams
from kvgen.generate import Generator
from kvgen.session import Session

PARAMS = SamplingParams(max_new_tokens=8)


def run_turns(generator: Generator, messages: list[str]) -> list[list[int]]:
    session = Session(generator)
    outputs = []
    for message in messages:
        list(session.chat(message, PARAMS))
        outputs.append(session.last_result.token_ids)
    return outputs


def test_fork_shares_blocks_and_both_branches_equal_fresh_runs(smollm2) -> None:
    generator = Generator(smollm2.model, smollm2.tokenizer, cache=CacheConfig(kind="paged", budget_mb=16, block_size=4))
    session = Session(generator)
    list(session.chat("Name a fruit.", PARAMS))
    pool = session.cache.storage.pool
    used_before = pool.num_blocks - pool.num_free
    branch = session.fork()
    assert pool.num_blocks - pool.num_free == used_before  # copy-on-write: no block copied yet
    assert branch.cached_ids == session.cached_ids and branch.messages == session.messages
    list(session.chat("Name a vegetable.", PARAMS))
    list(branch.chat("Name a color.", PARAMS))
    for s in (session, branch):
        prompt = smollm2.tokenizer.apply_chat_template(s.messages[:-1])
        fresh = smollm2.generate(smollm2.tokenizer.encode(prompt, add_special_tokens=False), PARAMS)
        assert s.last_result.token_ids == fresh.token_ids
        assert s.last_result.usage.cached_tokens > 0
    assert session.messages[2]["content"] == "Name a vegetable." and branch.messages[2]["content"] == "Name a color."
    session.close(), branch.close()
    assert pool.num_free == pool.num_blocks
    pool.check_invariants()


def test_rewind_turns_then_continue_equals_a_fresh_conversation(smollm2) -> None:
    session = smollm2.session()
    list(session.chat("Name a fruit.", PARAMS))
    first_ids = session.cached_ids
    list(session.chat("Name a vegetable.", PARAMS))
    session.rewind(num_turns=1)
    assert [m["content"] for m in session.messages][0] == "Name a fruit." and len(session.messages) == 2
    kept = smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(session.messages, add_generation_prompt=False),
                                    add_special_tokens=False)  # fmt: skip
    assert len(first_ids) <= session.cache.seq_len <= len(kept)  # the second turn is gone, the first stays
    assert session.cached_ids == kept[: session.cache.seq_len]
    list(session.chat("Name a color.", PARAMS))
    prompt = smollm2.tokenizer.apply_chat_template(session.messages[:-1])
    prompt_ids = smollm2.tokenizer.encode(prompt, add_special_tokens=False)
    assert session.last_result.token_ids == smollm2.generate(prompt_ids, PARAMS).token_ids
    assert session.last_result.usage.cached_tokens >= len(first_ids) - 2  # the first turn was not recomputed


def test_rewind_tokens_and_bad_arguments(smollm2) -> None:
    session = smollm2.session()
    ids = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    list(session.stream(ids, PARAMS))
    held = session.cached_ids
    session.rewind(num_tokens=3)
    assert session.cached_ids == held[:-3] and session.cache.seq_len == len(held) - 3
    for kwargs, message in (({}, "exactly one of"), ({"num_tokens": 10_000}, r"num_tokens must be in \[0, "),
                            ({"num_turns": 1}, r"num_turns must be in \[0, 0\]")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            session.rewind(**kwargs)
    assert session.cached_ids == held[:-3]  # a bad call changed nothing
    stream = session.stream(held, PARAMS)  # the same tokens again: only the 3 dropped ones are recomputed
    list(stream)
    assert stream.result.usage.cached_tokens == len(held) - 3 and stream.result.timings.prefill_tokens == 3
    assert stream.result.token_ids == smollm2.generate(held, PARAMS).token_ids


def test_sessions_in_threads_are_isolated(smollm2) -> None:
    conversations = {"a": ["Name a fruit.", "Name another."], "b": ["What is 2+2?", "And 3+3?"]}
    alone = {key: run_turns(smollm2.generator, messages) for key, messages in conversations.items()}
    together: dict[str, list[list[int]]] = {}
    barrier = threading.Barrier(2)

    def worker(key: str) -> None:
        session = Session(smollm2.generator)
        outputs = []
        for message in conversations[key]:
            barrier.wait()  # both sessions take each turn at the same time: their steps interleave
            list(session.chat(message, PARAMS))
            outputs.append(session.last_result.token_ids)
        together[key] = outputs

    threads = [threading.Thread(target=worker, args=(key,)) for key in conversations]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert together == alone


def test_second_turn_prefill_count(smollm2) -> None:
    session = smollm2.session()
    list(session.chat("Name a fruit.", PARAMS))
    cached_after_first = len(session.cached_ids)
    list(session.chat("Name a vegetable.", PARAMS))
    turn = session.last_result
    assert turn.timings.prefill_tokens == turn.usage.prompt_tokens - turn.usage.cached_tokens
    assert turn.usage.cached_tokens >= cached_after_first - 1
