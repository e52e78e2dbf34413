"""LoRA deltas inside the C decode steps (kernels/lora_delta.c): the kernel's delta against the torch
path's on every stacked linear, and on 4-bit SmolLM2 the C steps' adapter decodes against the torch
path, each row alone against the batch, base rows beside adapter rows against a base-only batch,
and adapter prompts whole against chunked and batched."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvgen.kernels import load
from kvgen.kv import CacheSpec, PagedCache, PagedStorage
from kvgen.kv.block_pool import BlockPool
from kvgen.models.fast_decode import LORA_LINEARS, lora_table
from tests.lora.conftest import PROMPT

ROWS = [None, "all-r8-rs", "qv-r4", "mlp-o-r16", None, "k-r2", "all-r8-rs"]  # ranks 2-16, and base rows


def test_c_delta_equals_the_torch_delta_and_leaves_base_rows_alone(smollm2_adapters) -> None:
    llm, _ = smollm2_adapters
    stacks = llm.model.lora
    table = lora_table(stacks, llm.config.num_layers)
    slots = torch.tensor(stacks.slots_of(ROWS))
    generator = torch.Generator().manual_seed(0)
    for (layer, fused), (a, b) in sorted(stacks.stacks.items())[:8]:
        x = torch.randn(len(ROWS), a.shape[2], generator=generator)
        base = torch.randn(len(ROWS), b.shape[2], generator=generator)

        def c_delta(rows: slice) -> torch.Tensor:
            y = base[rows].clone()
            entry = ctypes.byref(table, (layer * len(LORA_LINEARS) + LORA_LINEARS.index(fused)) * ctypes.sizeof(table._type_))
            load().kvgen_lora_delta(entry, x.shape[1], y.shape[1], x[rows].contiguous().data_ptr(), y.data_ptr(),
                                    y.shape[0], slots[rows].contiguous().data_ptr())  # fmt: skip
            return y

        batched = c_delta(slice(None))
        stacks.activate(ROWS, [1] * len(ROWS))
        try:
            reference = stacks.add_delta(layer, fused, x, base)
        finally:
            stacks.deactivate()
        where = f"layer {layer} {fused}"
        assert torch.allclose(batched, reference, rtol=1e-5, atol=1e-5), f"{where}: {(batched - reference).abs().max()}"
        assert (batched - base).abs().max() > 1e-3, f"{where}: the adapters add nothing, a vacuous check"
        for row, name in enumerate(ROWS):
            if name is None:  # untouched: the bits of the base-only step
                assert torch.equal(batched[row], base[row]), where
            assert torch.equal(c_delta(slice(row, row + 1))[0], batched[row]), f"{where}: row {row} alone differs"


@torch.inference_mode()
def decode(llm, names: list[str | None], steps: int = 4, fast: bool = True, fed: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's prompt (a different length per row) prefilled alone, then `steps` batched decode
    steps of all rows -> their logits [steps, rows, V]. Greedy, or fed the argmax of `fed`'s logits
    (another run's), so that both runs decode the same tokens."""
    ids = llm.tokenizer.encode(PROMPT)
    llm.model.use_fast_decode = fast
    storage = PagedStorage(CacheSpec.for_model(llm.config), BlockPool(64, 16))
    caches = [PagedCache(storage) for _ in names]
    try:
        prompts = [ids[: len(ids) - row] for row in range(len(names))]
        for cache, prompt, name in zip(caches, prompts, names):
            llm.model.forward_batch([prompt[:-1]], [cache], adapters=[name])
        tokens, logits = [[p[-1]] for p in prompts], []
        for _ in range(steps):
            logits.append(llm.model.forward_batch(tokens, caches, adapters=names))
            tokens = [[t] for t in (logits[-1] if fed is None else fed[len(logits) - 1]).argmax(-1).tolist()]
        return torch.stack(logits)
    finally:
        llm.model.use_fast_decode = True
        for cache in caches:
            cache.release()


def test_adapter_decodes_run_in_the_c_step_batch_invariant(smollm2_q4_adapters, monkeypatch) -> None:
    llm, _ = smollm2_q4_adapters
    decoder = llm.model.fast_decoder()
    seen = []
    step_rows = decoder.step_rows
    monkeypatch.setattr(decoder, "step_rows", lambda *args: seen.append(args[-1]) or step_rows(*args))
    batched = decode(llm, ROWS)
    assert seen and all(slots is not None and any(s >= 0 for s in slots) for slots in seen)  # the C step ran them
    base_only = decode(llm, [None] * len(ROWS))
    for row, name in enumerate(ROWS):
        assert torch.equal(decode(llm, ROWS[: row + 1])[:, row], batched[:, row]), f"row {row} ({name}) depends on the batch"
        if name is None:
            assert torch.equal(batched[:, row], base_only[:, row]), f"base row {row} changes beside adapter rows"
        else:
            assert not torch.equal(batched[:, row], base_only[:, row]), f"row {row}: {name} changes nothing"


