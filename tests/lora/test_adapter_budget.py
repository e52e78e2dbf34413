"""The adapter registry's RAM budget: loading past it evicts the least recently used adapters that no
request holds; an evicted adapter is read again on its next use and gives the same tokens; adapters in
use are never evicted, and a load that cannot fit beside them is refused with nothing changed. Also
the per-adapter counters."""

from __future__ import annotations

import dataclasses

import pytest

from kvgen import SamplingParams
from kvgen.lora import AdapterError
from tests.conftest import load_llm
from tests.lora.conftest import peft_adapters
from tests.support.models import PROMPTS

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)


def resident(registry) -> list[str]:
    return [name for name, info in registry.info().items() if info["resident"]]


def test_the_budget_evicts_idle_adapters_least_recently_used_first(lora_dir) -> None:
    llm, path = load_llm("smollm2"), peft_adapters("smollm2", lora_dir)["all-r8-rs"].path
    registry = llm.adapters
    assert registry.names() == []  # the other modules' adapters are unloaded
    try:
        llm.load_adapter("a", path)
        size = registry.info()["a"]["bytes"]
        registry.set_budget(2.5 * size / 2**20)  # room for two
        want = llm.generate(PROMPTS[0], _with(PARAMS, "a"))
        assert want.token_ids != llm.generate(PROMPTS[0], PARAMS).token_ids  # the adapter matters
        llm.load_adapter("b", path)
        llm.load_adapter("c", path)  # over budget: "a" is the least recently used idle adapter
        assert resident(registry) == ["b", "c"] and registry.names() == ["a", "b", "c"] and registry.evictions == 1
        again = llm.generate(PROMPTS[0], _with(PARAMS, "a"))  # read again from its file; "b" goes
        assert again.token_ids == want.token_ids
        assert resident(registry) == ["a", "c"] and registry.info()["a"]["loads"] == 2
        assert registry.resident_bytes() == 2 * size

        registry.acquire("c")  # a request holds "c": it is never evicted
        llm.load_adapter("d", path)
        assert resident(registry) == ["c", "d"]
        registry.acquire("d")
        before = (registry.info(), registry.evictions)
        with pytest.raises(AdapterError, match="does not fit the adapter memory budget"):
            llm.load_adapter("e", path)  # "c" and "d" are in use: no room, nothing evicted or added
        with pytest.raises(AdapterError, match="does not fit the adapter memory budget"):
            registry.acquire("a")  # evicted, and cannot come back beside them
        assert (registry.info(), registry.evictions) == before
        registry.release("c")
        registry.release("d")
        info = registry.info()["a"]
        assert (info["requests"], info["prompt_tokens"], info["generated_tokens"]) == (2, 2 * want.usage.prompt_tokens, 12)
    finally:
        registry.set_budget(None)
        for name in list(registry.info()):
            llm.unload_adapter(name)
    assert registry.resident_bytes() == 0 and llm.model.lora is None


def _with(params: SamplingParams, adapter: str) -> SamplingParams:
    return dataclasses.replace(params, adapter=adapter)
