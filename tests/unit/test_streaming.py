"""Streaming: the callback sees what the iterator yields; a failing callback frees the request's cache."""

from __future__ import annotations

import pytest

from kvgen import CacheConfig, SamplingParams
from kvgen.generate import Chunk, Generator


class Boom(RuntimeError):
    pass


@pytest.fixture
def paged(smollm2) -> Generator:
    return Generator(smollm2.model, smollm2.tokenizer, cache=CacheConfig(kind="paged", budget_mb=8, block_size=4))


def test_callback_sees_every_chunk_the_iterator_yields(smollm2) -> None:
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    seen: list[Chunk] = []
    result = smollm2.generate("Once upon a time", params, on_chunk=seen.append)
    stream = smollm2.stream("Once upon a time", params)
    assert list(stream) == seen
    assert "".join(c.text for c in seen) == result.text and [c.token_id for c in seen] == result.token_ids


def test_exception_in_callback_stops_and_frees_the_paged_cache(paged: Generator) -> None:
    calls: list[int] = []

    def explode_on_third(chunk: Chunk) -> None:
        calls.append(chunk.token_id)
        if len(calls) == 3:
            raise Boom("client went away")

    list(paged.stream("warm", SamplingParams(max_new_tokens=1)))  # creates the pool
    pool = paged.caches.paged_storage.pool
    free_before = pool.num_free
    with pytest.raises(Boom, match="client went away"):
        paged.generate("Once upon a time there was", SamplingParams(max_new_tokens=40, ignore_eos=True), on_chunk=explode_on_third)
    assert len(calls) == 3  # generation stopped at once
    assert pool.num_free == free_before
    pool.check_invariants()


def test_abandoned_stream_frees_the_paged_cache(paged: Generator) -> None:
    list(paged.stream("warm", SamplingParams(max_new_tokens=1)))
    pool = paged.caches.paged_storage.pool
    free_before = pool.num_free
    stream = paged.stream("Once upon a time there was", SamplingParams(max_new_tokens=40, ignore_eos=True))
    next(stream), next(stream)
    assert pool.num_free < free_before
    stream.close()
    assert pool.num_free == free_before


def test_n_samples_free_every_fork(paged: Generator) -> None:
    list(paged.stream("warm", SamplingParams(max_new_tokens=1)))
    pool = paged.caches.paged_storage.pool
    free_before = pool.num_free
    samples = paged.generate_n("Once upon a time", SamplingParams(max_new_tokens=5, temperature=1.0, seed=1, n=2))
    assert len(samples) == 2 and pool.num_free == free_before