def test_c_step_adapter_logits_agree_with_the_torch_path(smollm2_q4_adapters) -> None:
    """Both add the same deltas in fp32; int8 activations then amplify the different rounding, as
    they do between the two paths for base rows (a near tie may flip a greedy token): the bar is
    the base rows' agreement, on the same tokens."""
    llm, _ = smollm2_q4_adapters
    c_step = decode(llm, ROWS)
    torch_path = decode(llm, ROWS, fast=False, fed=c_step)
    kl = torch.nn.functional.kl_div(c_step.log_softmax(-1), torch_path.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    base_kl = max(kl[:, row].max().item() for row, name in enumerate(ROWS) if name is None)
    for row, name in enumerate(ROWS):
        assert kl[:, row].max().item() < max(4 * base_kl, 1e-3), f"row {row} ({name}): KL {kl[:, row].max().item()}"


@pytest.mark.parametrize("name", ["all-r8-rs", "k-r2"])
@torch.inference_mode()
def test_the_one_token_c_step_equals_the_rows_step(smollm2_q4_adapters, name) -> None:
    """LLM.model(..., adapter=) decodes through kvgen_decode_layers with the same deltas."""
    llm, _ = smollm2_q4_adapters
    ids = llm.tokenizer.encode(PROMPT)
    cache = llm.generator.new_cache(len(ids) + 4)
    try:
        llm.model(torch.tensor([ids[:-1]]), cache, adapter=name)
        token, logits = ids[-1], []
        for _ in range(4):
            logits.append(llm.model(torch.tensor([[token]]), cache, adapter=name)[0, -1])
            token = logits[-1].argmax().item()
    finally:
        cache.release()
    assert torch.equal(torch.stack(logits), decode(llm, [name])[:, 0])


@torch.inference_mode()
def test_a_base_prompt_prefilled_beside_adapter_prompts_gets_the_base_only_bits(smollm2_q4_adapters) -> None:
    """A prefill batch adds the deltas to adapter rows only: a base row's logits do not depend on
    its neighbours' adapters."""
    llm, _ = smollm2_q4_adapters
    ids = llm.tokenizer.encode(PROMPT)
    prompts = [ids[: len(ids) - row] for row in range(4)]

    def prefill(names: list[str | None]) -> torch.Tensor:
        storage = PagedStorage(CacheSpec.for_model(llm.config), BlockPool(64, 16))
        caches = [PagedCache(storage) for _ in names]
        try:
            return llm.model.forward_batch(prompts, caches, adapters=names)
        finally:
            for cache in caches:
                cache.release()

    mixed, base = prefill([None, "all-r8-rs", None, "mlp-o-r16"]), prefill([None] * 4)
    for row in (0, 2):
        assert torch.equal(mixed[row], base[row]), f"base row {row} changes beside adapter rows"
    assert not torch.equal(mixed[1], base[1])  # the adapters do apply


@torch.inference_mode()
def test_an_adapter_prompt_gets_the_same_bits_whole_chunked_and_beside_other_prompts(smollm2_q4_adapters) -> None:
    """Prompts run the C rows step with each row's deltas (kernels/lora_delta.c, one sum order per
    row): an adapter's prompt prefilled whole, in chunks, or in one forward beside other adapters'
    and base prompts gives the same logits."""
    llm, _ = smollm2_q4_adapters
    ids = llm.tokenizer.encode(PROMPT)
    storage = PagedStorage(CacheSpec.for_model(llm.config), BlockPool(64, 16))

    def prefill(chunks: list[int], name: str) -> torch.Tensor:
        cache, start = PagedCache(storage), 0
        try:
            for n in chunks:
                logits = llm.model.forward_batch([ids[start : start + n]], [cache], adapters=[name])[0]
                start += n
            return logits
        finally:
            cache.release()

    whole = prefill([len(ids)], "all-r8-rs")
    for chunks in ([len(ids) - 3, 3], [2, 5, len(ids) - 7], [1] * len(ids)):
        assert torch.equal(prefill(chunks, "all-r8-rs"), whole), chunks
    names = [None, "mlp-o-r16", "all-r8-rs", "k-r2"]
    caches = [PagedCache(storage) for _ in names]
    try:
        beside = llm.model.forward_batch([ids[:-2], ids[1:], ids, ids[:5]], caches, adapters=names)
    finally:
        for cache in caches:
            cache.release()
    assert torch.equal(beside[2], whole)
    assert not torch.equal(prefill([len(ids)], "mlp-o-r16"), whole)  # the adapters do differ
